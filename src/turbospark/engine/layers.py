"""Building blocks shared by the model files: norms, rotary embeddings, linears, attention.

Every model forward is "packed": the new tokens of all sequences in one step are concatenated
along one flat token axis (`num_tokens`), and `AttentionMetadata` says which tokens belong to
which sequence, where their keys/values go in the paged KV cache and which cached slots each
sequence attends to. The metadata is built once per step by the runner and passed down as an
argument; nothing here keeps per-step state.

Which kernel runs a norm, a linear, the rotary or SiLU * up is not decided here: each such
module calls its `ops` (`turbospark.engine.ops`), which `build_model` sets to its device's once
the model is built (torch's reference until then).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from turbospark.engine.ops import REFERENCE, Ops


class RMSNorm(nn.Module):
    ops: Ops = REFERENCE

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add fused with the norm."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Embedding(nn.Module):
    """Token embedding table (vocab, hidden); `weight` is set by the loader."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        # rows come out in this dtype when the table is stored narrower (None: the table's)
        self.out_dtype: torch.dtype | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        return rows if self.out_dtype is None else rows.to(self.out_dtype)


class Linear(nn.Module):
    """y = x @ weight.T + bias with a float weight (out_features, in_features).

    `turbospark.engine.quant` swaps these for int8 / int4 versions after loading.
    """

    ops: Ops = REFERENCE

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)


PrepareLinear = Callable[[nn.Module, str], nn.Module]
"""What `finalize` does to each (fused) linear once loaded, given its role ("qkv_proj",
"lm_head", ...): a quantizer, or the identity."""


def fuse_linears(parts: Sequence[Linear]) -> Linear:
    """One Linear whose output is the parts' outputs concatenated (fewer, larger matmuls)."""
    has_bias = [p.bias is not None for p in parts]
    fused = Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=any(has_bias))
    fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    if fused.bias is not None:
        biases = [p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in parts]
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return fused


def rope_inv_freq(config: Any) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,), with llama3-style scaling when configured."""
    dim: int = config.head_dim
    # float32 like the reference implementation, so positions far out rotate identically
    theta = float(config.rope_theta)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling: dict[str, Any] = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, blended, scaled)
    elif rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type != "default":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, looked up once per forward and shared by every layer."""

    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (max_positions, head_dim // 2)
        # computed in float32, kept in the activation dtype like the reference casts them
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.cat([freqs.cos(), freqs.cos()], dim=-1), persistent=False)
        # sign folded in: rotate_half(x) * sin == roll(x, half) * cat(-sin, sin)
        self.register_buffer("sin", torch.cat([-freqs.sin(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (num_tokens, 1, head_dim) each, broadcasting over heads
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def load_weights(
    module: nn.Module,
    names: Sequence[str],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    linear_dtype: torch.dtype | None,
    overrides: Mapping[str, torch.dtype] | None = None,
    consume: bool = False,
) -> None:
    """Sets each named parameter from the checkpoint tensor of the identical name.

    Every name must be present with the model's shape; other checkpoint names (rotary caches,
    a vision tower, a tied lm_head) are ignored. Parameters of `Linear` modules are cast to
    `linear_dtype` (None: kept as the checkpoint has them, for a quantizer to read), the rest
    to `dtype`, except the names in `overrides`. A cast to the dtype a tensor already has is no
    copy. `consume` drops each tensor from `tensors` (a dict) once loaded, so a source the
    model no longer needs (a linear after quantization) is freed at once instead of with the
    whole checkpoint: the load's peak is then about the larger of the two, not their sum.
    """
    missing = [n for n in names if n not in tensors]
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ValueError(f"checkpoint lacks weights: {', '.join(missing[:8])}{more}")
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        current = getattr(owner, leaf)
        src = tensors[name]
        if tuple(src.shape) != tuple(current.shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(current.shape)}"
            )
        target = dtype if not isinstance(owner, Linear) else (linear_dtype or src.dtype)
        target = (overrides or {}).get(name, target)
        value = src.detach().to(device=device, dtype=target)
        setattr(owner, leaf, nn.Parameter(value.contiguous(), requires_grad=False))
        if consume:
            del src
            tensors.pop(name)  # type: ignore[attr-defined]
