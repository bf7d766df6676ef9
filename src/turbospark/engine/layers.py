"""Building blocks shared by the model files: norms, rotary embeddings, linears, attention.

Every model forward is "packed": the new tokens of all sequences in one step are concatenated
along one flat token axis (`num_tokens`), and `AttentionMetadata` says which tokens belong to
which sequence, where their keys/values go in the paged KV cache and which cached slots each
sequence attends to. The metadata is built once per step by the runner and passed down as an
argument; nothing here keeps per-step state.

`paged_attention` is the plain SDPA reference path: it runs on any device torch runs on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class SequenceSpan:
    """One sequence's share of a step.

    `kv_slots` is either a `slice` of flat cache slots (the sequence's blocks happen to be
    contiguous, so attention reads a view) or a LongTensor (kv_len,) of slot ids to gather.
    `mask` is the (query_len, kv_len) bool mask for a chunk that does not start at the
    sequence's first token; None means "no mask" (one query token) or "plain causal" (the
    chunk is the whole context).
    """

    query_start: int
    query_len: int
    kv_len: int
    kv_slots: slice | torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention description, shared by every layer of one forward."""

    slot_mapping: torch.Tensor  # (num_tokens,) long: flat cache slot each new token's k/v goes to
    spans: list[SequenceSpan]
    last_token_indices: torch.Tensor  # (num_seqs,) long: row of each sequence's last new token
    # Contiguous slot range [start, stop) when a step writes one run of slots (batch 1), so the
    # cache write is a slice copy instead of an index_copy.
    write_range: tuple[int, int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.spans)


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    num_cached: Sequence[int],
    num_new: Sequence[int],
    block_size: int,
    device: torch.device,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions (num_tokens,) for a step.

    Sequence i already has `num_cached[i]` tokens in the cache (in the blocks of
    `block_tables[i]`) and feeds `num_new[i]` new tokens this step.
    """
    slot_ids: list[int] = []
    positions: list[int] = []
    spans: list[SequenceSpan] = []
    last_rows: list[int] = []
    query_start = 0
    for table, cached, new in zip(block_tables, num_cached, num_new, strict=True):
        kv_len = cached + new
        assert new > 0 and kv_len <= len(table) * block_size, "block table too short for the step"
        num_blocks_used = (kv_len + block_size - 1) // block_size
        used = table[:num_blocks_used]
        first = used[0]
        kv_slots: slice | torch.Tensor
        if all(b == first + k for k, b in enumerate(used)):
            kv_slots = slice(first * block_size, first * block_size + kv_len)
            slot_ids.extend(range(first * block_size + cached, first * block_size + kv_len))
        else:
            seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(kv_len)]
            kv_slots = torch.tensor(seq_slots, dtype=torch.long, device=device)
            slot_ids.extend(seq_slots[cached:])
        positions.extend(range(cached, kv_len))
        mask = None
        if new > 1 and cached > 0:
            # bottom-right aligned causal mask: query i sits at position cached + i
            q_pos = torch.arange(cached, kv_len, device=device)[:, None]
            k_pos = torch.arange(kv_len, device=device)[None, :]
            mask = k_pos <= q_pos  # (query_len, kv_len)
        spans.append(SequenceSpan(query_start, new, kv_len, kv_slots, mask))
        query_start += new
        last_rows.append(query_start - 1)
    write_range = None
    if slot_ids and slot_ids[-1] - slot_ids[0] == len(slot_ids) - 1 and len(block_tables) == 1:
        write_range = (slot_ids[0], slot_ids[-1] + 1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_ids, dtype=torch.long, device=device),
        spans=spans,
        last_token_indices=torch.tensor(last_rows, dtype=torch.long, device=device),
        write_range=write_range,
    )
    return meta, torch.tensor(positions, dtype=torch.long, device=device)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the fused kernel accumulates in float32 for bf16 inputs
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Embedding(nn.Module):
    """Token embedding table (vocab, hidden); `weight` is set by the loader."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Linear(nn.Module):
    """y = x @ weight.T + bias with a float weight (out_features, in_features).

    `turbospark.engine.quant` swaps these for int8 / int4 versions after loading.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (num_tokens, num_heads, head_dim) in the Hugging Face "rotate half" layout."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Writes the step's k/v into the cache, then attends each sequence over its cached context.

    q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim);
    k_cache, v_cache: (num_kv_heads, num_slots, head_dim). Returns (num_tokens, num_heads * head_dim).
    """
    if meta.write_range is not None:
        start, stop = meta.write_range
        k_cache[:, start:stop] = k.transpose(0, 1)
        v_cache[:, start:stop] = v.transpose(0, 1)
    else:
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    if meta.num_seqs == 1 and num_tokens == 1:
        return _decode_one(q, k_cache, v_cache, meta.spans[0], scale)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for span in meta.spans:
        if span.query_len == 1:
            out[span.query_start] = _decode_one(q[span.query_start], k_cache, v_cache, span, scale)[0].view(
                num_heads, head_dim
            )
            continue
        ks, vs = _context(k_cache, v_cache, span)  # (num_kv_heads, kv_len, head_dim)
        o = F.scaled_dot_product_attention(
            q[span.query_start : span.query_start + span.query_len].transpose(
                0, 1
            ),  # (num_heads, query_len, head_dim)
            ks,
            vs,
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )  # (num_heads, query_len, head_dim)
        out[span.query_start : span.query_start + span.query_len] = o.transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)


def _context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, span: SequenceSpan
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(span.kv_slots, slice):
        return k_cache[:, span.kv_slots], v_cache[:, span.kv_slots]
    return k_cache.index_select(1, span.kv_slots), v_cache.index_select(1, span.kv_slots)


def _decode_one(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, span: SequenceSpan, scale: float
) -> torch.Tensor:
    """One query token. The query heads sharing a kv head are laid out as that head's "query
    rows" (no mask needed: they are all the same position), which lets SDPA's fused CPU kernel
    run GQA without repeating k/v; measured several times faster than bmm + softmax + bmm."""
    ks, vs = _context(k_cache, v_cache, span)  # (num_kv_heads, kv_len, head_dim)
    num_kv_heads, _, head_dim = ks.shape
    qg = q.reshape(1, num_kv_heads, -1, head_dim)  # (1, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(
        qg, ks[None], vs[None], scale=scale
    )  # (1, num_kv_heads, group, head_dim)
    return o.view(1, -1)  # (1, num_heads * head_dim)


def load_weights(
    module: nn.Module,
    names: Sequence[str],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    linear_dtype: torch.dtype | None,
) -> None:
    """Sets each named parameter from the checkpoint tensor of the identical name.

    Every name must be present with the model's shape; other checkpoint names (rotary caches,
    a vision tower, a tied lm_head) are ignored. Parameters of `Linear` modules are cast to
    `linear_dtype` (None: kept as the checkpoint has them, for a quantizer to read), the rest
    to `dtype`. A cast to the dtype a tensor already has is no copy.
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
        value = src.detach().to(device=device, dtype=target)
        setattr(owner, leaf, nn.Parameter(value.contiguous(), requires_grad=False))
