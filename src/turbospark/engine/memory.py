"""What a loaded model holds in memory, and handing a load's freed memory back to the OS: used by
rank 0's load (`backend`) and by every tensor-parallel worker's (`parallel`) alike."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc

import torch

from turbospark.engine.layers import RMSNorm
from turbospark.engine.quant import Int4Linear, Int8Linear


def weight_stats(model: torch.nn.Module, *, replicated: bool = True) -> tuple[int, int, set[str]]:
    """(parameters, bytes, quantized kinds) of a model's weights as held in memory; without
    `replicated`, less the norms every tensor-parallel rank holds whole (rank 0 counts them)."""
    params = {id(p): p for p in model.parameters()}  # tied weights once
    if not replicated:
        for m in model.modules():
            if isinstance(m, RMSNorm):
                params.pop(id(m.weight), None)
    count = sum(p.numel() for p in params.values())
    size = sum(p.numel() * p.element_size() for p in params.values())
    kinds = set()
    for m in model.modules():
        if isinstance(m, Int8Linear | Int4Linear):
            kinds.add("int4" if isinstance(m, Int4Linear) else "int8")
            count += m.in_features * m.out_features
            size += sum(b.numel() * b.element_size() for b in m.buffers())
            for packed in (getattr(m, "q4", None), getattr(m, "q8", None)):  # the native layouts
                if packed is not None:
                    tensors = [getattr(packed, f.name) for f in dataclasses.fields(packed)]
                    size += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return count, size, kinds


def release_freed_memory() -> None:
    """Hands the loader's freed buffers back to the OS.

    glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold in the heap, so
    after loading, resident memory stays at the checkpoint's size until trimmed: on SmolLM2,
    843 MB before and 399 MB after.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def fix_mmap_threshold() -> None:
    """Pins glibc's mmap threshold at 256 KiB: every weight-sized buffer then gets its own
    mapping, given back the moment it is freed. With glibc's adaptive threshold (which rises to
    32 MiB after the first large free) the checkpoint's freed tensors stay in the heap while the
    quantized model is built, so the load's peak is their sum, and how high depends on timing:
    SmolLM2's serving peak measured 910-1,040 MB over runs with a 4 MiB threshold, 835-837 MB
    with 256 KiB (the bound its test holds is 1 GB)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 256 * 2**10)
