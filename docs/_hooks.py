"""MkDocs hooks: pages made from what the project already holds, so they cannot drift.

- ``<!-- stepwatch-readme -->`` (the home page) becomes README.md, its links into ``docs/``
  made relative to the site.
- ``<!-- stepwatch-help -->`` (the CLI reference) becomes the help of ``stepwatch`` and of each
  of its commands, as argparse prints them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

HELP = "<!-- stepwatch-help -->"
README = "<!-- stepwatch-readme -->"
ROOT = Path(__file__).resolve().parents[1]
# README's links, as the site names the same files.
README_LINKS = {
    "](docs/": "](",
    "](bench/RESULTS.md)": "](results.md)",
    "](CHANGELOG.md)": "](changelog.md)",
}


def _help_sections() -> str:
    # argparse wraps to the terminal's width: fix it so the page is the same everywhere.
    os.environ["COLUMNS"] = "80"
    from stepwatch.cli import _build_parser

    parser = _build_parser()
    sections = ["## stepwatch\n\n```text\n" + parser.format_help() + "```\n"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                sections.append(f"## stepwatch {name}\n\n```text\n{sub.format_help()}```\n")
    return "\n".join(sections)


def _readme() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for old, new in README_LINKS.items():
        text = text.replace(old, new)
    return text


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if README in markdown:
        markdown = markdown.replace(README, _readme())
    if HELP in markdown:
        markdown = markdown.replace(HELP, _help_sections())
    return markdown
