"""The layers' kernels behind one object per device kind, picked once when a model is built.

Model code (`layers.py`, `models/`) never asks which device a tensor is on or whether a kernel
is there: each module that runs a kernel calls its `ops` attribute (`rms_norm`, `rotary`,
`linear`, ...), and `use_ops` hands every such module of a model the object `ops_for(device)`
picked as the model was built. What stays in a method is the per-call test of shapes and
dtypes (a row count, a stride, a weight's size), which the kernel's own contract needs.

- `Ops`: torch's reference ops, on any device; every other kind computes the same thing.
- `CpuOps`: the CPU without turbospark's native kernels: linears take row roles
  (`row_kernels`: rows padded so a row's result does not depend on the batch).
- `NativeCpuOps`: the CPU profile runs the native kernels (`native.py`, `cpu_kernels.py`):
  norms, rotary and SiLU * up of float32 rows take them, a decode step's few rows or any rows
  of a role-planned forward.
- `CudaOps`: the Triton kernels of `cuda_ops.py`, and the small-batch fusions: a decode batch
  of at most 4 rows runs q/k/v + bias + rotary (+ the KV-cache write) and gate/up + SiLU * up
  as one launch each, with the RMSNorm before them inside where its row fits one tile.

A fusion is a pair of methods: `takes_*` says whether this step's shapes take it (False on every
kind without the kernel), the other runs it. The reference kind implements each fusion as the
unfused ops compose, so a new kernel kind has a definition to be held to.

Adding a kernel: a method here (the reference in `Ops`, the kernel in its kind's override), the
layer calling `self.ops.<method>`, and a test against the reference; a new device kind: a
subclass and its branch in `ops_for`. The quantized linears (`quant.py`) are modules of their
own, not `Linear`s, and keep their CPU kernel choice there; attention kernels are the KV
cache's `AttentionBackend`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from turbospark.engine import cpu_kernels, cuda_ops, native, row_kernels
from turbospark.engine.cuda_ops import Norm
from turbospark.engine.kv_cache import LayerCache

__all__ = ["REFERENCE", "CpuOps", "CudaOps", "NativeCpuOps", "Norm", "Ops", "ops_for", "use_ops"]

_NO_CONTEXT = contextlib.nullcontext()


def _normed(ops: Ops, x: torch.Tensor, norm: Norm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual), x + residual or None) as a fused kernel computes its input."""
    if norm is None:
        return x, None
    if norm.residual is None:
        return ops.rms_norm(x, norm.weight, norm.eps), None
    return ops.add_rms_norm(x, norm.residual, norm.weight, norm.eps)


class Ops:
    """torch's reference ops (any device); the base of every kernel kind."""

    name = "torch"

    def __deepcopy__(self, memo: dict[int, Any]) -> Ops:
        return self  # stateless or holding a loaded library: a model's copy shares it

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ---- single ops ----

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # torch's fused rms_norm accumulates in float32 for bf16 inputs
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual): the residual add fused with the norm after it."""
        summed = x + residual
        return F.rms_norm(summed, (summed.shape[-1],), weight, eps), summed

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (num_tokens, num_heads, head_dim) in the Hugging Face "rotate half" layout, rotated by
        cos / sin (num_tokens, 1, head_dim) whose sin carries the sign (`RotaryEmbedding`)."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)

    def silu_mul(self, gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
        """silu(gate) * up for gate_up (num_tokens, 2 * intermediate_size)."""
        return F.silu(gate_up[..., :intermediate_size]) * gate_up[..., intermediate_size:]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias for a float weight (out_features, in_features)."""
        return F.linear(x, weight, bias)

    def head_rows(self) -> AbstractContextManager[None]:
        """The context the lm_head runs in (its rows are one per sampling sequence)."""
        return _NO_CONTEXT

    # ---- fusions: `takes_*` False here, so the model runs the single ops ----

    def fuses_norm(self, hidden: int, weight: torch.Tensor) -> bool:
        """Whether the RMSNorm over rows of `hidden` before a fused projection of `weight` can run
        inside its kernel (only asked once a `takes_*` said yes)."""
        return False

    def takes_qkv_rotary(self, x: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
        """Whether this step's q/k/v projection of x by `weight` (a float `Linear`'s) takes
        `qkv_rotary`."""
        return False

    def qkv_rotary(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotated_heads: int,
        head_dim: int,
        norm: Norm | None,
        kv: LayerCache,
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """(q/k/v (rows, heads, head_dim) with the first `rotated_heads` heads rotated, the summed
        residual of `norm` or None, whether k and v are already written to `kv`'s slots).

        x (rows, hidden) is first replaced by norm(x + residual) when `norm` is given (see `Norm`;
        needs `fuses_norm`); `num_heads` of the heads are q, the rest k then v."""
        x, summed = _normed(self, x, norm)
        qkv = self.linear(x, weight, bias).view(x.shape[0], -1, head_dim)
        rotated = self.rotary(qkv[:, :rotated_heads], *rope)
        return torch.cat([rotated, qkv[:, rotated_heads:]], dim=1), summed, False

    def takes_gate_up_silu(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this step's gate/up projection of x by `weight` (a float `Linear`'s) takes
        `gate_up_silu`."""
        return False

    def gate_up_silu(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: Norm | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(silu(x @ gate.T) * (x @ up.T) for weight = cat(gate, up), the summed residual of
        `norm` or None); `norm` as in `qkv_rotary`."""
        x, summed = _normed(self, x, norm)
        return self.silu_mul(self.linear(x, weight, bias), weight.shape[0] // 2), summed


REFERENCE = Ops()
"""The ops a module runs until `use_ops` gives it its device's."""


class CpuOps(Ops):
    """The CPU with torch's kernels: under a row role (`row_kernels`) a linear's rows are padded
    so each row's result is the same at any row count, and the lm_head's rows run as decodes."""

    name = "cpu"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if row_kernels.role() is not None:
            return row_kernels.dense_linear(x, weight, bias)  # rows padded: row-invariant
        return F.linear(x, weight, bias)

    def head_rows(self) -> AbstractContextManager[None]:
        # the lm_head's rows (one per sampling sequence) always run as decode rows
        return _NO_CONTEXT if row_kernels.role() is None else row_kernels.rows_as("decode")


class NativeCpuOps(CpuOps):
    """The CPU profile runs turbospark's native kernels: float32 rows of a norm, rotary or
    SiLU * up take them where a call has at most `native.MAX_ROWS` rows (a decode step's) or
    any number in a role-planned forward (these kernels treat each row alone)."""

    name = "cpu-native"

    def __init__(self, kernels: native.Kernels) -> None:
        self.kernels = kernels

    @staticmethod
    def _takes(x: torch.Tensor) -> bool:
        return x.dtype is torch.float32 and (x.shape[0] <= native.MAX_ROWS or row_kernels.role() is not None)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dtype == torch.float32 and self._takes(x):
            return self.kernels.rms_norm(x, weight, eps)[0]  # one call instead of about ten ops
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if weight.dtype == torch.float32 and self._takes(x) and residual.dtype == torch.float32:
            out, summed = self.kernels.rms_norm(x, weight, eps, residual)
            assert summed is not None
            return out, summed
        return Ops.add_rms_norm(self, x, residual, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self._takes(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.dtype == torch.float32:
            return self.kernels.rotary(x, cos, sin)
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)

    def silu_mul(self, gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
        if self._takes(gate_up):
            return self.kernels.silu_mul(gate_up, intermediate_size)
        return F.silu(gate_up[..., :intermediate_size]) * gate_up[..., intermediate_size:]

    def __repr__(self) -> str:
        return f"NativeCpuOps({self.kernels.path.name})"


class CudaOps(Ops):
    """The Triton kernels of `cuda_ops`: the row ops where the tensor's rows fit them, and for
    steps of at most `cuda_ops.GEMV_MAX_ROWS` rows the small-batch matmuls and their fusions
    (`cuda_ops.use_gemv` decides by rows, dtype and weight size; `cuda_ops.small_batch_kernels`
    and `fuse_norms` turn them off for A/B measurements)."""

    name = "cuda"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if cuda_ops.supports_rows(x):
            return cuda_ops.rms_norm(x, weight, eps)[0]
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if cuda_ops.supports_rows(x) and cuda_ops.supports_rows(residual):
            out, summed = cuda_ops.rms_norm(x, weight, eps, residual)
            assert summed is not None
            return out, summed
        return Ops.add_rms_norm(self, x, residual, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if cuda_ops.supports_rotary(x):
            return cuda_ops.rotary(x, cos, sin)
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)

    def silu_mul(self, gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
        if cuda_ops.supports_rows(gate_up):
            return cuda_ops.silu_mul(gate_up, intermediate_size)
        return F.silu(gate_up[..., :intermediate_size]) * gate_up[..., intermediate_size:]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if cuda_ops.use_gemv(x, weight):
            return cuda_ops.gemv(x, weight, bias)  # decode at batch 1..4
        return F.linear(x, weight, bias)

    def fuses_norm(self, hidden: int, weight: torch.Tensor) -> bool:
        return cuda_ops.fuses_norm(hidden, weight)

    def takes_qkv_rotary(self, x: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
        return cuda_ops.supports_qkv_rotary(head_dim) and cuda_ops.use_gemv(x, weight)

    def qkv_rotary(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotated_heads: int,
        head_dim: int,
        norm: Norm | None,
        kv: LayerCache,
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        # k and v go straight to the cache where its backend reads what the kernel writes
        store = (kv.k, kv.v, slot_mapping, num_heads) if cuda_ops.stores_kv(kv.backend) else None
        qkv, summed = cuda_ops.qkv_rotary(x, weight, bias, *rope, rotated_heads, head_dim, norm, store)
        return qkv, summed, store is not None

    def takes_gate_up_silu(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return cuda_ops.use_gemv(x, weight)

    def gate_up_silu(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: Norm | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return cuda_ops.gate_up_silu(x, weight, bias, norm)


CPU = CpuOps()
CUDA = CudaOps()


def ops_for(device: torch.device | str) -> Ops:
    """The ops of a model on `device`: CUDA's kernels on a CUDA device; on the CPU the native
    kernels where this process's CPU profile runs them (`cpu_kernels.native_kernels`: decided
    once per process, compiling them on first use), else torch's with row roles; torch's
    reference on any other device."""
    kind = torch.device(device).type
    if kind == "cuda":
        return CUDA
    if kind == "cpu":
        kernels = cpu_kernels.native_kernels()
        return CPU if kernels is None else NativeCpuOps(kernels)
    return REFERENCE


def users(model: nn.Module) -> Iterator[nn.Module]:
    """The modules of `model` that run kernels through an `ops` attribute."""
    return (m for m in model.modules() if isinstance(getattr(type(m), "ops", None), Ops))


def use_ops(model: nn.Module, ops: Ops) -> None:
    """Hands `ops` to every module of `model` that runs kernels (a class with an `ops`
    attribute): once, when the model is built on its device, after its linears are final."""
    for module in users(model):
        setattr(module, "ops", ops)  # noqa: B010 (an instance attribute over the class default)
