"""The launcher forwards one Gloo connection line per process and drops the rest, also
when a message is glued to the script's output or split over two lines."""

from eqxshard._processes.gloo_chatter import GlooChatter

MSG = b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


def run(lines: list[bytes]) -> list[bytes]:
    chatter = GlooChatter()
    return [kept for line in lines for kept in chatter.filter(line)]


def test_first_message_kept_once_the_rest_dropped():
    out = run([MSG + b"\n"] * 8 + [b"step 0 loss 1.0\n"])
    assert out == [MSG + b" (further [Gloo] connection lines hidden)\n", b"step 0 loss 1.0\n"]


def test_other_lines_untouched():
    lines = [b"step 0\n", b"Gloo is a library\n", b"[1] done\n"]
    assert run(lines) == lines


def test_message_glued_to_output():
    out = run([MSG + b"\n", b"step 1 loss 0.5" + MSG + b"\n", MSG + b"final loss 0.1\n"])
    assert out[1:] == [b"step 1 loss 0.5\n", b"final loss 0.1\n"]


def test_message_split_over_two_lines():
    head, tail = MSG[:30], MSG[30:]
    out = run(
        [MSG + b"\n", b"step 2 " + head + b"\n", tail + b"step 3\n", head + b"\n", tail + b"\n"]
    )
    assert out[1:] == [b"step 2 \n", b"step 3\n"]
    assert not any(b"Gloo" in line or b"peer" in line for line in out[1:])


def test_first_message_split_is_still_reported():
    out = run([MSG[:20] + b"\n", MSG[20:] + b"\n", b"ok\n"])
    assert out == [
        b"[Gloo] connected to peer ranks (further [Gloo] connection lines hidden)\n",
        b"ok\n",
    ]
