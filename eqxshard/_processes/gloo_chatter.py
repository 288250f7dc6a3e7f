"""Gloo's connection chatter, dropped from the launcher's output.

With gloo CPU collectives every process prints, for every communicator it sets up,

    [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1

(16 such lines for a 2-process run). They come from C++ on the same stream as the
script's own output, so a message can be glued to another line or split over two. The
launcher forwards the first one of each process, marked as the last it shows, and drops
the rest, wherever they sit in a line.
"""

from __future__ import annotations

import re

MESSAGE = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    rb"Expected number of connected peer ranks is : \d+"
)
# A message cut off at the end of a line, and the rest of it at the start of the next.
HEAD = re.compile(rb"\[Gloo\] Rank \d+[^\n]*$")
TAIL = re.compile(rb"^[^\n]*?peer ranks is : \d+")


class GlooChatter:
    """Filters one process's output lines (bytes, each ending with a newline)."""

    def __init__(self) -> None:
        self.shown = False  # the first message of this process was forwarded
        self.cut = False  # the previous line ended in the head of a message

    def filter(self, line: bytes) -> list[bytes]:
        """The lines to forward for `line`: none, it, what is left of it without Gloo's
        messages, and before that this process's first message, once."""
        found: list[bytes] = []
        if self.cut:
            self.cut = False
            tail = TAIL.match(line)
            if tail:
                found.append(tail.group(0))
                line = line[tail.end() :]
        found += MESSAGE.findall(line)
        line = MESSAGE.sub(b"", line)
        head = HEAD.search(line.rstrip(b"\r\n"))
        if head:
            found.append(head.group(0))
            line = line[: head.start()] + b"\n"
            self.cut = True
        if not found:
            return [line]
        lines = []
        if not self.shown:
            self.shown = True
            first = found[0] if MESSAGE.fullmatch(found[0]) else b"[Gloo] connected to peer ranks"
            lines.append(first + b" (further [Gloo] connection lines hidden)\n")
        if line.strip():
            lines.append(line)
        return lines
