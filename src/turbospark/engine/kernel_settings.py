"""The switches that choose the engine's CPU kernels, in one place.

Each switch is a field of `KernelSettings`, a command line option of `serve` and `chat`, and an
environment variable (values: the default first):

- `cpu_kernels`, `--cpu-kernels`, `TURBOSPARK_CPU_KERNELS`: auto, avx2, float32, bf16,
  bf16-native;
- `native_kernels`, `--native-kernels`, `TURBOSPARK_NATIVE_KERNELS`: auto, on, off;
- `native_vnni`, `--native-vnni` / `--no-native-vnni`, `TURBOSPARK_NATIVE_VNNI`: on, off;
- `hugepages`, `--hugepages` / `--no-hugepages`, `TURBOSPARK_HUGEPAGES`: on, off;
- `fast_nondeterministic`, `--fast-nondeterministic` / `--no-fast-nondeterministic`,
  `TURBOSPARK_FAST_NONDETERMINISTIC`: off, on;
- `pool_steal`, `--pool-steal` / `--no-pool-steal`, `TURBOSPARK_POOL_STEAL`: on, off.

What each does:

- `cpu_kernels`: the CPU profile (`cpu_kernels.py`): detected from the CPU's flags, or forced;
- `native_kernels`: turbospark's own decode kernels (`native.py`): where the profile runs them,
  wherever they can run, or never;
- `native_vnni`: those kernels' byte dot products on AVX-512 VNNI where the CPU has it;
- `hugepages`: a CPU model's weights moved into one mapping of transparent huge pages
  (`weight_arena.py`), where the system offers them;
- `fast_nondeterministic`: the row count picks a CPU step's kernels instead of the rows' roles
  (`row_kernels.py`): faster, but a request's tokens may depend on the batch;
- `pool_steal`: the native kernels' caller takes over a chunk a descheduled helper thread holds
  (`csrc/qgemv.c`). The C side reads no environment: `native` hands it this setting through
  `ts_pool_set_stealing` as it loads the library.

Precedence: an option given on the command line (`configure`, which the CLI calls once, before
any model loads) over the environment variable (`from_environment`, the only code that reads
these variables) over the default. A variable's value is matched without case or surrounding
blanks and an empty one counts as unset; on / off switches take 1 / 0, on / off, true / false
or yes / no (`native_kernels` also "auto"). Any other value raises `KernelSettingError`, naming
the variable and the values it takes.

`current()` reads the environment at each call (a few lookups; each distinct value is parsed
once), so a variable set before a switch is used counts, as when each module read its own. When
that is depends on the switch: the CPU profile and the native library are decided once per
process, huge pages at each model load, `fast_nondeterministic` at each step. A tensor-parallel
worker takes rank 0's settings whole (`use_settings`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CPU_KERNEL_CHOICES = ("auto", "avx2", "float32", "bf16", "bf16-native")
NATIVE_KERNEL_CHOICES = ("auto", "on", "off")
TRUE_WORDS = ("1", "on", "true", "yes")
FALSE_WORDS = ("0", "off", "false", "no")


@dataclass(frozen=True, slots=True)
class KernelSettings:
    """The kernel switches, each at its default."""

    cpu_kernels: str = "auto"  # one of CPU_KERNEL_CHOICES
    native_kernels: str = "auto"  # one of NATIVE_KERNEL_CHOICES
    native_vnni: bool = True
    hugepages: bool = True
    fast_nondeterministic: bool = False
    pool_steal: bool = True


DEFAULTS = KernelSettings()
FIELDS = tuple(f.name for f in dataclasses.fields(KernelSettings))
ENV_VARS: Mapping[str, str] = {
    "cpu_kernels": "TURBOSPARK_CPU_KERNELS",
    "native_kernels": "TURBOSPARK_NATIVE_KERNELS",
    "native_vnni": "TURBOSPARK_NATIVE_VNNI",
    "hugepages": "TURBOSPARK_HUGEPAGES",
    "fast_nondeterministic": "TURBOSPARK_FAST_NONDETERMINISTIC",
    "pool_steal": "TURBOSPARK_POOL_STEAL",
}
OPTIONS: Mapping[str, str] = {name: "--" + name.replace("_", "-") for name in FIELDS}
CHOICES: Mapping[str, tuple[str, ...]] = {
    "cpu_kernels": CPU_KERNEL_CHOICES,
    "native_kernels": NATIVE_KERNEL_CHOICES,
}


class KernelSettingError(ValueError):
    """A kernel switch given a value it does not take."""


def _allowed(name: str) -> str:
    if name == "native_kernels":
        return "auto, on, off (or 1 / 0, true / false, yes / no)"
    if name in CHOICES:
        return ", ".join(CHOICES[name])
    return "1 / 0, on / off, true / false, yes / no"


def _parse(name: str, raw: str) -> str | bool | None:
    """The value of variable `name`'s text `raw` (None: empty, so unset)."""
    value = raw.strip().lower()
    if not value:
        return None
    if name == "native_kernels":
        value = "on" if value in TRUE_WORDS else "off" if value in FALSE_WORDS else value
    if name in CHOICES:
        if value in CHOICES[name]:
            return value
    elif value in TRUE_WORDS or value in FALSE_WORDS:
        return value in TRUE_WORDS
    raise KernelSettingError(f"{ENV_VARS[name]}={raw!r}: choose one of {_allowed(name)}")


def _raw(environ: Mapping[str, str]) -> tuple[str | None, ...]:
    return tuple(environ.get(ENV_VARS[name]) for name in FIELDS)


@functools.lru_cache(maxsize=64)
def _from_raw(raw: tuple[str | None, ...]) -> KernelSettings:
    values: dict[str, Any] = {}
    for name, text in zip(FIELDS, raw, strict=True):
        value = None if text is None else _parse(name, text)
        if value is not None:
            values[name] = value
    return dataclasses.replace(DEFAULTS, **values)


def from_environment(environ: Mapping[str, str] | None = None) -> KernelSettings:
    """The defaults with the environment's overrides (`environ`, else the process's): the only
    place that reads the kernel variables. Raises `KernelSettingError` for a value a switch does
    not take."""
    return _from_raw(_raw(os.environ if environ is None else environ))


# the command line's choices: (field, value) pairs, set by `configure`
_given: tuple[tuple[str, str | bool], ...] = ()


@functools.lru_cache(maxsize=64)
def _resolve(raw: tuple[str | None, ...], given: tuple[tuple[str, str | bool], ...]) -> KernelSettings:
    values: dict[str, Any] = dict(given)
    return dataclasses.replace(_from_raw(raw), **values)


def current() -> KernelSettings:
    """The process's settings: the command line's choices over the environment over the defaults."""
    return _resolve(_raw(os.environ), _given)


def _check(name: str, value: str | bool) -> str | bool:
    if name in CHOICES:
        if value not in CHOICES[name]:
            raise KernelSettingError(f"{OPTIONS[name]} {value!r}: choose one of {', '.join(CHOICES[name])}")
    elif not isinstance(value, bool):
        raise KernelSettingError(f"{OPTIONS[name]} takes True or False, not {value!r}")
    return value


def configure(
    *,
    cpu_kernels: str | None = None,
    native_kernels: str | None = None,
    native_vnni: bool | None = None,
    hugepages: bool | None = None,
    fast_nondeterministic: bool | None = None,
    pool_steal: bool | None = None,
) -> KernelSettings:
    """Sets the process's command line choices (None: not given, the environment or the default
    decides), replacing earlier ones; returns the settings now current. Validates the environment
    too, so a bad variable fails here, before any model loads. Call it before the first model
    loads: the CPU profile and the native library are decided once per process."""
    global _given
    chosen = {
        "cpu_kernels": cpu_kernels,
        "native_kernels": native_kernels,
        "native_vnni": native_vnni,
        "hugepages": hugepages,
        "fast_nondeterministic": fast_nondeterministic,
        "pool_steal": pool_steal,
    }
    given = tuple((name, _check(name, value)) for name, value in chosen.items() if value is not None)
    settings = _resolve(_raw(os.environ), given)  # raises for a bad variable, leaving _given as it was
    _given = given
    return settings


def use_settings(settings: KernelSettings) -> None:
    """Fixes every switch to `settings` (as if each were given on the command line): a
    tensor-parallel worker takes rank 0's this way."""
    configure(**dataclasses.asdict(settings))


def origin(name: str) -> str:
    """Where field `name`'s current value comes from: its command line option, its environment
    variable, or "default"."""
    if any(field == name for field, _ in _given):
        return OPTIONS[name]
    if os.environ.get(ENV_VARS[name], "").strip():
        return ENV_VARS[name]
    return "default"
