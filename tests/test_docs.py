"""Every ```python block of README.md and docs/**/*.md runs, as a reader would paste it.

The convention (for everyone writing docs):

- Each page's ```python blocks run top to bottom in one fresh Python process, sharing one
  namespace, with 8 CPU devices configured before JAX starts and warnings as errors.
  So a page defines every name it uses, above the block that uses it.
- A block that must not run is fenced as ```text, ```bash or ```console, or has the line
  `<!-- skip: reason -->` immediately before its ```python fence. Skipped blocks are
  reported one by one as skipped tests (`-ra` lists them with their reasons).
- A failure names the page, the block, the line of the page and the traceback (whose line
  numbers are the page's).
- A ```text block with the line `<!-- output -->` immediately before its fence shows what
  the ```python block above it prints, and is checked against it: line by line, where a
  line `...` stands for any lines and a line ending in `...` for any line that starts as
  it does. So the figures a page shows are the ones its code prints.

Pages are collected automatically: a new page in docs/ is tested without editing this file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import eqxshard

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
SKIP = re.compile(r"^\s*<!--\s*skip\b\s*:?\s*(.*?)\s*-->\s*$")
OUTPUT = re.compile(r"^\s*<!--\s*output\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the page where the code starts (after the fence)
    code: str
    skip: str | None  # the reason, if the block is marked to be skipped


def fenced(lines: list[str]):
    """Each fenced block of a page's lines: (index of its fence line, its language, the
    line before the fence, its body with the fence's indent taken off)."""
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, language = match.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        previous = lines[i - 1] if i > 0 else ""
        yield i, language, previous, [line[len(indent) :] for line in lines[i + 1 : end]]
        i = end + 1


def parse(text: str) -> list[Block]:
    """The ```python blocks of a Markdown page, with the skip reason of each."""
    blocks = []
    for i, language, previous, body in fenced(text.splitlines()):
        if language == "python":
            marker = SKIP.match(previous)
            blocks.append(Block(i + 2, "\n".join(body) + "\n", marker and marker.group(1)))
    return blocks


# Runs in the fresh process: each block compiled with the page's name and its line offset,
# so a traceback points at the page's own lines; on failure, which block it was.
DRIVER = r"""
import io, json, os, sys, traceback, warnings
warnings.simplefilter("error")
page, blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
printed = []


class Tee(io.TextIOBase):
    def write(self, text):
        printed[-1].append(text)
        return sys.__stdout__.write(text)

    def flush(self):
        sys.__stdout__.flush()


sys.stdout = Tee()
for number, (line, code) in enumerate(blocks, 1):
    printed.append([])
    try:
        exec(compile("\n" * (line - 1) + code, page, "exec"), namespace)
        if os.environ.get("EQXSHARD_DOCS_PRINTED"):
            with open(os.environ["EQXSHARD_DOCS_PRINTED"], "w") as f:
                json.dump(["".join(p) for p in printed], f)
    except BaseException:
        numbered = "".join(
            f"{line + k:5d} | {text}\n" for k, text in enumerate(code.splitlines())
        )
        sys.stderr.write(
            f"\n{page}: python block {number}, starting at line {line}, failed:\n"
            f"{numbered}\n{traceback.format_exc()}"
        )
        sys.exit(1)
"""


def run_page(
    path: Path, cwd: Path, timeout: float = 600, printed: Path | None = None
) -> subprocess.CompletedProcess:
    """Runs the page's unskipped python blocks in one fresh process with 8 CPU devices
    (what each block prints written to `printed` as a JSON list, if given)."""
    blocks = [(b.line, b.code) for b in parse(path.read_text()) if b.skip is None]
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count=8".strip()
    env = {
        **os.environ,
        "XLA_FLAGS": flags,
        "JAX_PLATFORMS": "cpu",
        # This checkout's eqxshard, whatever is installed.
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "MPLBACKEND": "Agg",
        "EQXSHARD_DOCS_PRINTED": "" if printed is None else str(printed),
    }
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps([name, blocks]),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# Pages with no python block to run (the API reference) have nothing to test here.
RUNNABLE = [p for p in PAGES if any(b.skip is None for b in parse(p.read_text()))]


@pytest.mark.heavy
@pytest.mark.parametrize("path", RUNNABLE, ids=_id)
def test_page_runs(path: Path, tmp_path: Path):
    printed = tmp_path / "printed.json"
    result = run_page(path, cwd=tmp_path, printed=printed)
    assert result.returncode == 0, result.stdout + result.stderr
    shown = outputs(path.read_text())
    if shown:
        by_block = json.loads(printed.read_text())
        wrong = [
            f"{_id(path)}:{line}: the text block differs from what python block {n + 1} "
            f"prints, which is:\n{by_block[n]}"
            for line, n, text in shown
            if not output_matches(text, by_block[n])
        ]
        assert not wrong, "\n".join(wrong)


def outputs(text: str) -> list[tuple[int, int, str]]:
    """The page's `<!-- output -->` text blocks: (line of the block, index of the python
    block run above it, the text)."""
    found = []
    ran = -1  # unskipped python blocks seen so far, less one
    for i, language, previous, body in fenced(text.splitlines()):
        if language == "python" and not SKIP.match(previous):
            ran += 1
        elif language == "text" and OUTPUT.match(previous):
            if ran < 0:
                raise ValueError(f"line {i + 1}: an output block with no python block above")
            found.append((i + 2, ran, "\n".join(body)))
    return found


def output_matches(expected: str, printed: str) -> bool:
    """Whether `printed` reads as `expected` shows it: line by line, `...` alone standing
    for any lines and a line ending in `...` for any line that starts as it does."""
    want = [line.rstrip() for line in expected.splitlines()]
    got = [line.rstrip() for line in printed.splitlines()]

    def match(w: int, g: int) -> bool:
        if w == len(want):
            return g == len(got)
        if want[w] == "...":
            return any(match(w + 1, k) for k in range(g, len(got) + 1))
        if g == len(got):
            return False
        line = want[w]
        same = got[g].startswith(line[:-3].rstrip()) if line.endswith("...") else got[g] == line
        return same and match(w + 1, g + 1)

    return match(0, 0)


def test_output_blocks_are_checked_against_what_their_block_prints(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint('a 1')\nprint('b 2')\nprint('c 3')\n```\n"
        "<!-- output -->\n```text\na 1\n...\nc ...\n```\n"
    )
    printed = tmp_path / "printed.json"
    assert run_page(page, cwd=tmp_path, printed=printed).returncode == 0
    ((line, n, text),) = outputs(page.read_text())
    assert (line, n) == (8, 0) and output_matches(text, json.loads(printed.read_text())[0])
    assert not output_matches("a 1\nc 3", "a 1\nb 2\nc 3\n")
    assert not output_matches("a 1\n...\nd ...", "a 1\nb 2\nc 3\n")
    assert output_matches("...", "anything\n")


def _skipped_blocks():
    for path in PAGES:
        for block in parse(path.read_text()):
            if block.skip is not None:
                yield pytest.param(block.skip, id=f"{_id(path)}:{block.line}")


SKIPPED_BLOCKS = list(_skipped_blocks())
if SKIPPED_BLOCKS:  # else no test: pytest would report an empty parameter set as a skip

    @pytest.mark.parametrize("reason", SKIPPED_BLOCKS)
    def test_skipped_block(reason: str):
        """One skipped test per skipped block, so the run lists each with its reason."""
        pytest.skip(f"docs block not run: {reason}")


def bad_skip_markers(text: str, name: str) -> list[str]:
    """Skip markers without a reason, or not immediately before a ```python fence."""
    bad = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not re.match(r"\s*<!--\s*skip", line):
            continue
        match = SKIP.match(line)
        if not match or not match.group(1):
            bad.append(f"{name}:{i + 1}: no reason: {line.strip()}")
        elif i + 1 >= len(lines) or not re.match(r"\s*(`{3,}|~{3,})python\b", lines[i + 1]):
            bad.append(f"{name}:{i + 1}: not immediately before a ```python fence")
    return bad


def test_skip_markers_have_a_reason_and_a_block():
    bad = [line for path in PAGES for line in bad_skip_markers(path.read_text(), _id(path))]
    assert not bad, "skip markers must read `<!-- skip: reason -->`:\n" + "\n".join(bad)


def test_bad_skip_markers_are_found():
    text = "<!-- skip -->\n```python\n```\n<!-- skip: why -->\n\n```python\n```\n"
    assert bad_skip_markers(text, "p.md") == [
        "p.md:1: no reason: <!-- skip -->",
        "p.md:4: not immediately before a ```python fence",
    ]
    assert bad_skip_markers("<!-- skip: two hosts -->\n```python\n```\n", "p.md") == []


# The runner itself.


def test_parse_finds_blocks_lines_and_skips():
    page = "\n".join(
        [
            "# Title",  # 1
            "```python",  # 2
            "a = 1",  # 3
            "```",  # 4
            "```bash",  # 5
            "rm -rf /",  # 6
            "```",  # 7
            "<!-- skip: needs two hosts -->",  # 8
            "```python",  # 9
            "b = undefined",  # 10
            "```",  # 11
            "    ```python",  # 12 (indented, e.g. in a list)
            "    c = a + 1",  # 13
            "    ```",  # 14
        ]
    )
    blocks = parse(page)
    assert [(b.line, b.code, b.skip) for b in blocks] == [
        (3, "a = 1\n", None),
        (10, "b = undefined\n", "needs two hosts"),
        (13, "c = a + 1\n", None),
    ]


def test_failure_names_page_block_and_line(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("Text\n\n```python\nx = 1\n```\n\n```python\ny = x + 1\nz = y / 0\n```\n")
    result = run_page(page, cwd=tmp_path)
    assert result.returncode == 1
    assert "python block 2, starting at line 8, failed" in result.stderr
    assert "    9 | z = y / 0" in result.stderr
    assert re.search(r'File ".*page.md", line 9', result.stderr), result.stderr
    assert "ZeroDivisionError" in result.stderr


def test_blocks_share_one_namespace_and_see_8_devices(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport jax\nn = jax.device_count()\n```\n"
        "<!-- skip: would fail -->\n```python\nraise SystemExit(3)\n```\n"
        "```python\nassert n == 8, n\nprint('ok', n)\n```\n"
    )
    result = run_page(page, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok 8\n"


# The API reference: every public name has a `::: eqxshard.NAME` line in docs/ (api.md).

PUBLIC = sorted(
    name
    for name in vars(eqxshard)
    if not name.startswith("_") and not isinstance(getattr(eqxshard, name), type(eqxshard))
)


def test_every_public_name_has_an_api_entry():
    documented = set()
    for path in (ROOT / "docs").glob("**/*.md"):
        documented |= set(re.findall(r"^::: eqxshard\.(\w+)\s*$", path.read_text(), re.M))
    assert {"filter_shard", "describe", "filter_shard_map"} <= set(PUBLIC)
    missing = [name for name in PUBLIC if name not in documented]
    assert not missing, f"add a `::: eqxshard.NAME` line to docs/api.md for: {missing}"
    unknown = sorted(documented - set(PUBLIC))
    assert not unknown, f"docs/api.md documents names eqxshard does not export: {unknown}"


def test_notebook_pages_are_titled_by_their_whole_heading():
    """mkdocs-jupyter titles a notebook page by its first heading with the inline code
    dropped ("on a large grid: and"); the site titles it from the nav instead, which must
    spell the heading in full."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^\s+ignore_h1_titles: true$", config, re.M)
    nav = dict(
        (path, title.strip('"'))
        for title, path in re.findall(r"^\s+- (.+): (examples/\w+\.ipynb)$", config, re.M)
    )
    notebooks = sorted(p.name for p in (ROOT / "docs" / "examples").glob("*.ipynb"))
    assert sorted(Path(p).name for p in nav) == notebooks
    for path, title in nav.items():
        cells = json.loads((ROOT / "docs" / path).read_text())["cells"]
        heading = "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])
        heading = heading.splitlines()[0].lstrip("# ").replace("`", "")
        assert title == heading, f"{path}: nav title {title!r}, heading {heading!r}"
