"""Triton kernels for the CUDA attention backend (`turbospark.engine.cuda_attention`).

Written here rather than taken from a library: no flash-attn wheel is published for the
PyTorch/CUDA builds the engine targets (its PyPI release is a source build of an hour), and
FlashInfer compiles its paged kernels with nvcc at first use on each machine. These kernels read
the engine's own cache layout, (num_kv_heads, num_slots, head_dim) per layer, through strides,
so the CPU and CUDA paths share one `KVCache`.

Import only where Triton is installed (CUDA builds of PyTorch ship it); the kernel arguments
follow Triton's conventions (pointers and strides), so the module is left untyped.

`paged_attention_kernel` is one kernel for a whole step (prefill chunks and decodes mixed):

- Program (i, h, s) takes block i of the step's query blocks, kv head h, and split s of that
  block's context. Query blocks are BLOCK_Q consecutive tokens of one sequence; the grid's first
  axis is an upper bound from shapes alone (num_tokens // BLOCK_Q + num_seqs), and each program
  finds its sequence by binary search over `query_start_loc`, so no host-side list is needed
  and a decode step can be captured in a CUDA graph.
- All `GROUP` query heads that share kv head h are rows of one (BLOCK_M, head_dim) tile, so each
  key/value tile is read once per kv head (GQA).
- Keys are read page by page through the block table; the causal mask is bottom-right aligned
  (query j of a sequence with L tokens after the step and q new ones sits at L - q + j).
- With NUM_SPLITS > 1 (decodes at small batch, "flash-decoding") each split writes its
  unnormalized output, row max and row sum; `combine_splits_kernel` merges them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_cs,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (t, h): token t's key and value of kv head h go to slot `slot_mapping[t]`
    (skipped when negative: padding rows of a captured batch)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dmask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dmask)
    dst = h * stride_ch + slot * stride_cs + d
    tl.store(k_cache_ptr + dst, k, mask=dmask)
    tl.store(v_cache_ptr + dst, v, mask=dmask)


# the step's counts are plain arguments, not specialized: a new batch composition of an eager
# step must not compile a new variant (a second of stall in a serving step)
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "log2_seqs"])
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale_log2,
    num_seqs,
    num_tokens,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ch,
    stride_cs,
    stride_ot,
    stride_oh,
    stride_bt,
    log2_seqs,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IS_DECODE: tl.constexpr,
):
    qb = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if IS_DECODE:  # one new token per sequence: program qb is sequence qb, no search
        seq = qb
        q_start = qb
        q_len = 1
        local_block = 0
    else:
        # the sequence whose query blocks cover qb: largest s with start[s] // BLOCK_Q + s <= qb
        lo = qb * 0
        hi = qb * 0 + num_seqs  # invariant: the answer lies in [lo, hi)
        for _ in range(log2_seqs):
            mid = (lo + hi) // 2
            mid_start = tl.load(query_start_ptr + mid)
            go_right = mid_start // BLOCK_Q + mid <= qb
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        seq = lo
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        local_block = qb - (q_start // BLOCK_Q + seq)
        if local_block * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_in_seq = local_block * BLOCK_Q + offs_m // GROUP  # query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_in_seq < q_len)
    token = (q_start + q_in_seq).to(tl.int64)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = context + q_in_seq  # absolute position of each row's query

    # keys this block may see, and this split's share of them, in whole tiles
    kv_end = tl.minimum(seq_len, context + (local_block + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    cache_head = kv_head.to(tl.int64) * stride_ch
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * BLOCK_N + offs_n
        kv_ok = kv_pos < kv_end
        page = tl.load(table + kv_pos // PAGE_SIZE, mask=kv_ok, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + kv_pos % PAGE_SIZE
        k = tl.load(
            k_cache_ptr + cache_head + slot[None, :] * stride_cs + offs_d[:, None],
            mask=kv_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, k) * scale_log2  # (BLOCK_M, BLOCK_N), log2 domain
        visible = kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that sees nothing yet
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr + cache_head + slot[:, None] * stride_cs + offs_d[None, :],
            mask=kv_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # partials: acc (NUM_SPLITS, num_tokens, num_heads, BLOCK_D), ml (2, NUM_SPLITS, tokens, heads)
        row = (split * num_tokens + token) * num_heads + head
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + row, m_i, mask=row_ok)
        tl.store(part_ml_ptr + NUM_SPLITS * num_tokens * num_heads + row, l_i, mask=row_ok)


@triton.jit
def combine_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    num_tokens,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Program (t, h): merges the splits' partial softmax sums of one query row."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    row = (splits * num_tokens + t) * num_heads + h  # (NUM_SPLITS,)
    m = tl.load(part_ml_ptr + row)
    l_part = tl.load(part_ml_ptr + NUM_SPLITS * num_tokens * num_heads + row)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.where(l_part > 0, tl.exp2(m - m_max), 0.0)  # a split that saw no key weighs nothing
    acc = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :])  # (NUM_SPLITS, BLOCK_D)
    total = tl.sum(w * l_part, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# ---- small fused ops of the model's layers (see `turbospark.engine.cuda_ops`) ----


@triton.jit
def rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Row t: s = x (+ residual, rounded to the input dtype and stored), out = rms_norm(s) * w."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + t * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    # rounded where the reference implementation rounds: the normalized row, then the product
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
):
    """Program (t, h): head h of token t rotated, "rotate half" layout, sign folded into sin:
    out = x * cos + roll(x, half) * sin."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    x_row = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(x_row + d).to(tl.float32)
    x2 = tl.load(x_row + HALF + d).to(tl.float32)
    c_row = t * stride_ct
    c1 = tl.load(cos_ptr + c_row + d).to(tl.float32)
    c2 = tl.load(cos_ptr + c_row + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + c_row + d).to(tl.float32)
    s2 = tl.load(sin_ptr + c_row + HALF + d).to(tl.float32)
    o_row = out_ptr + t * stride_ot + h * stride_oh
    dt = out_ptr.dtype.element_ty
    # each product rounded to the activation dtype, then the sum: as x * cos + rotate_half(x) * sin
    o1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(o_row + d, o1.to(dt))
    tl.store(o_row + HALF + d, o2.to(dt))


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, b): out[t, cols] = silu(gate) * up, gate and up the two halves of row t."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    g = tl.load(gu_ptr + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_g + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # silu(gate) rounded, as its own op would
    tl.store(out_ptr + t * stride_o + cols, (act * u).to(dt), mask=mask)


# ---- small-batch matmuls (GEMV): decode steps of 1..4 rows (see `cuda_ops.gemv`) ----
#
# At M = 1 a linear reads every weight once and does two flops per weight: memory-bound, and on
# a small model each matmul is only a few microseconds, so what decides the time is how many
# bytes each SM has in flight and how many launches a layer takes. Program p reduces BLOCK_N
# weight rows over the whole K axis, BLOCK_K columns at a time (no split over K: a row's sum has
# one fixed order, so a row's result does not depend on the other rows of the batch).
# Products and sums are float32; the output is rounded once, like a library matmul's.
#
# The two matmuls that follow an RMSNorm (q/k/v and gate/up) can take the norm's input instead
# of its output (NORM): every program then computes the residual add and the norm of the row
# itself (the row is one BLOCK_K tile: hidden sizes up to BLOCK_K), rounding where
# `rms_norm_kernel` rounds, and program 0 stores the summed residual. That is two launches
# fewer per layer for a re-read of the (L2-resident) input row by each program.


@triton.jit
def _rows_dot(
    x_rows, w_rows, m_ok, n_ok, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """(BLOCK_M, BLOCK_N) float32: x rows (pointers (BLOCK_M, 1)) dotted with w rows ((BLOCK_N, 1))."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def _normed_row(
    x_ptr,
    res_ptr,
    res_out_ptr,
    norm_ptr,
    eps,
    offs_m,
    m_ok,
    K,
    stride_xm,
    stride_rm,
    stride_rom,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """rms_norm(x [+ residual]) * weight of BLOCK_M rows of length K <= BLOCK_K, float32 values
    rounded as `rms_norm_kernel` rounds them; program 0 stores x + residual."""
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    mask = m_ok[:, None] & k_ok[None, :]
    h = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    dt = h.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dt)
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        tl.store(res_out_ptr + offs_m[:, None] * stride_rom + offs_k[None, :], h, mask=mask & first)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=1) / K + eps)
    normed = (hf * inv[:, None]).to(dt).to(tl.float32)
    w = tl.load(norm_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    return (normed * w[None, :]).to(dt).to(tl.float32)


@triton.jit
def _pair_dot(
    x_ptr,
    res_ptr,
    res_out_ptr,
    norm_ptr,
    eps,
    wa_rows,
    wb_rows,
    M,
    K,
    stride_xm,
    stride_rm,
    stride_rom,
    n_ok,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Two (BLOCK_M, BLOCK_N) float32 results: x (or, with NORM, the normed x + residual) dotted
    with two sets of weight rows, both tiles in flight per step."""
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if NORM:  # the row is one tile (K <= BLOCK_K)
        k_ok = offs_k < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        a = tl.load(wa_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
        b = tl.load(wb_rows + offs_k[None, :], mask=w_mask, other=0.0).to(tl.float32)
        x = _normed_row(
            x_ptr, res_ptr, res_out_ptr, norm_ptr, eps, offs_m, m_ok, K, stride_xm, stride_rm, stride_rom,
            HAS_RESIDUAL, BLOCK_K,
        )  # fmt: skip
        acc_a += tl.sum(x[:, None, :] * a[None, :, :], axis=2)
        acc_b += tl.sum(x[:, None, :] * b[None, :, :], axis=2)
    else:
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            w_mask = n_ok[:, None] & k_ok[None, :]
            a = tl.load(wa_rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32)
            b = tl.load(wb_rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc_a += tl.sum(x[:, None, :] * a[None, :, :], axis=2)
            acc_b += tl.sum(x[:, None, :] * b[None, :, :], axis=2)
    return acc_a, acc_b


@triton.jit
def gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out (M, N) = x (M, K) @ w (N, K).T [+ b]; program p: output columns p * BLOCK_N + ..."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = _rows_dot(
        x_ptr + offs_m[:, None] * stride_xm,
        w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn,
        m_ok,
        n_ok,
        K,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def gate_up_silu_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    norm_ptr,
    eps,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    INTER,
    K,
    stride_xm,
    stride_rm,
    stride_rom,
    stride_wn,
    stride_om,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The gated MLP's first half in one launch: w (2 * INTER, K) is gate rows then up rows;
    out (M, INTER) = silu(x @ gate.T) * (x @ up.T), rounded where the unfused ops round (each
    projection's output, silu's output, the product). With NORM, x is the norm's input (see
    above)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < INTER
    m_ok = offs_m < M
    gate_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    g, u = _pair_dot(
        x_ptr, res_ptr, res_out_ptr, norm_ptr, eps, gate_rows, gate_rows + INTER * stride_wn, M, K,
        stride_xm, stride_rm, stride_rom, n_ok, NORM, HAS_RESIDUAL, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        g += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        u += tl.load(b_ptr + INTER + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dt = out_ptr.dtype.element_ty
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        (act * u).to(dt),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def qkv_rotary_kernel(
    x_ptr,
    res_ptr,
    res_out_ptr,
    norm_ptr,
    eps,
    w_ptr,
    b_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    M,
    K,
    stride_xm,
    stride_rm,
    stride_rom,
    stride_wn,
    stride_ct,
    stride_om,
    stride_ch,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    ROTATED_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STORE_KV: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The fused q/k/v projection with rotary on q and k, one launch: out (M, heads * HEAD_DIM)
    in the projection's own layout, heads below ROTATED_HEADS (q's and k's) rotated in the
    "rotate half" layout with sin's sign folded in, as `rotary_kernel` does. With NORM, x is the
    norm's input (see above). With STORE_KV, the k and v heads (from NUM_HEADS on) also go to
    the cache at `slot_mapping[row]` (skipped when negative), as `store_kv_kernel` writes them.

    Program (h, c): head h, pairs (d, d + HALF) for d in c * BLOCK_P + [0, BLOCK_P): both rows
    of a pair are reduced by the same program, so the rotation needs no second pass.
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    d_ok = d < HALF
    row1 = h * HEAD_DIM + d
    row2 = row1 + HALF
    x1, x2 = _pair_dot(
        x_ptr, res_ptr, res_out_ptr, norm_ptr, eps,
        w_ptr + row1.to(tl.int64)[:, None] * stride_wn, w_ptr + row2.to(tl.int64)[:, None] * stride_wn,
        M, K, stride_xm, stride_rm, stride_rom, d_ok, NORM, HAS_RESIDUAL, BLOCK_M, BLOCK_P, BLOCK_K,
    )  # fmt: skip
    if HAS_BIAS:
        x1 += tl.load(b_ptr + row1, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x2 += tl.load(b_ptr + row2, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    dt = out_ptr.dtype.element_ty
    x1 = x1.to(dt).to(tl.float32)  # the projection's output, rounded
    x2 = x2.to(dt).to(tl.float32)
    mask = m_ok[:, None] & d_ok[None, :]
    if h < ROTATED_HEADS:
        c_rows = offs_m[:, None] * stride_ct
        c1 = tl.load(cos_ptr + c_rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_rows + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + c_rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + c_rows + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
        o1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    else:
        o1 = x1
        o2 = x2
    o_rows = out_ptr + offs_m[:, None] * stride_om
    tl.store(o_rows + row1[None, :], o1.to(dt), mask=mask)
    tl.store(o_rows + row2[None, :], o2.to(dt), mask=mask)
    if STORE_KV:  # noqa: SIM102 (a compile-time branch around a runtime one)
        if h >= NUM_HEADS:
            slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)
            ok = mask & (slot >= 0)[:, None]
            if h < ROTATED_HEADS:
                dst = k_cache_ptr + (h - NUM_HEADS).to(tl.int64) * stride_ch
            else:
                dst = v_cache_ptr + (h - ROTATED_HEADS).to(tl.int64) * stride_ch
            dst_rows = dst + slot[:, None] * stride_cs
            tl.store(dst_rows + d[None, :], o1.to(dt), mask=ok)
            tl.store(dst_rows + HALF + d[None, :], o2.to(dt), mask=ok)


# ---- sampling (see `cuda_ops.sample_rows`) ----


@triton.jit
def gumbel_argmax_kernel(logits_ptr, inv_temp_ptr, seed_ptr, out_ptr, vocab, stride_row, BLOCK: tl.constexpr):
    """Program r: argmax over the vocabulary of logits * inv_temp - log(-log(u)), u uniform from
    Philox keyed by row r's own seed: a draw from softmax(logits * inv_temp) (the Gumbel-max form
    of the exponential race the CPU sampler runs). -inf logits never win."""
    r = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + r)
    inv_temp = tl.load(inv_temp_ptr + r)
    row = logits_ptr + r * stride_row
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        ok = cols < vocab
        x = tl.load(row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, cols)
        u = tl.maximum(u, 1e-20)  # -log(u) stays finite
        score = x * inv_temp - tl.log(-tl.log(u))
        score = tl.where(ok, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    winner = tl.argmax(best, axis=0)
    pick = tl.sum(tl.where(offs == winner, best_idx, 0), axis=0)
    tl.store(out_ptr + r, pick)


@triton.jit
def truncated_sample_kernel(
    values_ptr, ids_ptr, params_ptr, out_ptr, width, stride_v, stride_i, BLOCK: tl.constexpr
):
    """Program r: row r's `width` largest raw logits (sorted, descending: `torch.topk`'s values
    and ids) through the filters of `sampling.truncate_rows`, then `gumbel_argmax_kernel`'s draw
    over them. params row r (float64): temperature, top-k, min-p, top-p, seed. In order:
    scale by the temperature, cut past the row's top-k, cut probabilities below min-p times
    the largest, cut a token once the mass before it reaches top-p (the first always stays);
    the filtered values go back into `values` (-inf where cut). The noise of position j is
    Philox(seed, j), as `gumbel_argmax_kernel` draws it over the same candidates, so a seed
    picks the same candidate as that kernel would; out[r] is the candidate's token id."""
    r = tl.program_id(0).to(tl.int64)
    p = params_ptr + r * 5
    temperature = tl.load(p).to(tl.float32)
    k = tl.load(p + 1).to(tl.int32)
    min_p = tl.load(p + 2).to(tl.float32)
    top_p = tl.load(p + 3).to(tl.float32)
    seed = tl.load(p + 4).to(tl.int64)
    top_p = tl.where(top_p < 1.0, top_p, float("inf"))  # no top-p: nothing cut, whatever the rounding
    offs = tl.arange(0, BLOCK)
    row = values_ptr + r * stride_v
    x = tl.load(row + offs, mask=offs < width, other=float("-inf")).to(tl.float32)
    # the division rounded to nearest, as torch rounds it
    v = tl.where(offs < k, tl.math.div_rn(x, temperature), float("-inf"))
    # min-p: softmax, then what falls below min_p times the first (the largest)
    top = tl.max(v, axis=0)
    e = tl.exp(v - top)
    probs = e / tl.sum(e, axis=0)
    first = tl.max(tl.where(offs == 0, probs, 0.0), axis=0)
    v = tl.where(probs < min_p * first, float("-inf"), v)
    # top-p over what is left, in the sorted order
    e = tl.exp(v - top)
    probs = e / tl.sum(e, axis=0)
    before = tl.cumsum(probs, axis=0) - probs
    v = tl.where((before >= top_p) & (offs > 0), float("-inf"), v)
    tl.store(row + offs, v, mask=offs < width)
    u = tl.rand(seed, offs)
    u = tl.maximum(u, 1e-20)
    score = v - tl.log(-tl.log(u))
    score = tl.where(offs < width, score, float("-inf"))
    winner = tl.argmax(score, axis=0)
    token = tl.load(ids_ptr + r * stride_i + winner)
    tl.store(out_ptr + r, token)
