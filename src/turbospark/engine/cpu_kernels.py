"""Which CPU kernels the engine runs, decided once per process from what the CPU has.

CPUs differ in the one thing that decides the fast path for quantized weights: whether bf16
matrix products run in hardware (AVX-512 BF16 or AMX) or are emulated. Measured on a 2-core
AVX2-only AMD EPYC (one prefill chunk of 256 tokens through SmolLM2's three matmul shapes, int4
weights): expanding the weight to bf16 and multiplying in bf16 took 409 ms, expanding it to
float32 and multiplying in float32 62 ms. On a Sapphire Rapids core (AMX) the bf16 product is
the fast one. So the profile picks:

- `dense_dtype`: the dtype a quantized linear expands its weight to and multiplies in when a
  step feeds many rows (a prefill chunk): bfloat16 where it is native, float32 elsewhere;
- the decode kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) always get bf16
  activations: with float32 activations both run 20-100x slower on AVX2 (measured), and with
  bf16 ones they read a row of weights at memory speed.

`TURBOSPARK_CPU_KERNELS` overrides the detection: "auto" (default), "avx2" (float32 dense), or
"bf16" (bfloat16 dense, for a CPU with native bf16 that detection missed). `describe()` is the
line the server logs at start-up.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

ENV_VAR = "TURBOSPARK_CPU_KERNELS"
CHOICES = ("auto", "avx2", "bf16")


@dataclass(frozen=True, slots=True)
class CpuKernels:
    capability: str  # torch's dispatch level: "AVX2", "AVX512", "DEFAULT", ...
    native_bf16: bool  # bf16 matmuls in hardware (AVX-512 BF16 or AMX)
    amx: bool
    vnni: bool
    dense_dtype: torch.dtype  # what a quantized linear expands to for a many-row matmul
    source: str  # "detected" or the override's value

    def describe(self) -> str:
        extras = [name for name, has in (("AMX", self.amx), ("VNNI", self.vnni)) if has]
        native = "native bf16" if self.native_bf16 else "no native bf16"
        dense = str(self.dense_dtype).removeprefix("torch.")
        isa = " + ".join([self.capability, *extras])
        return (
            f"CPU kernels ({self.source}): torch dispatches {isa}, {native}; quantized prefill "
            f"expands weights to {dense}, decode runs int4/int8 kernels on bf16 activations"
        )


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is not readable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def detect(flags: frozenset[str] | None = None, override: str | None = None) -> CpuKernels:
    """The profile for this CPU (or for `flags`), with `override` (or $TURBOSPARK_CPU_KERNELS)."""
    if flags is None:
        flags = cpu_flags()
    if override is None:
        override = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if override not in CHOICES:
        raise ValueError(f"{ENV_VAR}={override!r}: choose one of {', '.join(CHOICES)}")
    capability = torch.backends.cpu.get_cpu_capability()
    amx = "amx_bf16" in flags
    native_bf16 = amx or "avx512_bf16" in flags
    vnni = "avx512_vnni" in flags or "avx_vnni" in flags
    dense_bf16 = native_bf16 if override == "auto" else override == "bf16"
    return CpuKernels(
        capability=capability,
        native_bf16=native_bf16,
        amx=amx,
        vnni=vnni,
        dense_dtype=torch.bfloat16 if dense_bf16 else torch.float32,
        source="detected" if override == "auto" else f"{ENV_VAR}={override}",
    )


def free_cores() -> int:
    """CPUs this process may run on (its affinity mask: what a container or `taskset` grants),
    not the machine's total, which is what torch's default pool size counts."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def set_intra_op_threads() -> int:
    """Sizes torch's intra-op pool to the free cores, unless the user sized it (OMP_NUM_THREADS
    or an earlier `torch.set_num_threads` to fewer); returns the size. A pool larger than the
    cores granted makes every parallel op wait for a thread that is not scheduled."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = min(torch.get_num_threads(), free_cores())
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads


@functools.cache
def cpu_kernels() -> CpuKernels:
    """The process's profile, decided on first use and then fixed."""
    return detect()
