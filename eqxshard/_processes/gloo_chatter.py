"""Gloo's connection chatter, dropped from the launcher's output.

With gloo CPU collectives every process prints, for every communicator it sets up,

    [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1

(16 such lines for a 2-process run). They come from C++ on the same stream as the
script's own output, so a message can be glued to another line or cut anywhere, over two
lines or more. The launcher forwards the first one of each process, marked as the last
it shows, and drops the rest, wherever they sit in a line.

A line that ends in the start of a message (any prefix of it, down to its `[`) is held
back; the next line either completes the message (which is dropped, the rest of both
lines forwarded) or does not, and then the held line is forwarded as it was: nothing of
the script's output is lost or changed.
"""

from __future__ import annotations

import re

MESSAGE = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    rb"Expected number of connected peer ranks is : \d+"
)
# The message as literal pieces and numbers, to tell whether some bytes begin it.
PIECES: tuple[bytes | None, ...] = (
    b"[Gloo] Rank ",
    None,
    b" is connected to ",
    None,
    b" peer ranks. Expected number of connected peer ranks is : ",
    None,
)


def begins_message(text: bytes) -> bool:
    """Whether `text` is the start of a message (a prefix of one, or a whole one)."""
    i = 0
    for piece in PIECES:
        if i == len(text):
            return True
        if piece is None:
            j = i
            while j < len(text) and text[j : j + 1].isdigit():
                j += 1
            if j == i:
                return False
            i = j
        else:
            n = min(len(piece), len(text) - i)
            if text[i : i + n] != piece[:n]:
                return False
            i += n
    return i == len(text)


def held_head(line: bytes) -> int | None:
    """Where the start of a message that runs past the end of `line` begins, if one does."""
    body = line.rstrip(b"\r\n")
    start = body.find(b"[")
    while start != -1:
        if begins_message(body[start:]) and not MESSAGE.fullmatch(body[start:]):
            return start
        start = body.find(b"[", start + 1)
    return None


class GlooChatter:
    """Filters one process's output lines (bytes, each ending with a newline)."""

    def __init__(self) -> None:
        self.shown = False  # the first message of this process was forwarded
        self.waiting: list[bytes] = []  # lines held back: the first ends in `self.held`
        self.held = b""  # the start of a message those lines end in, joined
        self.waiting_head = b""  # that start as the first held line ends in it

    def filter(self, line: bytes) -> list[bytes]:
        """The lines to forward for `line`: none, it, what is left of it without Gloo's
        messages, and before that this process's first message, once. A line that ends in
        the start of a message is held back until the next line says whether it was one."""
        lines: list[bytes] = []
        found: list[bytes] = []
        ahead: list[bytes] = []  # what the held line had before the message it ended in
        if self.waiting:
            joined = self.held + line.rstrip(b"\r\n")
            whole = MESSAGE.match(joined)
            if whole and whole.end() > len(self.held):
                found.append(whole.group(0))
                first = self.waiting[0]
                before = first[: len(first.rstrip(b"\r\n")) - len(self.waiting_head)]
                if before.strip():
                    ahead.append(before + b"\n")
                line = line[whole.end() - len(self.held) :]
                self.waiting, self.held = [], b""
            elif begins_message(joined) and not MESSAGE.fullmatch(joined):
                self.waiting.append(line)  # cut over three lines or more
                self.held = joined
                return []
            else:  # not Gloo's after all: forwarded as it was
                lines += self.waiting
                self.waiting, self.held = [], b""
        found += MESSAGE.findall(line)
        line = MESSAGE.sub(b"", line)
        head = held_head(line)
        if head is not None:
            self.waiting = [line]
            self.held = self.waiting_head = line.rstrip(b"\r\n")[head:]
        if found and not self.shown:
            self.shown = True
            lines.append(found[0] + b" (further [Gloo] connection lines hidden)\n")
        lines += ahead
        if head is None and (line.strip() or not found):
            lines.append(line)
        return lines

    def flush(self) -> list[bytes]:
        """The lines still held back (the output ended with the start of a message that
        never finished): forwarded as they were."""
        lines, self.waiting, self.held = self.waiting, [], b""
        return lines
