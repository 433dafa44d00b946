"""``stepwatch.context``: MindSpore's ``context`` module, for code that imports it.

Callback files and training scripts written for MindSpore often import ``context`` beside
``Callback`` (``from mindspore import context``) and set it up at the top::

    from stepwatch import context
    context.set_context(mode=context.GRAPH_MODE, device_target="CPU")

With the import swapped, that line runs here. What has a PyTorch meaning is applied:

* ``device_target`` (``"CPU"``, ``"GPU"``) and ``device_id`` choose the device ``Model`` trains
  on when it is not given one (``Model(device=None)``); ``get_context("device_target")`` says
  which device that is;
* ``mode`` is kept and read back (``get_context("mode")``), so checks such as
  ``if context.get_context("mode") == context.PYNATIVE_MODE`` work. PyTorch runs eagerly,
  which is MindSpore's ``PYNATIVE_MODE`` (the default); ``GRAPH_MODE`` compiles nothing here
  (``Model(compile=True)`` compiles the network with ``torch.compile``).

Every other MindSpore setting (``save_graphs``, ``max_device_memory``, ``jit_config``, ...) is
accepted and kept, and a warning says once, for each, that it does nothing here. A name
MindSpore does not know is a ValueError, as in MindSpore. ``set_auto_parallel_context`` is
kept the same way: a distributed run is data-parallel under ``torchrun``, decided by
``torch.distributed``, and ``get_auto_parallel_context("parallel_mode")`` says which it is.

Importing this module does not load PyTorch.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Container
from typing import Any, ClassVar

from ._validation import TypeAndValueError

__all__ = [
    "COMPATIBLE",
    "GRAPH_MODE",
    "LAX",
    "PYNATIVE_MODE",
    "STRICT",
    "ParallelMode",
    "get_auto_parallel_context",
    "get_context",
    "reset_auto_parallel_context",
    "set_auto_parallel_context",
    "set_context",
]

GRAPH_MODE = 0
PYNATIVE_MODE = 1
# jit_syntax_level values
STRICT = 0
COMPATIBLE = 1
LAX = 2


class ParallelMode:
    """MindSpore's parallel mode names (the values of ``cb_params.parallel_mode``)."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    HYBRID_PARALLEL = "hybrid_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    MODE_LIST: ClassVar[tuple[str, ...]] = (
        STAND_ALONE,
        DATA_PARALLEL,
        HYBRID_PARALLEL,
        SEMI_AUTO_PARALLEL,
        AUTO_PARALLEL,
    )


_DEVICE_TARGETS = ("CPU", "GPU", "Ascend", "Davinci")

# The settings MindSpore 2.10's set_context knows besides mode, device_target and device_id;
# they are kept (get_context reads them back) and have no effect on PyTorch.
_OTHER_KEYS = frozenset(
    [
        "aoe_config",
        "aoe_job_type",
        "aoe_tune_mode",
        "ascend_config",
        "atomic_clean_policy",
        "auto_tune_mode",
        "check_bprop",
        "compile_cache_path",
        "conv_allow_hf32",
        "conv_allow_tf32",
        "debug_level",
        "deterministic",
        "disable_format_transform",
        "enable_auto_mixed_precision",
        "enable_compile_cache",
        "enable_graph_kernel",
        "enable_profiling",
        "enable_reduce_precision",
        "enable_sparse",
        "env_config_path",
        "exec_order",
        "gpu_config",
        "graph_kernel_flags",
        "hccl_watchdog",
        "inter_op_parallel_num",
        "jit_config",
        "jit_level",
        "jit_syntax_level",
        "matmul_allow_hf32",
        "matmul_allow_tf32",
        "max_call_depth",
        "max_device_memory",
        "memory_optimize_level",
        "mempool_block_size",
        "op_precision_mode",
        "op_timeout",
        "precision_mode",
        "print_file_path",
        "profiling_options",
        "pynative_synchronize",
        "reserve_class_name_in_scope",
        "runtime_num_threads",
        "save_graphs",
        "save_graphs_path",
        "support_binary",
        "variable_memory_max_size",
    ]
)
_KEYS = frozenset({"mode", "device_target", "device_id"}) | _OTHER_KEYS

_PARALLEL_KEYS = frozenset(
    [
        "all_reduce_fusion_config",
        "auto_parallel_search_mode",
        "auto_pipeline",
        "comm_fusion",
        "dataset_strategy",
        "device_num",
        "enable_alltoall",
        "enable_parallel_optimizer",
        "force_fp32_communication",
        "full_batch",
        "global_rank",
        "gradient_fp32_sync",
        "gradients_mean",
        "grad_accumulation_shard",
        "group_ckpt_save_file",
        "loss_repeated_mean",
        "optimizer_weight_shard_aggregated_save",
        "optimizer_weight_shard_size",
        "parallel_mode",
        "parallel_optimizer_config",
        "pipeline_config",
        "pipeline_result_broadcast",
        "pipeline_stages",
        "search_mode",
        "sharding_propagation",
        "strategy_ckpt_config",
        "strategy_ckpt_load_file",
        "strategy_ckpt_save_file",
    ]
)

_lock = threading.Lock()
_settings: dict[str, Any] = {}
_parallel: dict[str, Any] = {}
_noted: set[str] = set()


def _note(key: str, text: str) -> None:
    """Warn once per process about a setting that does nothing here."""
    with _lock:
        if key in _noted:
            return
        _noted.add(key)
    warnings.warn(text, UserWarning, stacklevel=3)


def _cuda_count() -> int:
    import torch  # only when a device is named: importing the module stays torch-free

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_int_setting(
    kwargs: dict[str, Any],
    name: str,
    valid: Container[int],
    expected: str,
    of_type: str | None = None,
) -> None:
    """Refuse ``kwargs[name]``, when given, unless it is an int in ``valid``: another type is a
    TypeAndValueError saying ``of_type`` (default ``expected``), another int a ValueError
    saying ``expected``."""
    if name not in kwargs:
        return
    value = kwargs[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeAndValueError(
            f"set_context: {name!r} must be {of_type or expected}, but got {value!r} with type "
            f"'{type(value).__name__}'."
        )
    if value not in valid:
        raise ValueError(f"set_context: {name!r} must be {expected}, but got {value}.")


def set_context(**kwargs: Any) -> None:
    """Set MindSpore context settings; those with a PyTorch meaning are applied.

    Args:
        mode: ``GRAPH_MODE`` (0) or ``PYNATIVE_MODE`` (1); kept and read back. PyTorch runs
            eagerly whichever is set (a warning says so once for ``GRAPH_MODE``).
        device_target: ``"CPU"`` or ``"GPU"``: the device ``Model`` uses when it is given none.
        device_id: the GPU's index (0 to 4095, as in MindSpore) for ``device_target="GPU"``.
        **kwargs: any other MindSpore setting: kept, with a warning (once per name) that it
            does nothing here.

    Raises:
        ValueError: a name MindSpore does not know, a ``mode`` other than 0 or 1, an unknown
            ``device_target``, a ``device_id`` out of range.
        TypeError: ``mode`` or ``device_id`` not an int (an instance of ValueError too).
        RuntimeError: ``device_target`` names a device this PyTorch cannot use (``"GPU"``
            without CUDA, ``"Ascend"``), as MindSpore raises for a device it was not built for.

    Example:
        >>> from stepwatch import context
        >>> context.set_context(mode=context.PYNATIVE_MODE, device_target="CPU")
        >>> context.get_context("device_target")
        'CPU'
    """
    unknown = sorted(set(kwargs) - _KEYS)
    if unknown:
        raise ValueError(
            f"set_context: {unknown[0]!r} is not a MindSpore context setting; the ones with a "
            "meaning here are mode, device_target and device_id."
        )
    modes = (GRAPH_MODE, PYNATIVE_MODE)
    _check_int_setting(kwargs, "mode", modes, "context.GRAPH_MODE (0) or context.PYNATIVE_MODE (1)")
    _check_int_setting(kwargs, "device_id", range(4096), "in [0, 4095]", "an int in [0, 4095]")
    target = kwargs.get("device_target")
    if "device_target" in kwargs:
        if target not in _DEVICE_TARGETS:
            raise ValueError(
                f"set_context: 'device_target' must be one of {list(_DEVICE_TARGETS[:3])}, but "
                f"got {target!r}."
            )
        if target in ("Ascend", "Davinci"):
            raise RuntimeError(
                f"set_context: device_target={target!r}: this PyTorch has no Ascend backend; "
                "pass device_target='GPU' or 'CPU' (or leave it out: Model then picks CUDA "
                "when there is a GPU, else the CPU)."
            )
        if target == "GPU" and _cuda_count() == 0:
            raise RuntimeError(
                "set_context: device_target='GPU', but this PyTorch sees no CUDA GPU (a "
                "CPU-only build, or no GPU on this machine); pass device_target='CPU'."
            )
    device_id = kwargs.get("device_id", _settings.get("device_id"))
    if (target or _settings.get("device_target")) == "GPU" and device_id is not None:
        count = _cuda_count()
        if device_id >= count:
            raise ValueError(
                f"set_context: device_id={device_id}, but there are {count} CUDA devices "
                f"(0..{count - 1})."
            )
    with _lock:
        _settings.update(kwargs)
    if kwargs.get("mode") == GRAPH_MODE:
        _note(
            "mode",
            "set_context(mode=GRAPH_MODE): PyTorch runs eagerly, as MindSpore's PYNATIVE_MODE; "
            "get_context('mode') reads GRAPH_MODE back, and nothing is compiled. For a compiled "
            "network pass Model(..., compile=True).",
        )
    with _lock:
        new = sorted((set(kwargs) & _OTHER_KEYS) - _noted)
        _noted.update(new)
    if new:
        named = ", ".join(f"{key}=..." for key in new)
        warnings.warn(
            f"set_context({named}): no PyTorch meaning here; kept for get_context, does nothing.",
            UserWarning,
            stacklevel=2,
        )


def get_context(attr_key: str) -> Any:
    """The value of a MindSpore context setting.

    ``mode`` is what was set (``PYNATIVE_MODE`` by default: PyTorch runs eagerly);
    ``device_target`` is ``"GPU"`` or ``"CPU"``: where ``Model`` trains when given no device;
    ``device_id`` the GPU index (0 by default); any other setting what was set, else None.

    Raises:
        ValueError: ``attr_key`` is not a MindSpore context setting.
    """
    if attr_key not in _KEYS:
        raise ValueError(f"get_context: {attr_key!r} is not a MindSpore context setting.")
    with _lock:
        settings = dict(_settings)
    if attr_key == "mode":
        return settings.get("mode", PYNATIVE_MODE)
    if attr_key == "device_target":
        target = settings.get("device_target")
        return target if target is not None else ("GPU" if _cuda_count() else "CPU")
    if attr_key == "device_id":
        return settings.get("device_id", 0)
    return settings.get(attr_key)


def default_device() -> tuple[str, int | None] | None:
    """The device ``set_context`` chose for ``Model(device=None)``: ``("cpu", None)``,
    ``("cuda", index or None)``, or None when no device_target was set."""
    with _lock:
        target = _settings.get("device_target")
        index = _settings.get("device_id")
    if target is None:
        return None
    return ("cuda", index) if target == "GPU" else ("cpu", None)


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Keep MindSpore's auto-parallel settings, which PyTorch does not use.

    A distributed run here is data-parallel under ``torchrun`` (DistributedDataParallel),
    whatever is set; a warning says so once. ``parallel_mode`` is checked against
    :class:`ParallelMode`.

    Raises:
        ValueError: a name MindSpore does not know, or an unknown ``parallel_mode``.
    """
    unknown = sorted(set(kwargs) - _PARALLEL_KEYS)
    if unknown:
        raise ValueError(
            f"set_auto_parallel_context: {unknown[0]!r} is not a MindSpore auto-parallel setting."
        )
    mode = kwargs.get("parallel_mode")
    if mode is not None and mode not in ParallelMode.MODE_LIST:
        raise ValueError(
            f"set_auto_parallel_context: 'parallel_mode' must be one of "
            f"{list(ParallelMode.MODE_LIST)}, but got {mode!r}."
        )
    with _lock:
        _parallel.update(kwargs)
    _note(
        "auto_parallel",
        "set_auto_parallel_context(...) is kept but not applied: a distributed run here is "
        "data-parallel (DistributedDataParallel) when started with torchrun, and "
        "get_auto_parallel_context('parallel_mode') / ('device_num') say what runs.",
    )


def get_auto_parallel_context(attr_key: str) -> Any:
    """An auto-parallel setting: ``parallel_mode`` and ``device_num`` are what runs
    (``'data_parallel'`` and the process count under ``torchrun`` with more than one process,
    else ``'stand_alone'`` and 1), ``global_rank`` this process's rank; others as set, else None.

    Raises:
        ValueError: ``attr_key`` is not a MindSpore auto-parallel setting.
    """
    if attr_key not in _PARALLEL_KEYS:
        raise ValueError(
            f"get_auto_parallel_context: {attr_key!r} is not a MindSpore auto-parallel setting."
        )
    if attr_key in ("parallel_mode", "device_num", "global_rank"):
        rank, world = _rank_and_world()
        if attr_key == "parallel_mode":
            return ParallelMode.DATA_PARALLEL if world > 1 else ParallelMode.STAND_ALONE
        return world if attr_key == "device_num" else rank
    with _lock:
        return _parallel.get(attr_key)


def reset_auto_parallel_context() -> None:
    """Forget the auto-parallel settings."""
    with _lock:
        _parallel.clear()


def _rank_and_world() -> tuple[int, int]:
    import sys

    if "torch" not in sys.modules:  # no torch loaded: no process group either
        return 0, 1
    from .distributed import rank_and_world

    return rank_and_world()
