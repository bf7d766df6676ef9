"""Attention over the paged KV cache: the per-step metadata and the CPU implementation.

The seam: a model layer calls `layer_cache.attend(q, k, v, meta, scale)` (see
`turbospark.engine.kv_cache.LayerCache`); the cache's `AttentionBackend` writes the step's new
keys/values into the paged cache and attends every sequence of the step over its context in one
call. `AttentionMetadata` is built once per step by the runner and describes the step the way the
paged GPU kernels take it (flash-attn's varlen + block-table API, FlashInfer's paged API): packed
queries with `query_start_loc`, per-sequence `seq_lens`, padded `block_tables`, and the flat
`slot_mapping` each new token's k/v goes to. It is an argument, never a global.

`CpuAttention` is the path that runs anywhere torch runs: one batched SDPA call over all decode
tokens of a step (their contexts gathered into a padded batch), and per sequence that feeds
several tokens (a prefill chunk) causal flash attention over its own keys merged with full
attention over its cached prefix (no quadratic mask; see `_span_attention`).
`reference_attention` is the plain per-sequence statement that tests hold every backend to.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from turbospark.engine import native, row_kernels
from turbospark.engine.cpu_kernels import native_kernels_for

log = logging.getLogger("turbospark.engine")


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention description, shared by every layer of one forward.

    Sequence i already has `seq_lens[i] - query_lens[i]` tokens cached and feeds `query_lens[i]`
    new tokens, packed in rows `query_start_loc[i] : query_start_loc[i + 1]` of q.
    """

    slot_mapping: torch.Tensor  # (num_tokens,) long: flat cache slot of each new token's k/v
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32: cu_seqlens of the packed queries
    seq_lens: torch.Tensor  # (num_seqs,) int32: context length of each sequence after this step
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, rows padded with 0
    last_token_indices: torch.Tensor  # (num_seqs,) long: row of each sequence's last new token
    block_size: int
    # host mirrors, so CPU paths and schedulers never read a device tensor back
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    block_tables_host: list[list[int]] = field(default_factory=list)
    # Contiguous slot range [start, stop) when the step writes one run of slots, so the cache
    # write is a slice copy instead of an index_copy.
    write_range: tuple[int, int] | None = None
    # Filled lazily by a backend for its own use, reused by every layer of the step.
    scratch: dict[str, object] = field(default_factory=dict)
    # each sequence's prompt length, where the runner knows it: a new token at a position past
    # it is a generated one (`row_kernels.decode_sequences`); None: a single new token is
    prompt_lens_host: list[int] | None = None

    def select(self, seqs: Sequence[int], sampled: Sequence[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """(metadata, positions) of a step of only the sequences `seqs` (in order), whose
        logits are those of `sampled` (a subset of seqs, in the same order)."""
        qlens, kv = self.query_lens_host, self.seq_lens_host
        meta, positions = build_attention_metadata(
            [self.block_tables_host[i] for i in seqs],
            [kv[i] - qlens[i] for i in seqs],
            [qlens[i] for i in seqs],
            self.block_size,
            self.slot_mapping.device,
        )
        if self.prompt_lens_host is not None:
            meta.prompt_lens_host = [self.prompt_lens_host[i] for i in seqs]
        local = {i: j for j, i in enumerate(seqs)}
        last = meta.last_token_indices
        meta.last_token_indices = last[[local[i] for i in sampled]] if len(sampled) != len(seqs) else last
        return meta, positions

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host)

    def context_slots(self, i: int) -> slice | torch.Tensor:
        """Flat cache slots of sequence i's whole context: a slice when its blocks are consecutive,
        else (kv_len,) int64 on the CPU (built per block, not per token: decode steps at tens of
        thousands of tokens ask for it every step)."""
        table, kv_len, bs = self.block_tables_host[i], self.seq_lens_host[i], self.block_size
        used = table[: (kv_len + bs - 1) // bs]
        if used[-1] - used[0] == len(used) - 1 and all(b == used[0] + k for k, b in enumerate(used)):
            return slice(used[0] * bs, used[0] * bs + kv_len)
        blocks = torch.tensor(used, dtype=torch.long)
        return (blocks[:, None] * bs + torch.arange(bs)).flatten()[:kv_len]


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
    starts = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    for table, cached, new in zip(block_tables, num_cached, num_new, strict=True):
        kv_len = cached + new
        assert new > 0 and kv_len <= len(table) * block_size, "block table too short for the step"
        slot_ids.extend(table[p // block_size] * block_size + p % block_size for p in range(cached, kv_len))
        positions.extend(range(cached, kv_len))
        starts.append(starts[-1] + new)
        seq_lens.append(kv_len)
        tables.append(list(table[: (kv_len + block_size - 1) // block_size]))
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    write_range = None
    if all(b == a + 1 for a, b in itertools.pairwise(slot_ids)):
        write_range = (slot_ids[0], slot_ids[-1] + 1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_ids, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        last_token_indices=torch.tensor(starts[1:], dtype=torch.long, device=device) - 1,
        block_size=block_size,
        query_lens_host=list(num_new),
        seq_lens_host=seq_lens,
        block_tables_host=tables,
        write_range=write_range,
    )
    return meta, torch.tensor(positions, dtype=torch.long, device=device)


class AttentionBackend(Protocol):
    """Writes a step's k/v into one layer's cache and attends over it.

    q: (num_tokens, num_heads, head_dim); k, v: (num_tokens, num_kv_heads, head_dim); the cache
    tensors are in the layout the backend's `KVCache` allocated. Returns (num_tokens, num_heads *
    head_dim).
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Stores the step's keys/values; caches are (num_kv_heads, num_slots, head_dim)."""
    if meta.write_range is not None:
        start, stop = meta.write_range
        k_cache[:, start:stop] = k.transpose(0, 1)
        v_cache[:, start:stop] = v.transpose(0, 1)
    else:
        k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def _gather(cache: torch.Tensor, slots: slice | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's slots (num_kv_heads, len, head_dim) in `dtype` (a view where it can be: a
    slice of a cache already in that dtype)."""
    if isinstance(slots, slice):
        return cache[:, slots].to(dtype)
    return cache.index_select(1, slots.to(cache.device)).to(dtype)


# Flash attention on CPU that also returns each row's log-sum-exp, so attention over two key
# sets can be merged exactly. Private to aten (inductor lowers SDPA to it); None if absent.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _span_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix: slice | torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of a multi-token span: causal over its own new keys, full over the cached prefix.

    q: (query_len, num_heads, head_dim); k, v: the span's own (query_len, num_kv_heads,
    head_dim); `prefix`: the cache slots of the tokens before it. Two flash-attention calls
    merged by log-sum-exp give exactly softmax over the union, with no (query_len, kv_len) mask
    (which sends SDPA to its slow math path: 3-4x slower at 2k-4k tokens, measured) and, when
    the prefix's blocks are consecutive, no copy of the cache.
    """
    assert _FLASH_CPU is not None
    qs = q.transpose(0, 1)[None]  # (1, num_heads, query_len, head_dim)
    # the keys and values as the cache holds them (rounded to its dtype), in q's dtype
    kn = k.to(k_cache.dtype).to(q.dtype).transpose(0, 1)[None]  # (1, num_kv_heads, query_len, head_dim)
    vn = v.to(v_cache.dtype).to(q.dtype).transpose(0, 1)[None]
    o_new, lse_new = _FLASH_CPU(qs, kn, vn, is_causal=True, scale=scale)
    is_empty = prefix.stop == prefix.start if isinstance(prefix, slice) else prefix.numel() == 0
    if is_empty:
        return o_new[0].transpose(0, 1)  # type: ignore[no-any-return]  # (query_len, num_heads, head_dim)
    kp, vp = (
        _gather(k_cache, prefix, q.dtype)[None],
        _gather(v_cache, prefix, q.dtype)[None],
    )  # (1, num_kv_heads, cached, head_dim)
    o_pre, lse_pre = _FLASH_CPU(qs, kp, vp, scale=scale)
    # softmax over both key sets = the two outputs weighted by their shares of the total mass
    weight = torch.sigmoid(lse_pre - lse_new)[..., None]  # (1, num_heads, query_len, 1) float32
    o: torch.Tensor = torch.lerp(o_new.float(), o_pre.float(), weight).to(q.dtype)
    return o[0].transpose(0, 1)


# spans of at most this many tokens after a cached prefix attend as decode rows (`_CpuPlan`)
SHORT_SPAN = 16


def _chunk_mask(cached: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """(query_len, kv_len) bool: bottom-right aligned causal, query i sits at position cached + i."""
    q_pos = torch.arange(cached, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos


def _native_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> native.Kernels | None:
    """The native decode-attention kernel where it takes this step: float32 queries on the CPU
    over a float32 or float16 cache."""
    if q.dtype != torch.float32 or k_cache.dtype not in native.KV_DTYPES or q.device.type != "cpu":
        return None
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    return native_kernels_for(q[:1])


class CpuAttention:
    """Decode tokens of a step in one batched SDPA call; multi-token spans one call each.

    A decode batch reads each sequence's context through a padded gather (one index_select per
    layer for all of them) with a key-padding mask; a single decoding sequence whose blocks are
    consecutive attends over a view of the cache, no copy.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta)
        num_tokens, num_heads, head_dim = q.shape
        role = row_kernels.role() if q.device.type == "cpu" else None
        if role == "prompt" and prompt_spans_invariant(q.dtype):
            return _prompt_spans(q, k_cache, v_cache, meta, scale).reshape(num_tokens, num_heads * head_dim)
        if role == "decode" or (role == "prompt" and max(meta.seq_lens_host) <= BY_ROW_MAX_CONTEXT):
            out = _attention_by_row(q, k_cache, v_cache, meta, scale)
            return out.reshape(num_tokens, num_heads * head_dim)
        # prompt rows on a CPU where the masked flash call is not chunk-invariant, past the
        # context where row-by-row attention stays cheap: the fast path, invariance given up
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        out = q.new_empty(num_tokens, num_heads, head_dim)
        plan = _plan(meta, q.device)
        if plan.decode_rows:
            qd = q[plan.decode_rows_t] if len(plan.decode_rows) != num_tokens else q
            od = self._decode(qd, k_cache, v_cache, plan, scale)  # (num_decodes, num_heads, head_dim)
            if len(plan.decode_rows) == num_tokens:
                out = od
            else:
                out[plan.decode_rows_t] = od
        for start, length, prefix, mask in plan.spans:
            rows = slice(start, start + length)
            if mask is None:
                out[rows] = _span_attention(q[rows], k[rows], v[rows], k_cache, v_cache, prefix, scale)
                continue
            # fallback (no CPU flash kernel): one SDPA over the whole context with an explicit mask
            ks, vs = (
                _gather(k_cache, prefix, q.dtype),
                _gather(v_cache, prefix, q.dtype),
            )  # (kv_heads, kv_len, hd)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), ks, vs, attn_mask=mask, scale=scale, enable_gqa=group > 1
            )  # (num_heads, query_len, head_dim)
            out[rows] = o.transpose(0, 1)
        return out.reshape(num_tokens, num_heads * head_dim)

    @staticmethod
    def _decode(
        qd: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _CpuPlan, scale: float
    ) -> torch.Tensor:
        """Attention of the step's decoding sequences, one query row each: (num_decodes, num_heads,
        head_dim) -> the same shape."""
        kernels = _native_decode(qd, k_cache, v_cache)
        if kernels is not None:  # one call over every sequence and head, reading the cache in place
            return kernels.decode_attention(qd, k_cache, v_cache, *plan.decode_slot_ids(), scale)
        num_heads, head_dim = qd.shape[1:]
        num_kv_heads = k_cache.shape[0]
        qd = qd.view(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # (decodes, kv heads, group, hd)
        if len(plan.decode_slots) == 1:  # one sequence: a view of the cache where its blocks are consecutive
            slots = plan.decode_slots[0]
            ks, vs = _gather(k_cache, slots, qd.dtype), _gather(v_cache, slots, qd.dtype)
            o = F.scaled_dot_product_attention(qd, ks[None], vs[None], scale=scale)
        else:
            gather, mask = plan.padded_decode_gather()
            num_decodes, max_len = plan.decode_shape
            shape = (num_kv_heads, num_decodes, max_len, head_dim)
            ks = k_cache.index_select(1, gather).view(shape).to(qd.dtype)
            vs = v_cache.index_select(1, gather).view(shape).to(qd.dtype)
            o = F.scaled_dot_product_attention(
                qd, ks.transpose(0, 1), vs.transpose(0, 1), attn_mask=mask, scale=scale
            )  # (num_decodes, num_kv_heads, group, head_dim)
        return o.reshape(-1, num_heads, head_dim)


# Prompt rows under row roles (`row_kernels`): each sequence's new rows attend over its whole
# context, read back from the cache, in one flash call with an explicit mask. The rows are
# padded to a multiple of PROMPT_ROW_MULTIPLE and the keys to a multiple of PROMPT_KEY_MULTIPLE
# (the CPU flash kernel's key block): every call then runs full-width blocks from key 0 and
# full-height GEMM tiles, so a row's sums do not depend on where its chunk started or ended. A
# key block past a row's position is all masked and leaves its sums exactly as they were.
# Measured with Qwen2.5-0.5B's heads on a 2-core Zen 4 EPYC: a 4,096-token prompt in 1,024-token
# chunks, 0.32 s a layer against 0.26 s for the (chunk-dependent) two-call span path.
PROMPT_ROW_MULTIPLE = 8
PROMPT_KEY_MULTIPLE = 512
# Where the probe fails, prompt rows attend row by row up to this context; beyond it each row
# would re-read its whole context (a long prompt then stalls: ~19k tokens did on a 2-core CPU)
# and the chunked flash path runs instead, not chunk-invariant (logged at start).
BY_ROW_MAX_CONTEXT = 2048


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _prompt_mask(first: int, rows: int, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """(padded rows, padded keys) additive mask of rows at positions first.. (rows padded to
    PROMPT_ROW_MULTIPLE with copies of the last, at its position) over num_keys real keys
    (padded to PROMPT_KEY_MULTIPLE)."""
    padded_rows, width = _round_up(rows, PROMPT_ROW_MULTIPLE), _round_up(num_keys, PROMPT_KEY_MULTIPLE)
    positions = torch.arange(first, first + padded_rows).clamp_(max=num_keys - 1)
    mask = torch.zeros(padded_rows, width, dtype=dtype)
    return mask.masked_fill_(torch.arange(width)[None, :] > positions[:, None], float("-inf"))


def _prompt_call(
    q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Rows q (rows, num_heads, head_dim) over keys ks, vs (num_kv_heads, padded keys,
    head_dim) under `_prompt_mask`'s mask."""
    assert _FLASH_CPU is not None
    rows, num_heads, head_dim = q.shape
    padded_rows = mask.shape[0]
    if padded_rows != rows:  # copies of the last row, at its position
        q = torch.cat([q, q[-1:].expand(padded_rows - rows, num_heads, head_dim)])
    o, _ = _FLASH_CPU(q.transpose(0, 1)[None], ks[None], vs[None], attn_mask=mask[None, None], scale=scale)
    return o[0].transpose(0, 1)[:rows]  # type: ignore[no-any-return]


def _slot_ids(slots: slice | torch.Tensor) -> torch.Tensor:
    """Context slots as int64 ids on the CPU."""
    return torch.arange(slots.start, slots.stop) if isinstance(slots, slice) else slots


def _prompt_spans(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Prompt-role rows of a step (their keys already written), one flash call per sequence;
    each sequence's padded slots and mask are built by the first layer and reused."""
    spans = meta.scratch.get("prompt_spans")
    if spans is None:
        spans = list[tuple[slice, torch.Tensor, torch.Tensor]]()
        start = 0
        for i, (qlen, kv_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
            ids = _slot_ids(meta.context_slots(i))
            ids = torch.cat([ids, ids[:1].expand(_round_up(kv_len, PROMPT_KEY_MULTIPLE) - kv_len)])  # masked
            spans.append(
                (slice(start, start + qlen), ids, _prompt_mask(kv_len - qlen, qlen, kv_len, q.dtype))
            )
            start += qlen
        meta.scratch["prompt_spans"] = spans
    assert isinstance(spans, list)
    out = q.new_empty(q.shape)
    for rows, ids, mask in spans:
        ks, vs = _gather(k_cache, ids, q.dtype), _gather(v_cache, ids, q.dtype)
        out[rows] = _prompt_call(q[rows], ks, vs, mask, scale)
    return out


@functools.cache
def prompt_spans_invariant(dtype: torch.dtype) -> bool:
    """Whether `_prompt_call` gives every row the same result however its prompt is cut into
    chunks, on this CPU and torch in `dtype` (probed once: a 700-token prompt cut at fixed and
    random places, with the grouped heads of Qwen2.5-0.5B). Where not, prompt rows attend one
    row at a time (`_attention_by_row`: invariant, much slower on long prompts)."""
    if _FLASH_CPU is None:
        return False
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, n = 14, 2, 64, 700
    q = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
    width = _round_up(n, PROMPT_KEY_MULTIPLE)
    k, v = (torch.randn(num_kv_heads, width, head_dim, generator=gen).to(dtype) for _ in range(2))

    def rows(a: int, b: int) -> torch.Tensor:
        w = _round_up(b, PROMPT_KEY_MULTIPLE)
        return _prompt_call(q[a:b], k[:, :w], v[:, :w], _prompt_mask(a, b - a, b, dtype), 0.125)

    try:
        whole = rows(0, n)
        cuts = [[0, 1, 2, 3, 9, 40, n], [0, 511, 512, 513, n]]
        picks = torch.randint(1, n, (3, 4), generator=gen).sort(dim=1).values.tolist()
        cuts += [[0, *sorted(set(p)), n] for p in picks]
        same = all(torch.equal(rows(a, b), whole[a:b]) for cut in cuts for a, b in itertools.pairwise(cut))
    except RuntimeError:  # this torch's kernel refuses the masked call
        same = False
    if not same:
        log.warning(
            "prompt attention in %s is not chunk-invariant on this CPU: a prompt past %d tokens "
            "may give other tokens when cut into other chunks or read from the prefix cache",
            dtype,
            BY_ROW_MAX_CONTEXT,
        )
    return same


def row_context_slots(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(for every query row of the step, the cache slots of its own context, positions 0 ..
    its own, concatenated; offsets (num_tokens + 1)) int64 on the CPU: each new token read
    as if it were the one decoding token of its sequence. Built once per step."""
    built = meta.scratch.get("row_slots")
    if built is None:
        parts: list[torch.Tensor] = []
        lengths: list[torch.Tensor] = []
        for i, (qlen, kv_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
            ids = _slot_ids(meta.context_slots(i))
            n = torch.arange(kv_len - qlen + 1, kv_len + 1)  # each row's context length
            first = torch.cumsum(n, 0) - n  # where each row's run starts in the flat list
            flat = torch.arange(int(n.sum())) - torch.repeat_interleave(first, n)
            parts.append(ids[flat])
            lengths.append(n)
        offsets = torch.zeros(sum(meta.query_lens_host) + 1, dtype=torch.long)
        torch.cumsum(torch.cat(lengths), 0, out=offsets[1:])
        built = (torch.cat(parts), offsets)
        meta.scratch["row_slots"] = built
    assert isinstance(built, tuple)
    return built


def _attention_by_row(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Every query row over its own context in one fixed order, whatever else the step holds and
    however its prompt was chunked (`row_kernels`): the native decode kernel with one row per
    "sequence" (its parts of 256 slots always start at slot 0), else one SDPA per row."""
    slot_ids, offsets = row_context_slots(meta)
    kernels = _native_decode(q, k_cache, v_cache)
    if kernels is not None:
        return kernels.decode_attention(q, k_cache, v_cache, slot_ids, offsets, scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    out = q.new_empty(num_tokens, num_heads, head_dim)
    bounds = offsets.tolist()
    for r in range(num_tokens):
        slots = slot_ids[bounds[r] : bounds[r + 1]].to(q.device)
        ks, vs = _gather(k_cache, slots, q.dtype), _gather(v_cache, slots, q.dtype)
        qr = q[r].view(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out[r] = F.scaled_dot_product_attention(qr, ks[None], vs[None], scale=scale).view(num_heads, head_dim)
    return out


def _plan(meta: AttentionMetadata, device: torch.device) -> _CpuPlan:
    """The step's plan, built by the first layer that asks."""
    plan = meta.scratch.get("cpu_plan")
    if plan is None:
        plan = _CpuPlan(meta, device)
        meta.scratch["cpu_plan"] = plan
    assert isinstance(plan, _CpuPlan)
    return plan


def decode_slot_ids(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot ids of every decoding sequence's context, concatenated; offsets (num_decodes + 1)),
    int64 on the CPU: what the native decode kernels read."""
    return _plan(meta, torch.device("cpu")).decode_slot_ids()


class _CpuPlan:
    """Index tensors for one step, built on the first layer and reused by the others."""

    def __init__(self, meta: AttentionMetadata, device: torch.device) -> None:
        self.device = device
        starts = [0]
        for n in meta.query_lens_host:
            starts.append(starts[-1] + n)
        self.decode_rows: list[int] = []
        self.decode_slots: list[slice | torch.Tensor] = []
        self.decode_lens: list[int] = []
        # (first row, query_len, the slots to read, mask): with the CPU flash kernel the slots are
        # the cached prefix and the mask is None; otherwise the whole context with its mask
        self.spans: list[tuple[int, int, slice | torch.Tensor, torch.Tensor | None]] = []
        for i, (qlen, kv_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
            slots = meta.context_slots(i)
            cached = kv_len - qlen
            if qlen == 1 or (cached > 0 and qlen <= SHORT_SPAN):
                # a short span after a cached prefix (a speculative verification) attends as that
                # many decode rows, each over the context up to itself (its keys were written
                # first): the decode kernel reads the cache in place, where the span path
                # converted the whole prefix per layer (6 rows after 1,600 tokens, Qwen2.5-0.5B
                # on a 2-core EPYC: 0.13 s a decode step against 1.3 s a span)
                for j in range(qlen):
                    n = cached + j + 1
                    self.decode_rows.append(starts[i] + j)
                    self.decode_slots.append(
                        slots[:n] if isinstance(slots, torch.Tensor) else slice(slots.start, slots.start + n)
                    )
                    self.decode_lens.append(n)
                continue
            mask = None
            if device.type != "cpu" or _FLASH_CPU is None:
                mask = _chunk_mask(cached, kv_len, device)  # the fallback attends over the whole context
            else:  # the cached prefix only
                slots = (
                    slots[:cached]
                    if isinstance(slots, torch.Tensor)
                    else slice(slots.start, slots.start + cached)
                )
            read = slots.to(device) if isinstance(slots, torch.Tensor) else slots
            self.spans.append((starts[i], qlen, read, mask))
        self.decode_rows_t = torch.tensor(self.decode_rows, dtype=torch.long, device=device)
        self.decode_shape = (len(self.decode_lens), max(self.decode_lens, default=0))
        # built by the first layer that asks, for the path it takes (native kernel or SDPA)
        self._slot_ids: tuple[torch.Tensor, torch.Tensor] | None = None
        self._padded: tuple[torch.Tensor, torch.Tensor] | None = None

    def padded_decode_gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For SDPA over two or more decoding sequences: (the slots to gather, each context
        padded to the longest with a real slot; the key mask (num_decodes, 1, 1, max_len))."""
        if self._padded is None:
            max_len = self.decode_shape[1]
            padded = []
            for ids, n in zip(self._slot_tensors(), self.decode_lens, strict=True):
                padded += [ids, ids[:1].expand(max_len - n)]  # padding reads a real slot, masked out
            gather = torch.cat(padded).to(self.device)
            lens = torch.tensor(self.decode_lens, device=self.device)
            # broadcast over kv heads and the group's query rows
            is_real = (
                torch.arange(max_len, device=self.device)[None, :] < lens[:, None]
            )  # (num_decodes, max_len)
            self._padded = (gather, is_real[:, None, None, :])
        return self._padded

    def _slot_tensors(self) -> list[torch.Tensor]:
        """Each decoding sequence's context slots as int64 on the CPU."""
        return [_slot_ids(s) for s in self.decode_slots]

    def decode_slot_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot ids of every decoding sequence's context, concatenated; offsets (num_decodes + 1)),
        int64, for the native decode kernel: built on the first layer that asks."""
        if self._slot_ids is None:
            parts = self._slot_tensors()
            offsets = [0]
            for p in parts:
                offsets.append(offsets[-1] + p.numel())
            self._slot_ids = (torch.cat(parts), torch.tensor(offsets, dtype=torch.long))
        return self._slot_ids


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The plain statement: each sequence on its own, explicit mask, repeated kv heads."""
    write_kv(k, v, k_cache, v_cache, meta)
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[0]
    out = q.new_empty(num_tokens, num_heads, head_dim)
    start = 0
    for i, (qlen, kv_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        slots = meta.context_slots(i)
        ks = _gather(k_cache, slots, q.dtype).repeat_interleave(group, dim=0)  # (num_heads, kv_len, head_dim)
        vs = _gather(v_cache, slots, q.dtype).repeat_interleave(group, dim=0)
        mask = _chunk_mask(kv_len - qlen, kv_len, q.device)
        qs = q[start : start + qlen].transpose(0, 1)  # (num_heads, query_len, head_dim)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[start : start + qlen] = o.transpose(0, 1)
        start += qlen
    return out.reshape(num_tokens, num_heads * head_dim)
