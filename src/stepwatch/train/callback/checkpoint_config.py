"""``CheckpointConfig``: when and what ``ModelCheckpoint`` saves, as MindSpore configures it."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..._validation import check_bool, check_int, check_number

__all__ = ["CheckpointConfig"]


class CheckpointConfig:
    """When and what :class:`ModelCheckpoint` saves.

    Args:
        save_checkpoint_steps: save every N global steps (set, it turns the seconds policy off).
        save_checkpoint_seconds: save when this many seconds passed since the last save.
        keep_checkpoint_max: keep at most this many newest files (0/None: see the next).
        keep_checkpoint_per_n_minutes: without a maximum, keep one file per N minutes.
        integrated_save: accepted for MindSpore compatibility (always integrated on PyTorch).
        async_save: write files on a background thread; training waits only for the copy of
            the tensors to host memory, not for the disk.
        saved_network: save this module's weights instead of the training network's.
        append_info: extra values stored in the file: ``"epoch_num"``, ``"step_num"`` and at
            most one dict of ``str`` to number/str.
        exception_save: when training dies, write ``{prefix}-{epoch}_{step}_breakpoint.pt``.
        save_best_only: save at epoch ends only when ``monitor`` improved (the step and
            seconds policies are then off).
        monitor / mode / min_delta: the value that decides "best" (see ``EarlyStopping``).
        save_last: keep ``{prefix}-last.pt`` pointing at the newest file (a hard link, or a
            copy where links are not possible).

    Raises:
        ValueError: the steps, seconds, max and per-n-minutes arguments are all 0/None; a
            negative count; a bad ``append_info``.
        TypeError: an argument of the wrong type.
    """

    def __init__(
        self,
        save_checkpoint_steps: int | None = 1,
        save_checkpoint_seconds: int | None = None,
        keep_checkpoint_max: int | None = 5,
        keep_checkpoint_per_n_minutes: int | None = None,
        integrated_save: bool = True,
        async_save: bool = False,
        saved_network: nn.Module | None = None,
        append_info: list[Any] | None = None,
        exception_save: bool = False,
        save_best_only: bool = False,
        monitor: str = "eval_loss",
        mode: str = "auto",
        min_delta: float = 0.0,
        save_last: bool = True,
    ) -> None:
        steps = check_int(
            "save_checkpoint_steps", save_checkpoint_steps, minimum=0, allow_none=True
        )
        seconds = check_int(
            "save_checkpoint_seconds", save_checkpoint_seconds, minimum=0, allow_none=True
        )
        keep_max = check_int("keep_checkpoint_max", keep_checkpoint_max, minimum=0, allow_none=True)
        per_minutes = check_int(
            "keep_checkpoint_per_n_minutes",
            keep_checkpoint_per_n_minutes,
            minimum=0,
            allow_none=True,
        )
        if not steps and not seconds and not keep_max and not per_minutes:
            raise ValueError(
                "The input arguments 'save_checkpoint_steps', 'save_checkpoint_seconds', "
                "'keep_checkpoint_max' and 'keep_checkpoint_per_n_minutes' can't be all None or 0."
            )
        # As MindSpore stores them: a step policy turns the seconds policy off (None), a
        # maximum turns the per-n-minutes rule off (None), and with neither, one file is kept.
        if steps:
            seconds = None
        if keep_max:
            per_minutes = None
        elif not per_minutes:
            keep_max = 1
        self.save_checkpoint_steps = steps
        self.save_checkpoint_seconds = seconds
        self.keep_checkpoint_max = keep_max
        self.keep_checkpoint_per_n_minutes = per_minutes
        self.integrated_save = check_bool("integrated_save", integrated_save)
        self.async_save = check_bool("async_save", async_save)
        if saved_network is not None and not isinstance(saved_network, nn.Module):
            raise TypeError(
                f"'saved_network' must be a torch.nn.Module or None, but got "
                f"{type(saved_network).__name__}."
            )
        self.saved_network = saved_network
        self.append_info = self._check_append_info(append_info)
        self.exception_save = check_bool("exception_save", exception_save)
        self.save_best_only = check_bool("save_best_only", save_best_only)
        self.monitor = monitor
        self.mode = mode
        self.min_delta = check_number("min_delta", min_delta, minimum=0.0) or 0.0
        self.save_last = check_bool("save_last", save_last)

    def get_checkpoint_policy(self) -> dict[str, Any]:
        """The saving and keeping policy, as MindSpore's ``get_checkpoint_policy`` gives it."""
        return {
            "save_checkpoint_steps": self.save_checkpoint_steps,
            "save_checkpoint_seconds": self.save_checkpoint_seconds,
            "keep_checkpoint_max": self.keep_checkpoint_max,
            "keep_checkpoint_per_n_minutes": self.keep_checkpoint_per_n_minutes,
            "saved_network": self.saved_network,
        }

    @staticmethod
    def _check_append_info(append_info: Any) -> list[Any]:
        if append_info is None:
            return []
        if not isinstance(append_info, list):
            raise TypeError(
                f"'append_info' must be a list or None, but got {type(append_info).__name__}."
            )
        dicts = 0
        for item in append_info:
            if isinstance(item, str):
                if item not in ("epoch_num", "step_num"):
                    raise ValueError(
                        "'append_info' strings must be 'epoch_num' or 'step_num', but got "
                        f"{item!r}."
                    )
            elif isinstance(item, dict):
                dicts += 1
                for key, value in item.items():
                    if (
                        not isinstance(key, str)
                        or isinstance(value, bool)
                        or not isinstance(value, (int, float, str))
                    ):
                        raise TypeError(
                            "'append_info' dict entries must map str to int, float or str, but "
                            f"got {key!r}: {value!r}."
                        )
            else:
                raise TypeError(
                    "'append_info' items must be 'epoch_num', 'step_num' or a dict, but got "
                    f"{item!r}."
                )
        if dicts > 1:
            raise ValueError("'append_info' may hold at most one dict.")
        return list(append_info)
