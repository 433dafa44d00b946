"""Mixed precision, named as ``mindspore.amp`` names it: ``from stepwatch.amp import
DynamicLossScaleManager``. Pass ``amp_level=`` (or ``precision=``) and ``loss_scale_manager=``
to :class:`stepwatch.Model`; :mod:`stepwatch.train.step` says what each level runs."""

from .train.step import DynamicLossScaleManager, FixedLossScaleManager, LossScaleManager

__all__ = ["DynamicLossScaleManager", "FixedLossScaleManager", "LossScaleManager"]
