"""How the CLI lays out text."""

from __future__ import annotations

from stepwatch import _format as fmt


def test_tables_of_unicode_names_stay_aligned() -> None:
    text = fmt.table(["id", "name", "status"], [["1", "训练-一", "finished"], ["2", "café", "x"]])
    lines = text.splitlines()
    # The third column starts in the same terminal column on every line.
    starts = [
        fmt.width(line[: line.index(word)])
        for line, word in zip(lines, ["status", "finished", "x"])
    ]
    assert len(set(starts)) == 1
    assert fmt.width("训练") == 4 and fmt.width("cafe\u0301") == 4
