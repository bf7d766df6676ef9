"""Weight-only quantization of the model's `Linear` layers, done once after loading.

- "int8": symmetric per-output-channel int8, run by `aten._weight_int8pack_mm` (x stays in the
  activation dtype; bf16 activations are the fast path on CPU).
- "int4": asymmetric int4 in groups of `group_size` input channels, packed by
  `aten._convert_weight_to_int4pack_for_cpu` and run by `aten._weight_int4pack_mm_for_cpu`.

Where the native kernels run (`turbospark.engine.native`, x86 with AVX2), a decode step's rows
take them instead: the int8 codes as they are, the int4 codes in the native q4 layout (torch's
int4 layout is then not built).

Embeddings stay float: a lookup reads one row per token, so quantizing them saves no time.
The lm_head is int8 in both modes (see `quantize_linear`).
The float path is the numerics reference; tests bound how far each quantized path drifts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from turbospark.engine import native, row_kernels
from turbospark.engine.cpu_kernels import cpu_kernels
from turbospark.engine.layers import Linear

QUANT_MODES = ("int8", "int4")
# At this many tokens per matmul (a prefill chunk) the weight is expanded and run through the
# dense (AMX / BLAS) matmul: the int kernels are built for few rows. The dense dtype is the
# CPU's fast one (`turbospark.engine.cpu_kernels`): bf16 with AMX / AVX-512 BF16, float32 on
# AVX2, where a bf16 matmul is emulated and 6-7x slower than float32.
MIN_ROWS_TO_DEQUANTIZE = 32
# Where the CPU profile packs an fp16 copy of the weight for fbgemm (`cpu_kernels().packed_half`),
# every matmul of at least this many rows runs on it: from 2 rows on it beats both int kernels
# (Qwen2.5-0.5B / SmolLM2 shapes, 2-core AVX2 EPYC: 8 rows 0.26-1.6 ms against 0.40-2.9 ms).
MIN_ROWS_PACKED = 2
QUANT_CHUNK_ROWS = 4096
LM_HEAD_MAX_PADDING = 1.25


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> int8 (out, in) and per-row scales (out,) float32."""
    out_features = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(out_features, dtype=torch.float32, device=weight.device)
    # in row chunks: a 150k x 1k embedding would otherwise need several float32 copies at once
    for start in range(0, out_features, QUANT_CHUNK_ROWS):
        w = weight[start : start + QUANT_CHUNK_ROWS].float()
        s = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (rows,)
        q[start : start + QUANT_CHUNK_ROWS] = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        scales[start : start + QUANT_CHUNK_ROWS] = s
    return q, scales


def quantize_int4(
    weight: torch.Tensor, group_size: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> codes (out, in) int32 in [0, 15] and scales_and_zeros (in / group, out, 2).

    Dequantized weight = (code - 8) * scale + zero per group of `group_size` input channels,
    with scale and zero as stored in `dtype`. The codes are chosen against the stored (rounded)
    scale and zero: a bf16 zero is off by up to 2^-9 of its size, and rounding against the exact
    one would shift the whole group by that much.
    """
    out_features, in_features = weight.shape
    w = weight.float().reshape(out_features, in_features // group_size, group_size)
    w_min = w.amin(dim=-1, keepdim=True)
    w_max = w.amax(dim=-1, keepdim=True)
    scales = ((w_max - w_min) / 15.0).clamp(min=1e-6).to(dtype).float()  # (out, groups, 1)
    zeros = (w_min + scales * 8.0).to(dtype).float()
    codes = (
        torch.round((w - zeros) / scales + 8.0)
        .clamp(0, 15)
        .to(torch.int32)
        .reshape(out_features, in_features)
    )
    scales_and_zeros = torch.stack([scales.squeeze(-1), zeros.squeeze(-1)], dim=-1)  # (out, groups, 2)
    return codes, scales_and_zeros.transpose(0, 1).contiguous().to(dtype)


def _dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + bias in w's dtype, returned in x's."""
    y = F.linear(x.to(w.dtype), w, None if bias is None else bias.to(w.dtype))
    return y.to(x.dtype)


FBGEMM_FP16_BLOCK_ROWS = 512  # fbgemm pads the packed matrix's input dimension to this multiple


def will_pack(weight: torch.Tensor, max_padding: float = float("inf")) -> bool:
    """Whether `pack_half` packs this weight (ask first: building its float copy can cost more
    memory than the packed copy, e.g. 113 MB for SmolLM2's tied lm_head, which is not packed)."""
    if weight.device.type != "cpu" or not cpu_kernels().packed_half:
        return False
    in_features = weight.shape[1]
    padded = -(-in_features // FBGEMM_FP16_BLOCK_ROWS) * FBGEMM_FP16_BLOCK_ROWS
    return padded <= max_padding * in_features


# A remainder of the input dimension past the last multiple of 512 is split off (kept as a float32
# matrix beside the packed part) when it is under a third of a block: its 4 bytes a weight then
# cost less than the fp16 padding they would need. SmolLM2's 576 = 512 + 64: 2.2 bytes a weight
# instead of 3.6 (-130 MB for the model), and the same time from 16 rows up (AVX2 EPYC, 2 cores).
MAX_SPLIT_TAIL = FBGEMM_FP16_BLOCK_ROWS // 3


@dataclass(slots=True)
class HalfPacked:
    """fbgemm's packed fp16 copy of a float (out, in) weight: its first `split` input columns
    packed (with the bias), the rest (`tail`, (in - split, out) float32 holding fp16-rounded
    values, or None) multiplied beside them. `matmul`: x (rows, in) float32 -> (rows, out)."""

    head: torch.ScriptObject
    tail: torch.Tensor | None
    split: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.tail is None:
            out: torch.Tensor = torch.ops.quantized.linear_dynamic_fp16(x, self.head)
            return out
        out = torch.ops.quantized.linear_dynamic_fp16(x[:, : self.split].contiguous(), self.head)
        return out.addmm_(x[:, self.split :], self.tail)


def pack_half(
    weight: torch.Tensor, bias: torch.Tensor | None, max_padding: float = float("inf")
) -> HalfPacked | None:
    """fbgemm's packed fp16 copy of a float (out, in) weight (and float32 bias), or None where the
    CPU profile does not use it (native bf16, no fbgemm), the weight is not on the CPU, or the
    packed copy would be more than `max_padding` times the fp16 size (fbgemm pads the input
    dimension to a multiple of 512: SmolLM2's 576 becomes 1,024, 1.78x). A small remainder past
    the last multiple of 512 is split off unpadded (`MAX_SPLIT_TAIL`)."""
    if not will_pack(weight, max_padding):
        return None
    b = None if bias is None else bias.float()
    weight = weight.float()
    in_features = weight.shape[1]
    tail = in_features % FBGEMM_FP16_BLOCK_ROWS
    split = (
        in_features - tail if in_features > FBGEMM_FP16_BLOCK_ROWS and tail < MAX_SPLIT_TAIL else in_features
    )
    prepack = torch.ops.quantized.linear_prepack_fp16
    if split == in_features:
        return HalfPacked(prepack(weight.contiguous(), b), None, split)
    rest = weight[:, split:].to(torch.float16).float().t().contiguous()  # what fp16 holds, as the packed part
    return HalfPacked(prepack(weight[:, :split].contiguous(), b), rest, split)


def _packed_matmul(x: torch.Tensor, packed: HalfPacked) -> torch.Tensor:
    """x @ w.T + bias on the packed fp16 weight: float32 in and out, returned in x's dtype."""
    return packed.matmul(x.float()).to(x.dtype)


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The int kernels' activation dtype for a model computing in `dtype`: bf16 for float32
    models (float32 sends the kernels to a path 20-100x slower on AVX2, measured); a caller that
    wants the float32 kernel's exact arithmetic asks for it by name."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


class Int8Linear(nn.Module):
    def __init__(
        self,
        linear: Linear,
        dtype: torch.dtype,
        dense_dtype: torch.dtype | None = None,
        max_padding: float = float("inf"),
        kernel_dtype: torch.dtype | None = None,
        native_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.native_rows = _native_rows(linear, native_rows, kernel_dtype)
        self.kernel_dtype = kernel_dtype or _kernel_dtype(dtype)
        # the dtype a many-row matmul expands the weight to (see MIN_ROWS_TO_DEQUANTIZE)
        self.dense_dtype = dense_dtype or cpu_kernels().dense_dtype
        q, scales = quantize_int8(linear.weight.data)
        self.weight: torch.Tensor | None
        self.scales: torch.Tensor
        self.bias: torch.Tensor | None
        # where the native kernels run, their layout replaces the (out, in) codes: `expanded`
        # widens it for many rows, `rows_weight` rebuilds the codes for torch's int8 kernel
        self.q8 = native.pack_q8(q, scales) if self.native_rows else None
        self.register_buffer("weight", None if self.q8 is not None else q)  # (out, in) int8
        self.register_buffer("scales", scales.to(self.kernel_dtype))  # (out,)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.data.to(dtype))
        # the packed copy holds the int8 codes themselves (exact in fp16); the row scales and the
        # bias are applied to its float32 output, so both paths compute with the same weight
        self.packed = pack_half(q, None, max_padding)  # widened to float only if packed
        self.out_scales = scales  # (out,) float32
        self.float_bias = None if self.bias is None else self.bias.float()

    def rows_weight(self) -> torch.Tensor:
        """The codes (out, in) int8: the buffer, or rebuilt from the native layout."""
        if self.weight is not None:
            return self.weight
        assert self.q8 is not None
        return self.q8.unpack()

    def expanded(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight (out, in) times its scales, in `dtype`, for a matmul of many rows: one pass
        over the codes (the native layout's own kernel where the weight is kept in it)."""
        if self.q8 is not None:
            kernels = native.kernels()
            assert kernels is not None
            # the scales as the torch path widens them (the kernel dtype's), so both agree
            return kernels.q8_expand(self.q8, dtype, self.scales.to(dtype).float())
        return self.rows_weight() * self.scales.to(dtype)[:, None]  # int8 promotes

    def forward_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and each row's argmax over the output (rows,) int64 where the native kernel
        finds it as it writes the rows (float32 activations, rows it takes); else None."""
        if x.shape[0] <= self.native_rows and x.dtype == torch.float32:
            kernels = native.kernels()
            assert kernels is not None
            assert self.q8 is not None
            return kernels.q8_matmul_argmax(x, self.q8, self.float_bias)
        return self.forward(x), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, in_features)
        role = row_kernels.role()
        if role is not None:
            return self._by_role(x, role)
        rows = x.shape[0]
        if rows <= self.native_rows:
            kernels = native.kernels()
            assert kernels is not None
            assert self.q8 is not None
            return kernels.q8_matmul(x.float(), self.q8, self.float_bias).to(x.dtype)
        if self.packed is not None and rows >= MIN_ROWS_PACKED:
            out = self.packed.matmul(x.float()) * self.out_scales
            out = out if self.bias is None else out + self.bias
            return out.to(x.dtype)
        if rows >= MIN_ROWS_TO_DEQUANTIZE:
            dt = self.dense_dtype
            w = self.expanded(dt)  # (out, in) in dt: one pass
            return _dense(x, w, self.bias)
        return self._int8pack(x)

    def _int8pack(self, x: torch.Tensor) -> torch.Tensor:
        xk = x.to(self.kernel_dtype)
        y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(xk, self.rows_weight(), self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _by_role(self, x: torch.Tensor, role: row_kernels.Role) -> torch.Tensor:
        """Decode rows: the native kernel in groups of its row limit (torch's int8 kernel where
        it does not run); prompt rows: the packed fp16 GEMM, else the expanded weight, padded."""
        if role == "decode":
            if not self.native_rows:
                return self._int8pack(x)
            kernels = native.kernels()
            assert kernels is not None and self.q8 is not None
            q8, bias = self.q8, self.float_bias

            def run(rows: torch.Tensor) -> torch.Tensor:
                return kernels.q8_matmul(rows, q8, bias)

            return row_kernels.in_groups(x.float(), self.native_rows, run).to(x.dtype)
        multiple = None if self.packed is None else row_kernels.packed_multiple(self.packed.tail is not None)
        if self.packed is not None and multiple is not None:
            packed = self.packed
            out = row_kernels.padded(x.float(), multiple, packed.matmul)
            out = out * self.out_scales
            out = out if self.bias is None else out + self.bias
            return out.to(x.dtype)
        w = self.expanded(self.dense_dtype)
        bias = None if self.bias is None else self.bias.to(w.dtype)
        return row_kernels.dense_linear(x.to(w.dtype), w, bias).to(x.dtype)


class Int4Linear(nn.Module):
    """int4 weights twice: in a decode kernel's layout (the native kernels' blocks, else torch's
    int4 layout) and for many rows either fbgemm's packed fp16 copy (`cpu_kernels().packed_half`)
    or plain nibbles to expand.

    The kernel's layout is opaque, so a dense prefill needs its own copy of the codes: half a
    byte per weight more as nibbles, for a prefill about twice as fast as the kernel's at 256
    tokens; two bytes more as packed fp16, for a prefill 2-3x faster again on AVX2.
    """

    def __init__(
        self,
        linear: Linear,
        dtype: torch.dtype,
        group_size: int,
        dense_dtype: torch.dtype | None = None,
        kernel_dtype: torch.dtype | None = None,
        native_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        self.dense_dtype = dense_dtype or cpu_kernels().dense_dtype
        self.native_rows = _native_rows(linear, native_rows, kernel_dtype, bits=4)
        self.kernel_dtype = kernel_dtype or _kernel_dtype(dtype)
        codes, scales_and_zeros = quantize_int4(linear.weight.data, group_size, self.kernel_dtype)
        self.weight: torch.Tensor | None
        self.q4: native.Q4Weight | None = None
        self.scales_and_zeros: torch.Tensor
        self.nibbles: torch.Tensor
        self.bias: torch.Tensor | None
        if self.native_rows:
            # the native kernel's layout replaces torch's int4 one: single rows never reach it
            sz = scales_and_zeros.float().transpose(0, 1)  # (out, groups, 2)
            offsets = sz[..., 1] - 8 * sz[..., 0]
            self.q4 = native.pack_q4(codes, sz[..., 0], offsets, group_size)
            self.register_buffer("weight", None)
        else:
            self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        # (out, in / 2) uint8: even input columns in the low nibble, odd ones in the high
        pairs = codes.to(torch.uint8).view(self.out_features, -1, 2)
        self.register_buffer("nibbles", pairs[..., 0] | (pairs[..., 1] << 4))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.data.to(dtype))
        # the packed copy holds what the int4 kernel computes with, so both paths agree
        self.packed = pack_half(self.dequantize(torch.float32), self.bias) if will_pack(codes) else None
        if self.packed is not None:
            del self.nibbles  # the packed copy replaces the expansion path
            self.register_buffer("nibbles", None)
        self.float_bias = None if self.bias is None else self.bias.float()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight (out, in) as the kernel sees it, in `dtype`: code * scale + (zero - 8 * scale)."""
        codes = torch.empty(self.out_features, self.in_features // 2, 2, dtype=torch.uint8)
        torch.bitwise_and(self.nibbles, 0xF, out=codes[..., 0])
        torch.bitwise_right_shift(self.nibbles, 4, out=codes[..., 1])
        sz = self.scales_and_zeros.transpose(0, 1).to(dtype)  # (out, groups, 2)
        scales = sz[..., :1]
        offsets = sz[..., 1:] - 8 * scales
        w = torch.empty(self.out_features, self.in_features // self.group_size, self.group_size, dtype=dtype)
        torch.addcmul(offsets, codes.view(w.shape).to(dtype), scales, out=w)
        return w.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (num_tokens, in_features)
        role = row_kernels.role()
        if role is not None:
            return self._by_role(x, role)
        rows = x.shape[0]
        if rows <= self.native_rows:
            kernels = native.kernels()
            assert kernels is not None and self.q4 is not None
            return kernels.q4_matmul(x.float(), self.q4, self.float_bias).to(x.dtype)
        if self.packed is not None and rows >= MIN_ROWS_PACKED:
            return _packed_matmul(x, self.packed)
        if rows >= MIN_ROWS_TO_DEQUANTIZE or self.weight is None:
            return _dense(x, self.dequantize(self.dense_dtype), self.bias)
        return self._int4pack(x)

    def _int4pack(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.kernel_dtype), self.weight, self.group_size, self.scales_and_zeros
        )
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _by_role(self, x: torch.Tensor, role: row_kernels.Role) -> torch.Tensor:
        """As `Int8Linear._by_role`, on the q4 layout or torch's int4 one."""
        if role == "decode":
            if self.q4 is None:
                return self._int4pack(x)
            kernels = native.kernels()
            assert kernels is not None
            q4, bias = self.q4, self.float_bias
            rows = max(1, self.native_rows)
            return row_kernels.in_groups(x.float(), rows, lambda a: kernels.q4_matmul(a, q4, bias)).to(
                x.dtype
            )
        multiple = None if self.packed is None else row_kernels.packed_multiple(self.packed.tail is not None)
        if self.packed is not None and multiple is not None:
            packed = self.packed
            return row_kernels.padded(x, multiple, lambda a: _packed_matmul(a, packed))
        bias = None if self.bias is None else self.bias.to(self.dense_dtype)
        w = self.dequantize(self.dense_dtype)
        return row_kernels.dense_linear(x.to(w.dtype), w, bias).to(x.dtype)


def _native_rows(linear: Linear, wanted: int | None, kernel_dtype: torch.dtype | None, bits: int = 8) -> int:
    """How many rows of this linear the native kernels take (0: none). `wanted` None: the CPU
    profile's count, unless the caller asked for torch's kernel in a given `kernel_dtype`; never
    off the CPU, past what the kernels take, or for a width that is not whole blocks of 32."""
    if wanted is None:
        wanted = cpu_kernels().native_rows if kernel_dtype is None else 0
    if not wanted or linear.weight.device.type != "cpu" or not native.supports(linear.in_features, bits):
        return 0
    if native.kernels() is None:
        return 0
    return min(wanted, native.MAX_ROWS)


def _int4_group_size(in_features: int, preferred: int) -> int | None:
    for g in (preferred, 128, 64, 32):
        if in_features % g == 0:
            return g
    return None


def quantize_linear(
    linear: nn.Module, role: str, *, mode: str, dtype: torch.dtype, group_size: int = 32
) -> nn.Module:
    """The quantized replacement for one float `Linear`; `dtype` is the activation dtype.

    With "int4" the lm_head still gets int8: it is where 4 bits hurt most (on SmolLM2, teacher-
    forced top-1 agreement with float32 goes from 83% to 98%), for 1/8 of the bytes a token reads.
    """
    assert isinstance(linear, Linear)
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization {mode!r} (choose from {', '.join(QUANT_MODES)})")
    if role == "lm_head":
        # its packed copy only pays for batched decodes: not at any padding (SmolLM2: +100 MB)
        return Int8Linear(linear, dtype, max_padding=LM_HEAD_MAX_PADDING)
    if mode == "int4":
        g = _int4_group_size(linear.in_features, group_size)
        # a layer whose width no group size divides falls back to int8
        return Int4Linear(linear, dtype, g) if g is not None else Int8Linear(linear, dtype)
    return Int8Linear(linear, dtype)


def is_on_int4_grid(weight: torch.Tensor, group_size: int = 32, max_rows: int = 64) -> bool:
    """True when every group of `group_size` inputs holds at most 16 distinct values.

    That is what a 4-bit GGUF (Q4_0, Q4_1, Q4_K) dequantizes to: int4 in groups of 32 then
    stores those weights all but exactly, so it costs no accuracy over the source.
    """
    if weight.shape[1] % group_size:
        return False
    groups = weight[:max_rows].float().reshape(-1, group_size).sort(dim=-1).values  # (groups, group_size)
    num_distinct = (groups[:, 1:] != groups[:, :-1]).sum(dim=-1) + 1
    return bool((num_distinct <= 16).all())


def auto_quant(tensors: Mapping[str, torch.Tensor]) -> str:
    """int4 when the checkpoint's linear weights already lie on a 4-bit grid, else int8."""
    # a vision model's text layers sit under its own prefix (Idefics3: model.text_model.)
    prefix = next(
        (p for p in ("model.", "model.text_model.") if f"{p}layers.0.self_attn.q_proj.weight" in tensors),
        "model.",
    )
    probe = [tensors.get(f"{prefix}layers.0.{name}.weight") for name in ("self_attn.q_proj", "mlp.gate_proj")]
    if all(w is not None and is_on_int4_grid(w) for w in probe):
        return "int4"
    return "int8"
