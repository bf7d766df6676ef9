"""Which CPU kernels the engine runs, decided once per process from what the CPU has.

CPUs differ in the one thing that decides the fast path for quantized weights: whether bf16
matrix products run in hardware (AVX-512 BF16 or AMX) or are emulated. Measured on a 2-core
AVX2-only AMD EPYC (one prefill chunk of 256 tokens through SmolLM2's three matmul shapes, int4
weights): expanding the weight to bf16 and multiplying in bf16 took 409 ms, expanding it to
float32 and multiplying in float32 62 ms. On a Sapphire Rapids core (AMX) the bf16 product is
the fast one. On the AVX2 machine, fbgemm's half-precision GEMM (weights packed once as fp16 in
its blocked layout, float32 activations, float32 FMAs) beat both: Qwen2.5-0.5B's MLP shapes at
256 rows in 15-25 ms against 44-59 ms for expand-and-multiply in float32, 145-154 GFLOP/s at
1,024 rows, and 2.5x the int8 decode kernel at 8 rows. So the profile picks:

- `packed_half`: many-row matmuls of a quantized linear (prefill chunks, decode batches) run
  fbgemm's fp16 GEMM on a copy of the weight packed at load time: where bf16 is not native and
  torch has fbgemm (x86 builds);
- `dense_dtype`: otherwise the dtype a quantized linear expands its weight to and multiplies in
  for many rows: bfloat16 where it is native, float32 elsewhere;
- `activation_dtype`: float32 where bf16 is emulated (norms, rotary, attention and the KV cache
  run in float32: the CPU flash kernel does 126 GFLOP/s in float32 against 93 in bf16 at
  1,024 x 8,192, measured), bfloat16 where it is native;
- `native_rows`: matmuls of up to this many rows (decode steps) of a quantized linear run
  turbospark's own AVX2 kernels (`turbospark.engine.native`: int8 activations in blocks of 32
  against the int4 / int8 codes, as llama.cpp does), where the CPU has AVX2, FMA and F16C and a
  C compiler builds them, and either bf16 is emulated or it is native without AMX; 0 elsewhere.
  On the AVX2 EPYC SmolLM2's decode went from 29.9 to 61.6 tok/s with them. On a Zen 4 EPYC
  (AVX-512 BF16, no AMX) torch's bf16 decode kernels ran Qwen2.5-0.5B at 29.5 (int4) / 22.6
  (int8) tok/s, the native one-call step at 46.5 / 44.8, so that kind runs prompts in bf16 and
  decode steps natively, as "bf16-native" below (prefill 1.03x / 0.93x of all-bf16). On a
  Sapphire Rapids Xeon (AMX) the trade is worse for prompts (0.75x) and that kind keeps torch's
  kernels (benchmarks/RESULTS.md). The `native_kernels` setting (`--native-kernels`,
  `TURBOSPARK_NATIVE_KERNELS`) = "auto" (default, as said), "on" (wherever they can run) or "off"
  (never);
- torch's decode kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`), where the
  native ones do not run, get bf16 activations: with float32 activations both run 20-100x
  slower on AVX2 (measured).

The `cpu_kernels` setting (`--cpu-kernels`, `TURBOSPARK_CPU_KERNELS`: `kernel_settings`)
overrides the detection: "auto" (default), "avx2" (fp16-packed many-row
matmuls where fbgemm exists, float32 activations), "float32" (float32 expansion, float32
activations), "bf16" (bfloat16 expansion and activations, for a CPU with native bf16 that
detection missed), or "bf16-native" (bfloat16 expansion for many rows, float32 activations and
the native kernels for decode steps). `describe()` is the line the server logs at start-up.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from turbospark.engine import kernel_settings, native, row_kernels
from turbospark.engine.cpu_info import cpu_flags

ENV_VAR = kernel_settings.ENV_VARS["cpu_kernels"]
# the native kernels' row limit: beyond it a matmul is a prefill chunk or a large decode batch,
# where fbgemm's fp16 GEMM (or the expansion path) wins
NATIVE_MAX_ROWS = 8
CHOICES = kernel_settings.CPU_KERNEL_CHOICES


@dataclass(frozen=True, slots=True)
class CpuKernels:
    capability: str  # torch's dispatch level: "AVX2", "AVX512", "DEFAULT", ...
    native_bf16: bool  # bf16 matmuls in hardware (AVX-512 BF16 or AMX)
    amx: bool
    vnni: bool
    dense_dtype: torch.dtype  # what a quantized linear expands to for a many-row matmul
    packed_half: bool  # many-row matmuls through fbgemm's fp16 GEMM on weights packed at load
    activation_dtype: torch.dtype  # a quantized model's activations and KV cache
    source: str  # "detected", or where the override came from and its value
    native_rows: int = 0  # few-row quantized matmuls on turbospark's AVX2 kernels (0: torch's)

    def describe(self) -> str:
        extras = [name for name, has in (("AMX", self.amx), ("VNNI", self.vnni)) if has]
        native = "native bf16" if self.native_bf16 else "no native bf16"
        expanded = "weights expanded to " + _name(self.dense_dtype)
        dense = "fp16-packed fbgemm GEMM" if self.packed_half else expanded
        isa = " + ".join([self.capability, *extras])
        few = (
            f"up to {self.native_rows} rows turbospark's AVX2 int8-activation kernels"
            + (" (dot products on AVX-512 VNNI)" if _native_vnni() else "")
            if self.native_rows
            else "single rows torch's int4/int8 kernels on bf16"
        )
        return (
            f"CPU kernels ({self.source}): torch dispatches {isa}, {native}; quantized many-row "
            f"matmuls run {dense}, activations {_name(self.activation_dtype)}, {few}"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _native_vnni() -> bool:
    loaded = native.kernels()
    return loaded is not None and loaded.vnni


def has_fbgemm_half() -> bool:
    """torch's fbgemm fp16 GEMM is there (x86 builds) and runs."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(8, 8), None)
        torch.ops.quantized.linear_dynamic_fp16(torch.ones(2, 8), packed)
    except (RuntimeError, AttributeError):
        return False
    return True


def detect(
    flags: frozenset[str] | None = None, override: str | None = None, native_rows: int | None = None
) -> CpuKernels:
    """The profile for this CPU (or for `flags`), with `override` (or the `cpu_kernels` setting);
    `native_rows` None: what this machine's native kernels take (0 when `flags` are given)."""
    if native_rows is None and flags is not None:
        native_rows = 0
    if flags is None:
        flags = cpu_flags()
    label = ENV_VAR
    if override is None:
        override = kernel_settings.current().cpu_kernels
        label = kernel_settings.origin("cpu_kernels")
    if override not in CHOICES:
        raise ValueError(f"{ENV_VAR}={override!r}: choose one of {', '.join(CHOICES)}")
    capability = torch.backends.cpu.get_cpu_capability()
    amx = "amx_bf16" in flags
    native_bf16 = amx or "avx512_bf16" in flags
    vnni = "avx512_vnni" in flags or "avx_vnni" in flags
    dense_bf16 = native_bf16 if override == "auto" else override in ("bf16", "bf16-native")
    # bf16 many-row matmuls next to the native decode kernels: asked for, or detected where bf16
    # is native without AMX (AVX-512 BF16 alone: AMD Zen 4)
    mixed = override == "bf16-native" or (override == "auto" and native_bf16 and not amx)
    if native_rows is None:
        native_rows = _native_rows(dense_bf16 and not mixed)
    # float32 activations where bf16 is emulated, and where the native kernels take decode
    # steps next to bf16 many-row matmuls
    float_activations = not dense_bf16 or (mixed and native_rows > 0)
    packed_half = not dense_bf16 and override != "float32" and has_fbgemm_half()
    return CpuKernels(
        capability=capability,
        native_bf16=native_bf16,
        amx=amx,
        vnni=vnni,
        dense_dtype=torch.bfloat16 if dense_bf16 else torch.float32,
        packed_half=packed_half,
        activation_dtype=torch.float32 if float_activations else torch.bfloat16,
        source="detected" if override == "auto" else f"{label}={override}",
        native_rows=native_rows,
    )


def _native_rows(dense_bf16: bool) -> int:
    """Rows per matmul the native kernels take on this machine (compiles them on first use):
    by default only where activations are float32 (bf16 emulated), where they were measured
    faster; with the `native_kernels` setting "on" wherever they can run."""
    if dense_bf16 and native.mode() != "on":
        return 0
    return NATIVE_MAX_ROWS if native.kernels() is not None else 0


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


def native_kernels_for(x: torch.Tensor) -> native.Kernels | None:
    """The native kernels when this profile runs them and they take this activation: float32 on
    the CPU, at most `native.MAX_ROWS` rows (a decode step's; any number in a role-planned
    forward, `row_kernels`: these kernels treat each row alone), else None. The layers' norms,
    rotary and SiLU * up test the same in `ops.NativeCpuOps`; attention asks here."""
    if x.dtype is not torch.float32 or not x.is_cpu:
        return None
    if x.shape[0] > native.MAX_ROWS and row_kernels.role() is None:
        return None
    return native_kernels()


@functools.cache
def native_kernels() -> native.Kernels | None:
    """The kernels where this process's profile runs them (fixed for the process): what a CPU
    model's ops are picked by (`ops.ops_for`)."""
    return native.kernels() if cpu_kernels().native_rows else None
