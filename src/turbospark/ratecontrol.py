"""Process-level decode-rate cap, stepped down by temperature.

One `RateControl` per process paces every decoded token, whatever request or model it belongs
to: a power or heat budget is a property of the machine, not of a caller. Engines call
`pace(n)` once per step with the number of tokens the step produced; it sleeps just long enough
to keep the whole process under the cap in force.

The cap in force is the configured cap (`--max-decode-rate`), lowered by thermal steps
(`--thermal-steps 70:20,80:5`: at 70 C or above at most 20 tokens/s, at 80 C at most 5) read from
a `TemperatureSource`: Linux thermal zones, NVIDIA's NVML when it is installed, or a file that
holds a number in degrees C (tests, or any sensor a user can write out). The reading is taken
at most once per `poll_interval` seconds.
"""

from __future__ import annotations

import contextlib
import glob
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class TemperatureSource(Protocol):
    name: str

    def read(self) -> float | None:
        """Degrees C now, or None when no reading can be had."""


class FileTemperature:
    """A file holding degrees C (a plain number; millidegrees, as sysfs writes them, above 1000)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = f"file:{self.path}"

    def read(self) -> float | None:
        try:
            value = float(self.path.read_text().strip())
        except (OSError, ValueError):
            return None
        return value / 1000.0 if value > 1000 else value


class LinuxThermalZones:
    """The hottest of /sys/class/thermal/thermal_zone*/temp."""

    name = "linux-thermal"

    def __init__(self, pattern: str = "/sys/class/thermal/thermal_zone*/temp") -> None:
        self.zones = [FileTemperature(p) for p in sorted(glob.glob(pattern))]

    def read(self) -> float | None:
        readings = [t for t in (z.read() for z in self.zones) if t is not None]
        return max(readings) if readings else None


class NvmlTemperature:
    """The hottest GPU, through NVIDIA's NVML (the `pynvml` / `nvidia-ml-py` package)."""

    name = "nvml"

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def read(self) -> float | None:
        temps = []
        for h in self._handles:
            with contextlib.suppress(Exception):
                temps.append(float(self._nvml.nvmlDeviceGetTemperature(h, self._nvml.NVML_TEMPERATURE_GPU)))
        return max(temps) if temps else None


def temperature_source(spec: str | None) -> TemperatureSource | None:
    """`--thermal-source`: "auto" (NVML if present, else Linux zones if any), "linux", "nvml",
    "file:PATH", or None for none."""
    if spec is None or spec == "none":
        return None
    if spec.startswith("file:"):
        return FileTemperature(spec[len("file:") :])
    if spec in ("auto", "nvml"):
        try:
            return NvmlTemperature()
        except Exception:
            if spec == "nvml":
                raise ValueError("--thermal-source nvml: NVML is not available") from None
    if spec in ("auto", "linux"):
        zones = LinuxThermalZones()
        return zones if zones.zones or spec == "linux" else None
    raise ValueError(f"unknown thermal source {spec!r} (auto, linux, nvml, file:PATH, none)")


def parse_thermal_steps(text: str) -> list[tuple[float, float]]:
    """ "70:20,80:5" -> [(70.0, 20.0), (80.0, 5.0)], sorted by temperature."""
    steps = []
    for part in text.split(","):
        try:
            temp, cap = (float(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"thermal step {part!r} is not TEMP:TOKENS_PER_SECOND") from None
        if cap <= 0:
            raise ValueError(f"thermal step {part!r}: the cap must be positive")
        steps.append((temp, cap))
    return sorted(steps)


# How many missed token slots a late step may still use (see `RateControl.pace`).
CATCH_UP_TOKENS = 2


class RateControl:
    def __init__(
        self,
        max_tokens_per_second: float | None = None,
        *,
        thermal_steps: Sequence[tuple[float, float]] = (),
        temperature: TemperatureSource | None = None,
        poll_interval: float = 1.0,
    ) -> None:
        if max_tokens_per_second is not None and max_tokens_per_second <= 0:
            raise ValueError("the decode-rate cap must be positive")
        self.max_tokens_per_second = max_tokens_per_second
        self.thermal_steps = sorted(thermal_steps)
        self.temperature = temperature
        self.poll_interval = poll_interval
        self.num_tokens = 0
        self.seconds_slept = 0.0
        self.last_temperature: float | None = None
        self._read_at = -float("inf")
        self._next_at = 0.0
        self._lock = threading.Lock()

    def cap(self) -> float | None:
        """Tokens/s in force now (None: no cap)."""
        now = time.monotonic()
        if self.temperature is not None and now - self._read_at >= self.poll_interval:
            self._read_at = now
            self.last_temperature = self.temperature.read()
        cap = self.max_tokens_per_second
        if self.last_temperature is not None:
            for threshold, step_cap in self.thermal_steps:
                if self.last_temperature >= threshold:
                    cap = step_cap if cap is None else min(cap, step_cap)
        return cap

    def pace(self, num_tokens: int = 1) -> None:
        """Accounts for `num_tokens` just produced; sleeps until the cap allows them."""
        with self._lock:
            self.num_tokens += num_tokens
            cap = self.cap()
            if cap is None:
                self._next_at = 0.0
                return
            now = time.monotonic()
            # tokens are spaced 1/cap apart; a step of k tokens waits for all k slots. A step
            # that comes late (a sleep that overslept, a step descheduled on a busy machine)
            # may take up to CATCH_UP_TOKENS slots it missed, so the rate holds at the cap
            # instead of drifting below it by every delay; after a pause the slots missed are
            # gone, so no window of T seconds holds more than cap * T + CATCH_UP_TOKENS + k.
            start = max(now - CATCH_UP_TOKENS / cap, self._next_at)
            self._next_at = start + num_tokens / cap
            wait = self._next_at - now - 1.0 / cap
        if wait > 0:
            time.sleep(wait)
            with self._lock:
                self.seconds_slept += wait
