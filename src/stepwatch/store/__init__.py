"""The run store: every metric of every run in one SQLite file, written off the training thread.

``RunRecorder`` (a callback) records a run; ``Store`` reads runs back; ``RunWriter`` is the
background writer both the recorder and your own code can use. Only ``RunRecorder`` needs
PyTorch, and it is loaded on first use: reading a store never imports torch.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_face

if TYPE_CHECKING:
    from ._schema import default_path
    from .reader import RunInfo, Store
    from .recorder import RunRecorder
    from .writer import RunWriter

__all__ = ["RunInfo", "RunRecorder", "RunWriter", "Store", "default_path"]

__getattr__, __dir__ = lazy_face(
    __name__,
    globals(),
    {
        "RunInfo": ".reader",
        "RunRecorder": ".recorder",
        "RunWriter": ".writer",
        "Store": ".reader",
        "default_path": "._schema",
    },
    submodules=("reader", "recorder", "writer"),
)
del TYPE_CHECKING, lazy_face
