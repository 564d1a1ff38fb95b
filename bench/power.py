"""GPU energy over a timed window through NVML: a sampling thread integrates power (trapezoid),
and, where the driver has it, the total-energy counter gives a second reading to cross-check.

Unavailable NVML (CPU dry runs, no nvidia-ml-py) gives ``None`` readings, never an error."""

from __future__ import annotations

import threading
import time


class PowerMeter:
    def __init__(self, device_index: int, interval_s: float = 0.05):
        self.device_index = device_index
        self.interval_s = interval_s
        self._nvml = None
        self._handle = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._samples: list[tuple[float, float]] = []  # (t, watts)
        self._energy_start_mj: int | None = None
        self._energy_end_mj: int | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception:  # no NVML here: report nothing rather than fail the benchmark
            self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def _energy_mj(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except Exception:
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                watts = self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
                self._samples.append((time.perf_counter(), watts))
            except Exception:
                pass
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        if not self.available:
            return
        self._samples.clear()
        self._stop.clear()
        self._energy_start_mj = self._energy_mj()
        self._thread = threading.Thread(target=self._run, name="nvml-power", daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        if not self.available or self._thread is None:
            return {"energy_j": None, "mean_power_w": None, "samples": 0}
        self._stop.set()
        self._thread.join()
        self._energy_end_mj = self._energy_mj()
        s = self._samples
        sampled_j = sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(s, s[1:], strict=False))
        span = s[-1][0] - s[0][0] if len(s) > 1 else 0.0
        counter_j = None
        if self._energy_start_mj is not None and self._energy_end_mj is not None:
            counter_j = (self._energy_end_mj - self._energy_start_mj) / 1000.0
        return {
            "energy_j": sampled_j if len(s) > 1 else counter_j,
            "energy_counter_j": counter_j,
            "mean_power_w": sampled_j / span if span > 0 else None,
            "max_power_w": max(w for _, w in s) if s else None,
            "samples": len(s),
        }
