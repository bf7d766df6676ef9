"""A CPU model's weights moved into one mapping of transparent huge pages.

A decode step reads every weight once. Loaded tensor by tensor, SmolLM2's int4 model lies in
~700 allocations of 4 KiB pages (the int4 codes, scales and offsets of each projection are under
1 MiB each, too small for the kernel to back with 2 MiB pages on its own): ~40,000 pages per
step, far past what the TLB holds, so the GEMV kernels walk page tables as they stream. Packed
into one 2 MiB-aligned anonymous mapping advised `MADV_HUGEPAGE` before it is touched, the same
bytes take ~80 pages. Measured (AMD EPYC Zen 4 class, 2 threads, two models in one process
decoding 128 tokens in alternation): SmolLM2 int4 137.2 against 132.4 tokens/s, Qwen2.5-0.5B
int8 51.0 against 49.2 (benchmarks/RESULTS.md).

Each tensor keeps its identity: `Tensor.set_` points it at its slice of the mapping, so every
holder (module attributes, the native decoder's descriptions, `Q4Weight`s) sees the move, and
the old storage is freed as the next is copied (the peak grows by one tensor, not a model).
Tensors that are views into a larger storage keep it, as do opaque packed weights (fbgemm's).

Off where the system has no transparent huge pages (not Linux, or `enabled` is `never`), and
with the `hugepages` setting off (`--no-hugepages`, `TURBOSPARK_HUGEPAGES=0`: `kernel_settings`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
from pathlib import Path

import torch
from torch import nn

from turbospark.engine import kernel_settings

log = logging.getLogger("turbospark.engine")

ENV_VAR = kernel_settings.ENV_VARS["hugepages"]
HUGE_PAGE = 2 << 20
TRIM_EVERY = 16 << 20
ALIGN = 64  # each tensor starts on a cache line: the kernels' loads are aligned as before
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether packing can get huge pages here (and is not switched off)."""
    if not kernel_settings.current().hugepages:
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every distinct tensor object the model's modules hold: parameters, buffers, plain tensor
    attributes and the tensors of dataclass attributes (`native.Q4Weight`)."""
    found: dict[int, torch.Tensor] = {}

    def visit(value: object) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)

    for module in model.modules():
        for value in [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]:
            visit(value)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                for f in dataclasses.fields(value):
                    visit(getattr(value, f.name))
    return list(found.values())


def _movable(t: torch.Tensor) -> bool:
    """A CPU tensor that is the whole of its storage, in order (so the move keeps its layout)."""
    nbytes = t.numel() * t.element_size()
    return (
        t.device.type == "cpu"
        and not t.is_meta
        and nbytes > 0
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == nbytes
    )


def pack_weights(model: nn.Module) -> int:
    """Moves the model's CPU weights into one huge-page mapping; returns the bytes moved (0 when
    huge pages are not available). The mapping lives as long as the model."""
    if not available():
        return 0
    # tensors sharing one storage (a tied weight held twice) move together, copied once
    groups: dict[int, list[torch.Tensor]] = {}
    for t in _tensors(model):
        if _movable(t):
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    if not groups:
        return 0
    sizes = {ptr: -(-ts[0].untyped_storage().nbytes() // ALIGN) * ALIGN for ptr, ts in groups.items()}
    total = sum(sizes.values())
    length = -(-total // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a huge page
    area = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults take 2 MiB pages
    except OSError as exc:
        log.debug("madvise(MADV_HUGEPAGE) refused (%s): weights stay where they are", exc)
        area.close()
        return 0
    arena = torch.frombuffer(area, dtype=torch.uint8)
    offset = (-arena.data_ptr()) % HUGE_PAGE
    # largest first: the big matrices start on huge-page boundaries
    untrimmed = 0
    with torch.no_grad():
        for ptr in sorted(groups, key=lambda p: -sizes[p]):
            tensors = groups[ptr]
            nbytes = tensors[0].untyped_storage().nbytes()
            slot = arena[offset : offset + nbytes]
            slot.copy_(tensors[0].reshape(-1).view(torch.uint8))
            for t in tensors:
                t.set_(slot.untyped_storage(), offset // t.element_size(), t.shape, t.stride())
            del tensors, slot
            offset += sizes[ptr]
            untrimmed += sizes[ptr]
            if untrimmed >= TRIM_EVERY:
                # storages under glibc's mmap threshold go back to its heap, not to the OS, when
                # freed: without a trim now and then the load's peak holds the model twice
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                untrimmed = 0
    model._weight_arena = area  # type: ignore[assignment]
    return total
