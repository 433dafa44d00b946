"""System metrics: what the training process costs the machine, sampled off the training thread.

The run writer's thread calls :meth:`SystemSampler.sample` every ``every`` seconds and writes
what it returns as ordinary points under the ``system/`` prefix, at the run's latest step, so
the CLI, the exports and the dashboard show them like any other key:

=========================  ========================================================
key                        meaning
=========================  ========================================================
``system/cpu_percent``     this process's CPU use since the last sample (100 = one core)
``system/rss_mb``          this process's resident memory, MiB
``system/host_cpu_percent``  the whole machine's CPU use (100 = every core busy)
``system/gpu<i>_util``     GPU ``i``'s utilisation, % (with NVML: ``nvidia-ml-py``)
``system/gpu<i>_mem_mb``   GPU ``i``'s memory in use, MiB
=========================  ========================================================

Nothing here runs on the training thread or touches a device stream: psutil reads the
process from ``/proc``, and NVML asks the driver. Without psutil the CPU and memory keys are
left out; without NVML (or a GPU) the GPU keys are.
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["PREFIX", "SystemSampler"]

logger = logging.getLogger("stepwatch")

PREFIX = "system/"
_MIB = 1024 * 1024
# The shortest interval the CPU shares are read over (a shorter one reads as 0).
_CPU_INTERVAL = 0.1


class SystemSampler:
    """Reads the system metrics of this process (see the module's table).

    Args:
        every: seconds between samples (the writer's thread keeps the schedule).
    """

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._process: Any = None
        self._psutil: Any = None
        self._nvml: Any = None
        self._gpus: list[Any] = []
        self._host = (0.0, 0.0)  # the machine's (total, busy) CPU seconds at the last sample
        try:
            import psutil
        except ImportError:  # the CPU and memory keys are left out
            pass
        else:
            self._psutil = psutil
            self._process = psutil.Process()
            self._process.cpu_percent(None)  # the first call only starts the interval
            self._host = self._host_times()
        self._cpu_since = time.monotonic()
        self._open_nvml()

    def _host_times(self) -> tuple[float, float]:
        """The machine's ``(total, busy)`` CPU seconds so far. (psutil's own cpu_percent keeps
        its last reading per thread, and this sampler is read on the writer's thread.)"""
        times = self._psutil.cpu_times()
        total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
        return total, total - times.idle - getattr(times, "iowait", 0.0)

    def _open_nvml(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._gpus = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
        except Exception:  # no nvidia-ml-py, no driver, no GPU: no GPU keys
            self._nvml, self._gpus = None, []

    def sample(self) -> dict[str, float]:
        """One sample: ``{key: value}`` for the keys this machine can give."""
        found: dict[str, float] = {}
        if self._process is not None:
            try:
                now = time.monotonic()
                if now - self._cpu_since >= _CPU_INTERVAL:  # too short an interval reads 0
                    self._cpu_since = now
                    found[PREFIX + "cpu_percent"] = float(self._process.cpu_percent(None))
                    (total, busy), (total0, busy0) = self._host_times(), self._host
                    if total > total0:
                        self._host = (total, busy)
                        share = 100.0 * (busy - busy0) / (total - total0)
                        found[PREFIX + "host_cpu_percent"] = round(min(100.0, share), 1)
                found[PREFIX + "rss_mb"] = self._process.memory_info().rss / _MIB
            except Exception:  # the process table cannot be read: skip this sample's keys
                pass
        nvml = self._nvml
        for index, handle in enumerate(self._gpus):
            try:
                found[f"{PREFIX}gpu{index}_util"] = float(
                    nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                )
                found[f"{PREFIX}gpu{index}_mem_mb"] = (
                    nvml.nvmlDeviceGetMemoryInfo(handle).used / _MIB
                )
            except Exception:  # a GPU that stopped answering: leave its keys out
                continue
        return found

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml, self._gpus = None, []
