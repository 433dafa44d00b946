"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


# The torchrun example runs here as one process of one: its DistributedMonitor says so; the
# mixed-precision example runs in bfloat16 on this CPU, where its loss scaler is not needed.
@pytest.mark.filterwarnings("ignore:DistributedMonitor is in a run of one process")
@pytest.mark.filterwarnings("ignore:'loss_scale_manager' with bfloat16")
# Lightning 2.6 on torch 2.13 warns about its own use of torch's pytree LeafSpec.
@pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)`:FutureWarning")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {"__name__": "doc"})
