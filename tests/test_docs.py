"""Every page of the documentation runs as written: README.md and each page under docs/.

A page's fenced blocks run in order, in a scratch folder of the page's own: its ``python``
blocks in one namespace (a later block may use what an earlier one made, as a reader going down
the page would), and each line of its ``bash`` blocks as a shell command, with the stepwatch
command of this checkout on PATH. ``text`` blocks are output and are not run. A block that
cannot run in a test (it installs, starts a server, needs another machine) carries the marker
``<!-- docs-test: skip (why) -->`` on the line above it, where every reader sees it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"python": "python", "bash": "bash", "text": "text"}
SKIP = re.compile(r"^<!-- docs-test: skip \((?P<why>[^)]+)\) -->$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[^`\s]*)\s*$")
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')
# A shell line that ran longer than this is stuck (a server, a prompt): fail rather than hang.
LINE_TIMEOUT_S = 120


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skip: str | None  # why it is left out, or None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with their skip markers."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, start = opening["indent"], i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :])
            i += 1
        above = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = SKIP.match(above.strip())
        found.append(
            Block(page, start + 1, opening["lang"], "\n".join(body) + "\n",
                  marker["why"] if marker else None)
        )  # fmt: skip
        i += 1
    return found


def with_snippets(text: str) -> str:
    """The block as the site shows it: a ``--8<-- "path"`` line is that file's text."""
    out = []
    for line in text.splitlines():
        snippet = SNIPPET.match(line.strip())
        out.append((ROOT / snippet["path"]).read_text(encoding="utf-8") if snippet else line)
    return "\n".join(out) + "\n"


def shell_lines(text: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blanks left out."""
    commands, current = [], ""
    for line in text.splitlines():
        part = line.strip() if current else line
        if part.rstrip().endswith("\\"):
            current += part.rstrip()[:-1].rstrip() + " "
            continue
        current += part
        if current.strip() and not current.lstrip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands


def shell_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["MPLBACKEND"] = "Agg"
    env.pop("STEPWATCH_DB", None)  # the pages' commands name their stores, or mean ./stepwatch.db
    return env


def run_shell(block: Block, folder: Path) -> None:
    for command in shell_lines(block.text):
        try:
            done = subprocess.run(
                ["bash", "-c", command], cwd=folder, env=shell_env(), stdin=subprocess.DEVNULL,
                capture_output=True, text=True, timeout=LINE_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: `{command}` ran past {LINE_TIMEOUT_S} s")
        if done.returncode != 0:
            pytest.fail(
                f"{block.where}: `{command}` exited {done.returncode}\n"
                f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}"
            )


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# The torchrun example runs here as one process of one: its DistributedMonitor says so; the
# mixed-precision example runs in bfloat16 on this CPU, where its loss scaler is not needed.
@pytest.mark.filterwarnings("ignore:DistributedMonitor is in a run of one process")
@pytest.mark.filterwarnings("ignore:'loss_scale_manager' with bfloat16")
# Lightning 2.6 on torch 2.13 warns about its own use of torch's pytree LeafSpec.
@pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)`:FutureWarning")
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_page_runs_as_written(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Lines such as `python examples/hand_loop.py` are written for the repository's root.
    for folder in ("examples", "bench"):
        (tmp_path / folder).symlink_to(ROOT / folder, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "doc"}
    for block in blocks_of(page):
        if block.skip is not None or LANGUAGES.get(block.lang) == "text":
            continue
        if block.lang == "python":
            code = compile(with_snippets(block.text), block.where, "exec")
            exec(code, namespace)
        elif block.lang == "bash":
            run_shell(block, tmp_path)


def test_every_block_says_its_language() -> None:
    unnamed = [b.where for p in PAGES for b in blocks_of(p) if b.lang not in LANGUAGES]
    assert not unnamed, f"fenced blocks without python, bash or text: {unnamed}"


def test_few_blocks_are_left_out_each_with_its_reason() -> None:
    skipped = [(b.where, b.skip) for p in PAGES for b in blocks_of(p) if b.skip is not None]
    assert all(why.strip() for _, why in skipped)
    assert len(skipped) <= 12, f"keep the blocks the test leaves out few: {skipped}"


def test_the_pages_python_and_shell_are_found() -> None:
    # The parser finds what is there: a page that lost its blocks would pass the runs above.
    readme = blocks_of(ROOT / "README.md")
    assert [b.lang for b in readme if b.skip is None and b.lang != "text"] == ["python", "bash"]
    cli = blocks_of(ROOT / "docs" / "cli.md")
    assert "stepwatch show 2 --db runs.db" in shell_lines(cli[1].text)
    assert shell_lines("a \\\n  b\n# note\n\nc") == ["a b", "c"]


def test_readme_links_reach_files() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "README.md links into the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
