"""turbospark's own few-row matmul kernels for quantized weights on x86 CPUs with AVX2.

Why hand-written: on an AVX2-only CPU, torch's int4 / int8 decode kernels
(`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) widen each weight to float and spend
4-5x the time it takes to read it, and no library on the package index offers the alternative
as a prebuilt CPU kernel (llama.cpp's, which this follows, ships as source only). The kernels in
`csrc/qgemv.c` quantize each activation row to int8 in blocks of 32 and multiply bytes by bytes
(vpmaddubsw, or AVX-512 VNNI's vpdpbusd where the CPU has it): about 2x torch's kernels at one
row on the 2-core EPYC they were written on, and a weight read once serves every row of a call
(a batch of a few decodes).

The C file is compiled on first use with the system's C compiler (`$CC`, else `cc` / `gcc`) into
turbospark's cache directory, keyed by a hash of the source and flags, and loaded with ctypes.
Its threads are its own, not OpenMP's: work is split into chunks that threads claim, so a
thread the OS has not scheduled (another process, or the server's event loop, on the same
cores) delays nothing; an OpenMP region waits for every thread of its team (see the C file).
The thread count is torch's (`torch.get_num_threads()`). Where there is no compiler, no AVX2 /
FMA / F16C, or the `native_kernels` setting is "off" (`--native-kernels off`,
`TURBOSPARK_NATIVE_KERNELS=0`: `kernel_settings`), `kernels()` is None and the quantized linears
keep torch's kernels; where bf16 is native (AMX, AVX-512 BF16) the CPU profile does not use them
unless it is "on" (measured slower there, see `cpu_kernels`). The `native_vnni` setting picks the
build (below), and `pool_steal` is handed to the library as it loads (`ts_pool_set_stealing`:
the C side reads no environment).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from turbospark.engine import kernel_settings
from turbospark.engine.checkpoint import cache_dir
from turbospark.engine.cpu_info import cpu_flags

log = logging.getLogger(__name__)

ENV_VAR = kernel_settings.ENV_VARS["native_kernels"]
SOURCE = Path(__file__).with_name("csrc") / "qgemv.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fno-math-errno", "-pthread", "-shared", "-fPIC")
REQUIRED_FLAGS = frozenset({"avx2", "fma", "f16c"})
# the byte dot products as AVX-512 VNNI's vpdpbusd (256-bit form) where the CPU has it: one
# instruction for vpmaddubsw + vpmaddwd, the same sums; the `native_vnni` setting off keeps AVX2's
VNNI_FLAGS = ("-mavx512vnni", "-mavx512vl")
VNNI_CPU_FLAGS = frozenset({"avx512_vnni", "avx512vl"})
VNNI_ENV_VAR = kernel_settings.ENV_VARS["native_vnni"]
BLOCK = 32  # inputs per quantization block (activations and q4 weights)
Q4_COLS = 8  # output columns of a q4 / q8 weight stored together (the C side's Q4_COLS, Q8_COLS)
MAX_ROWS = 8  # rows per call (the C side's MAX_ROWS)
COMPILE_TIMEOUT_S = 120
KV_DTYPES = (torch.float32, torch.float16)  # KV caches the decode attention reads

_P = ctypes.c_void_p
_I = ctypes.c_int


@dataclass(frozen=True, slots=True)
class Kernels:
    """The loaded library: quantized matmuls and the decode step's other kernels, on float32."""

    lib: ctypes.CDLL
    path: Path
    vnni: bool = False  # built with AVX-512 VNNI's dot products

    def q4_matmul(self, x: torch.Tensor, w: Q4Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """x (rows, in) float32 @ the q4 weight (+ bias float32)."""
        weight = (w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr())
        return self._matmul(self.lib.ts_q4_matmul, x, weight, w.out_features, bias)

    def q8_matmul(self, x: torch.Tensor, w: Q8Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """(x (rows, in) float32 @ the q8 codes.T) * their column scales (+ bias float32)."""
        return self._matmul(
            self.lib.ts_q8_matmul, x, (w.codes.data_ptr(), w.scales.data_ptr()), w.out_features, bias
        )

    def q8_matmul_argmax(
        self, x: torch.Tensor, w: Q8Weight, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`q8_matmul`'s y, and each row's argmax over it (rows,) int64, found as the chunks are
        written (numpy's argmax: the first maximum, a NaN first of all)."""
        ids = torch.empty(x.shape[0], dtype=torch.int64)
        weight = (w.codes.data_ptr(), w.scales.data_ptr())
        y = self._matmul(self.lib.ts_q8_matmul_argmax, x, weight, w.out_features, bias, ids.data_ptr())
        return y, ids

    def q8_expand(self, w: Q8Weight, dtype: torch.dtype, scales: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (out, in) as codes times column scales (`scales` (out,) float32, else the
        weight's own), in float32 or bfloat16 (rounded to nearest even, as torch converts): for
        the matmuls of many rows."""
        if dtype not in (torch.float32, torch.bfloat16):
            return self.q8_expand(w, torch.float32, scales).to(dtype)
        scales = (w.scales if scales is None else scales).float().contiguous()
        blocks = w.codes.shape[1]
        out = torch.empty(w.out_features, blocks * BLOCK, dtype=dtype)
        bf16 = int(dtype == torch.bfloat16)
        rc = self.lib.ts_q8_expand(
            w.codes.data_ptr(), scales.data_ptr(), w.out_features, blocks * BLOCK, out.data_ptr(), bf16,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"native q8 expansion refused a weight of width {blocks * BLOCK}")
        return out

    @staticmethod
    def _matmul(
        fn: Any, x: torch.Tensor, weight: tuple[int, ...], n: int, bias: torch.Tensor | None, *extra: int
    ) -> torch.Tensor:
        """y (rows, n) float32 from one of the C matmuls: (x, rows, k, *weight, n, bias, y,
        *extra, threads)."""
        rows, k = x.shape
        x = x.contiguous()
        y = torch.empty(rows, n, dtype=torch.float32)
        rc = fn(x.data_ptr(), rows, k, *weight, n, _ptr(bias), y.data_ptr(), *extra, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(
                f"native matmul refused {rows} rows of width {k} (at most {MAX_ROWS} rows, width % 32 == 0)"
            )
        return y

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rms_norm(x + residual) * weight, x + residual or None) over the last dim, float32."""
        d = x.shape[-1]
        x = x.contiguous()
        y = torch.empty_like(x)
        summed = None
        if residual is not None:
            residual = residual.contiguous()
            summed = torch.empty_like(x)
        self.lib.ts_rms_norm(
            x.data_ptr(),
            _ptr(residual),
            _ptr(summed),
            weight.data_ptr(),
            eps,
            x.numel() // d,
            d,
            y.data_ptr(),
        )
        return y, summed

    def silu_mul(self, gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
        """silu(gate) * up for gate_up (rows, 2 * intermediate_size) float32."""
        gate_up = gate_up.contiguous()
        rows = gate_up.shape[0]
        y = gate_up.new_empty(rows, intermediate_size)
        self.lib.ts_silu_mul(gate_up.data_ptr(), rows, intermediate_size, y.data_ptr())
        return y

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (tokens, heads, head_dim) float32 whose heads are contiguous rows (a slice of a
        wider row is fine), rotated by cos / sin (tokens, 1, head_dim); a new contiguous tensor."""
        tokens, heads, hd = x.shape
        assert x.stride(2) == 1 and x.stride(1) == hd
        cos, sin = cos.contiguous(), sin.contiguous()
        y = x.new_empty(tokens, heads, hd)
        self.lib.ts_rotary(
            x.data_ptr(), tokens, heads, hd, x.stride(0), cos.data_ptr(), sin.data_ptr(), y.data_ptr()
        )
        return y

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_ids: torch.Tensor,
        offsets: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query token per sequence: q (seqs, heads, head_dim) over the caches (kv_heads,
        slots, head_dim) float32 or float16, sequence s reading slot_ids[offsets[s]:offsets[s + 1]]
        (int64)."""
        seqs, heads, hd = q.shape
        kv_heads, num_slots, _ = k_cache.shape
        assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES
        q = q.contiguous()
        out = torch.empty_like(q)
        rc = self.lib.ts_decode_attention(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.float16),
            num_slots,
            slot_ids.data_ptr(),
            offsets.data_ptr(),
            seqs,
            heads,
            kv_heads,
            hd,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("native decode attention could not allocate its score buffer")
        return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def supports(in_features: int, bits: int = 8) -> bool:
    """Whether a weight of this input width fits the kernels (q4: pairs of 32-input blocks)."""
    return in_features % (2 * BLOCK if bits == 4 else BLOCK) == 0


@dataclass(frozen=True, slots=True)
class Q4Weight:
    """The q4 kernel's layout of w = code * scale + offset (see `pack_q4`)."""

    codes: torch.Tensor  # (groups of Q4_COLS columns, blocks, 128) uint8
    scales: torch.Tensor  # (groups, blocks, Q4_COLS) fp16, one per 32 inputs of a column
    offsets: torch.Tensor  # the same shape
    out_features: int


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int) -> Q4Weight:
    """codes (out, in) integers in [0, 15]; scales and offsets (out, in / group_size) float, one
    per group (a multiple of 32 inputs). Stored by groups of `Q4_COLS` output columns (out padded
    with zero columns): per group and block of 32 inputs 128 bytes, [j][column][i] with byte =
    code of input 4j + i | code of input 16 + 4j + i << 4, so one 32-byte load holds four inputs
    of each column of the group; scales and offsets (groups, blocks, Q4_COLS) fp16."""
    out_features, in_features = codes.shape
    blocks = in_features // BLOCK
    groups = -(-out_features // Q4_COLS)
    pad = groups * Q4_COLS - out_features
    repeat = group_size // BLOCK

    def per_block(v: torch.Tensor) -> torch.Tensor:
        full = torch.nn.functional.pad(v.float().repeat_interleave(repeat, dim=1), (0, 0, 0, pad))
        return full.view(groups, Q4_COLS, blocks).transpose(1, 2).to(torch.float16).contiguous()

    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    # (group, column, block, half, j, i): input 32 * block + 16 * half + 4 * j + i
    c = c.view(groups, Q4_COLS, blocks, 2, 4, 4)
    nibbles = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # (group, column, block, j, i)
    laid = nibbles.permute(0, 2, 3, 1, 4).reshape(groups, blocks, 4 * Q4_COLS * 4).contiguous()
    return Q4Weight(laid, per_block(scales), per_block(offsets), out_features)


@dataclass(frozen=True, slots=True)
class Q8Weight:
    """The q8 kernel's layout of w = code * scale (see `pack_q8`)."""

    codes: torch.Tensor  # (groups of Q4_COLS columns, blocks, 256) uint8: code + 128
    scales: torch.Tensor  # (groups * Q4_COLS,) float32, one per column, zero past out_features
    out_features: int

    def unpack(self) -> torch.Tensor:
        """The codes as (out, in) int8 (a new tensor)."""
        groups, blocks, _ = self.codes.shape
        signed = (self.codes ^ 0x80).view(torch.int8).view(groups, blocks, 8, Q4_COLS, 4)
        return signed.permute(0, 3, 1, 2, 4).reshape(groups * Q4_COLS, blocks * BLOCK)[: self.out_features]


def pack_q8(codes: torch.Tensor, scales: torch.Tensor) -> Q8Weight:
    """codes (out, in) int8 in [-127, 127], scales (out,) float, w = code * scale. Stored by
    groups of `Q4_COLS` output columns as the q4 codes are (out padded with zero columns): per
    group and block of 32 inputs 256 bytes, [j][column][i] with byte = code of input 4j + i
    plus 128 (unsigned, for VNNI's unsigned x signed product)."""
    out_features, in_features = codes.shape
    groups = -(-out_features // Q4_COLS)
    pad = groups * Q4_COLS - out_features
    c = torch.nn.functional.pad(codes.to(torch.int8), (0, 0, 0, pad)).view(torch.uint8) ^ 0x80
    c = c.view(groups, Q4_COLS, in_features // BLOCK, 8, 4)  # (group, column, block, j, i)
    laid = c.permute(0, 2, 3, 1, 4).reshape(groups, in_features // BLOCK, 8 * Q4_COLS * 4).contiguous()
    padded_scales = torch.nn.functional.pad(scales.float(), (0, pad)).contiguous()
    return Q8Weight(laid, padded_scales, out_features)


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc"):
        if cc and shutil.which(cc):
            return cc
    return None


def uses_vnni(flags: frozenset[str] | None = None) -> bool:
    """Whether the kernels are built with AVX-512 VNNI dot products on this CPU (or `flags`)."""
    if not kernel_settings.current().native_vnni:
        return False
    return VNNI_CPU_FLAGS.issubset(cpu_flags() if flags is None else flags)


def build_flags() -> tuple[str, ...]:
    return (*FLAGS, *VNNI_FLAGS) if uses_vnni() else FLAGS


def _library_path(cc: str, flags: tuple[str, ...]) -> Path:
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join((cc, *flags, torch.__version__)).encode())
    return cache_dir() / "kernels" / f"qgemv-{digest.hexdigest()[:16]}.so"


def _build(cc: str, target: Path, flags: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # compiled to a private name and renamed into place: processes starting at once never load
    # a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, "-o", tmp, str(SOURCE)],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path, vnni: bool = False) -> Kernels:
    lib = ctypes.CDLL(str(path))
    lib.ts_q4_matmul.argtypes = [_P, _I, _I, _P, _P, _P, _I, _P, _P, _I]
    lib.ts_q4_matmul.restype = _I
    lib.ts_q8_matmul.argtypes = [_P, _I, _I, _P, _P, _I, _P, _P, _I]
    lib.ts_q8_matmul.restype = _I
    lib.ts_q8_matmul_argmax.argtypes = [_P, _I, _I, _P, _P, _I, _P, _P, _P, _I]
    lib.ts_q8_matmul_argmax.restype = _I
    lib.ts_q8_expand.argtypes = [_P, _P, _I, _I, _P, _I, _I]
    lib.ts_q8_expand.restype = _I
    F = ctypes.c_float
    lib.ts_rms_norm.argtypes = [_P, _P, _P, _P, F, _I, _I, _P]
    lib.ts_rms_norm.restype = None
    lib.ts_silu_mul.argtypes = [_P, _I, _I, _P]
    lib.ts_silu_mul.restype = None
    lib.ts_rotary.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P]
    lib.ts_rotary.restype = None
    lib.ts_decode_attention.argtypes = [_P, _P, _P, _I, ctypes.c_int64, _P, _P, _I, _I, _I, _I, F, _P, _I]
    lib.ts_decode_attention.restype = _I
    # (model description, rows, x, cos, sin, write slots, slot ids, offsets, out, threads)
    lib.ts_decode_step.argtypes = [_P, _I, _P, _P, _P, _P, _P, _P, _P, _I]
    lib.ts_decode_step.restype = _I
    lib.ts_pool_steals.argtypes = []
    lib.ts_pool_steals.restype = ctypes.c_long
    lib.ts_pool_set_stealing.argtypes = [_I]
    lib.ts_pool_set_stealing.restype = _I
    lib.ts_pool_test_stall.argtypes = [_I]
    lib.ts_pool_test_stall.restype = None
    lib.ts_pool_set_stealing(int(kernel_settings.current().pool_steal))
    return Kernels(lib, path, vnni)


def mode() -> str:
    """The `native_kernels` setting: "auto" (default: where the CPU profile runs them), "on"
    (wherever they can run) or "off"."""
    return kernel_settings.current().native_kernels


def unavailable_reason(flags: frozenset[str] | None = None) -> str | None:
    """Why the kernels cannot run here (None: they can, given a compiler)."""
    if mode() == "off":
        return f"{kernel_settings.origin('native_kernels')} turns them off"
    missing = REQUIRED_FLAGS - (cpu_flags() if flags is None else flags)
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    if _compiler() is None:
        return "no C compiler (set $CC, or install gcc)"
    return None


@functools.cache
def kernels() -> Kernels | None:
    """The compiled kernels, or None where they cannot run (logged once, with the reason)."""
    reason = unavailable_reason()
    if reason is not None:
        log.info("native quantized kernels off: %s", reason)
        return None
    cc = _compiler()
    assert cc is not None
    error: Exception | None = None
    # a compiler too old for the VNNI flags still builds the AVX2 variant
    for flags in dict.fromkeys((build_flags(), FLAGS)):
        path = _library_path(cc, flags)
        try:
            if not path.exists():
                _build(cc, path, flags)
            return _load(path, vnni=flags != FLAGS)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            error = e
    log.warning("native quantized kernels off: %s", error)
    return None
