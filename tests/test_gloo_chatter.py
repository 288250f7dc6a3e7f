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
        MSG + b" (further [Gloo] connection lines hidden)\n",
        b"ok\n",
    ]


def test_a_message_cut_at_any_byte_leaves_no_fragment():
    # The launcher showed `[1] [Gloo] Rank ` when a message was cut right after "Rank ".
    for cut in range(1, len(MSG)):
        out = run([MSG + b"\n", b"step " + MSG[:cut] + b"\n", MSG[cut:] + b" loss 1\n"])
        assert out[1:] == [b"step \n", b" loss 1\n"], cut


def test_a_message_cut_over_three_lines_is_dropped():
    out = run([MSG + b"\n", MSG[:14] + b"\n", MSG[14:40] + b"\n", MSG[40:] + b"\n", b"ok\n"])
    assert out[1:] == [b"ok\n"]


def test_a_line_ending_like_a_message_loses_nothing():
    # `[...` at a line's end that the next line does not complete is the script's own.
    lines = [b"see [Gl\n", b"oves]\n", b"list [\n", b"1]\n", b"last [Gloo] Rank 1"]
    assert run(lines) == lines[:-1]  # the last is held until the next line says what it is
    chatter = GlooChatter()
    assert chatter.filter(lines[-1]) == []
    assert chatter.flush() == [lines[-1]]  # the output ended: forwarded as it was
