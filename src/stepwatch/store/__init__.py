"""The run store: every metric of every run in one SQLite file, written off the training thread.

``RunRecorder`` (a callback) records a run; ``Store`` reads runs back; ``RunWriter`` is the
background writer both the recorder and your own code can use.
"""

from ._schema import default_path
from .reader import RunInfo, Store
from .recorder import RunRecorder
from .writer import RunWriter

__all__ = ["RunInfo", "RunRecorder", "RunWriter", "Store", "default_path"]
