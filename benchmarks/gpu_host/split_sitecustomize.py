"""Loaded as `sitecustomize` (prepare.sh copies it so): aims the CUDA decode attention's context
split at `TS_SPLIT_FACTOR` programs per SM instead of `CudaAttention.num_splits`' one, for a
serving A/B of the heuristic without editing the tree under test."""

from __future__ import annotations

import math
import os

import torch

from turbospark.engine import cuda_attention

FACTOR = int(os.environ.get("TS_SPLIT_FACTOR", "4"))
_heuristic = cuda_attention.CudaAttention.num_splits


def num_splits(
    self: cuda_attention.CudaAttention, num_seqs: int, num_kv_heads: int, device: torch.device
) -> int:
    base = _heuristic(self, num_seqs, num_kv_heads, device)  # fills the SM count cache
    if device.type != "cuda":
        return base
    sms = self._num_sms.get(device.index if device.index is not None else torch.cuda.current_device(), 132)
    programs = cuda_attention._next_pow2(num_seqs) * num_kv_heads
    return min(self.max_splits, cuda_attention._next_pow2(math.ceil(FACTOR * sms / programs)))


cuda_attention.CudaAttention.num_splits = num_splits  # type: ignore[method-assign]
