"""The seam between what trains and what watches: the run view (:class:`RunView`), the loss
tap (:class:`LossTap`) every monitor reads step losses from, and the one alert path
(:class:`AlertPath`). Whatever trains fills a run view; the monitors read only from it."""

from .alerts import AlertPath, Raised
from .run import RunView, view_of
from .tap import Chunk, LossTap

__all__ = ["AlertPath", "Chunk", "LossTap", "Raised", "RunView", "view_of"]
