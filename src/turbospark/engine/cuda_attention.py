"""`CudaAttention`: the attention backend for CUDA devices, Triton kernels behind the seam.

It reads and writes the same cache layout as `CpuAttention` ((num_kv_heads, num_slots, head_dim)
per layer: one key head's tokens of one page are one contiguous run), so `KVCache` needs no
CUDA-specific allocation: build it with `attention=CudaAttention()`.

One `forward` is two or three launches for a whole step, whatever its mix of prefill chunks and
decodes: `store_kv_kernel` writes the step's keys/values to their slots, `paged_attention_kernel`
attends every query over its sequence's pages, and for decode steps at small batch (where one
program per (sequence, kv head) would leave most of the GPU idle) the context is split across
programs and `combine_splits_kernel` merges the partial softmaxes. Only the device tensors of
`AttentionMetadata` and the shapes of the inputs are read (never its host lists, never
`.item()`), so a decode step can be captured in a CUDA graph; every launch configuration is a
function of (num_tokens, num_seqs, heads, head_dim) alone.

Why a kernel of our own: see `turbospark.engine.triton_kernels`. Tests hold it to
`turbospark.engine.attention.reference_attention`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from turbospark.engine.attention import AttentionMetadata

LOG2_E = 1.4426950408889634


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class CudaAttention:
    """`AttentionBackend` over Triton kernels. `max_splits` bounds the context split of small
    decode batches (1 turns it off)."""

    def __init__(self, *, max_splits: int = 16) -> None:
        from turbospark.engine import triton_kernels  # Triton is present wherever CUDA torch is

        self._kernels: Any = triton_kernels
        self.max_splits = max_splits
        self._num_sms: dict[int, int] = {}

    def num_splits(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        """Context splits for a decode step of `num_seqs`: enough programs to fill the SMs."""
        if device.type != "cuda":  # Triton's interpreter (tests on CPU): a small pretend GPU
            num_sms = 8
        else:
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index not in self._num_sms:
                self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
            num_sms = self._num_sms[index]
        # rounded to a power of two like the captured batch sizes, so a padded graph replay and
        # an eager step of the same sequences split alike
        programs = _next_pow2(num_seqs) * num_kv_heads
        return min(self.max_splits, _next_pow2(math.ceil(num_sms / programs)))

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Writes token t's k/v (num_tokens, num_kv_heads, head_dim) to slot `meta.slot_mapping[t]`."""
        num_tokens, num_kv_heads, head_dim = k.shape
        assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
        assert k_cache.stride() == v_cache.stride()
        if num_tokens == 0:
            return
        self._kernels.store_kv_kernel[(num_tokens, num_kv_heads)](
            k,
            v,
            k_cache,
            v_cache,
            meta.slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=_next_pow2(head_dim),
            num_warps=1,
        )

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
        self.store_kv(k, v, k_cache, v_cache, meta)
        return self.attend(q, k_cache, v_cache, meta, scale)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """`forward` without the store: the step's keys/values are already in their slots."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[0]
        num_seqs = meta.seq_lens.shape[0]
        group = num_heads // num_kv_heads
        assert q.stride(-1) == 1 and group * num_kv_heads == num_heads
        out = q.new_empty(num_tokens, num_heads, head_dim)
        if num_tokens == 0:
            return out.view(0, num_heads * head_dim)
        block_d = _next_pow2(head_dim)
        # every sequence feeds at least one token, so num_tokens == num_seqs means all decodes
        is_decode = num_tokens == num_seqs
        if is_decode:
            block_m = max(16, _next_pow2(group))
            block_q = 1
            num_splits = self.num_splits(num_seqs, num_kv_heads, q.device)
            grid0 = num_seqs
            num_warps = 4
        else:
            block_m = max(64 if block_d > 128 else 128, _next_pow2(group))
            block_q = block_m // group
            num_splits = 1
            grid0 = num_tokens // block_q + num_seqs
            num_warps = 8 if block_m * block_d >= 128 * 128 else 4
        block_n = 64 if block_d <= 128 else 32
        if num_splits > 1:
            part_acc = torch.empty(
                num_splits, num_tokens, num_heads, block_d, device=q.device, dtype=torch.float32
            )
            part_ml = torch.empty(2, num_splits, num_tokens, num_heads, device=q.device, dtype=torch.float32)
        else:
            part_acc = part_ml = out  # unused by the kernel
        self._kernels.paged_attention_kernel[(grid0, num_kv_heads, num_splits)](
            q,
            k_cache,
            v_cache,
            out,
            part_acc,
            part_ml,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale * LOG2_E,
            num_seqs,
            num_tokens,
            num_heads,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            out.stride(0),
            out.stride(1),
            meta.block_tables.stride(0),
            0 if is_decode else max(num_seqs - 1, 0).bit_length(),
            PAGE_SIZE=meta.block_size,
            GROUP=group,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            IS_DECODE=is_decode,
            num_warps=num_warps,
            num_stages=2,
        )
        if num_splits > 1:
            self._kernels.combine_splits_kernel[(num_tokens, num_heads)](
                part_acc,
                part_ml,
                out,
                num_tokens,
                num_heads,
                out.stride(0),
                out.stride(1),
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                NUM_SPLITS=num_splits,
                num_warps=1,
            )
        return out.view(num_tokens, num_heads * head_dim)
