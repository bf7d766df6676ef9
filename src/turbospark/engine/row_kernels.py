"""Which kernel a step's rows run on the CPU, so a token's arithmetic depends only on the token
and its context: not on what else is in the step, the prefix cache, or how its prompt was chunked.

The quantized CPU path has two kernel families for one weight: the native int8-activation
kernels (`engine/native.py`, few rows, fast decode) and the many-row ones (fbgemm's fp16 GEMM on
a packed copy, or the weight expanded). They round differently, and choosing between them by a
step's row count made a token's logits depend on the batch and the chunking. Here the choice is
by the row's *role* instead, decided once per step (`plan_step`):

- a generated token fed back (one new token of a sequence past its prompt) is a "decode" row:
  the native kernels, in groups of `native.MAX_ROWS`, however many decode rows the step has
  (torch's int4 / int8 kernels where the native ones do not run: their rows are independent of
  the row count, measured); a step with more than that many decode rows runs as several;
- every prompt token (a chunk of any size, a single remaining token after a prefix-cache hit)
  is a "prompt" row: the many-row kernel, with the rows padded to a multiple that the GEMM's
  row blocking keeps each row's arithmetic the same under (`_padding`: probed once);
- a step that mixes both runs as two forwards, one per role (`split_step`);
- the lm_head always runs as "decode" rows (one row per sampling sequence);
- the norms, rotary and SiLU run the native per-row kernels for any row count, and attention
  reduces each query row over its own context in one fixed order (`attention.CpuAttention`).

Only prompt-role KV enters the prefix cache (`scheduler.update`), so a later prompt that
repeats an earlier answer computes those tokens the way a cold request would.

The `fast_nondeterministic` setting (`serve --fast-nondeterministic`, or
`TURBOSPARK_FAST_NONDETERMINISTIC=1`: `kernel_settings`) turns all of this off:
the row count picks the kernel again, mixed steps run as one forward, and a seed's text may
depend on the batch (benchmarks/RESULTS.md has the cost of each side).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Literal

import torch

from turbospark.engine import kernel_settings

ENV_VAR = kernel_settings.ENV_VARS["fast_nondeterministic"]
Role = Literal["decode", "prompt"]
DECODE_GROUP = 8  # the native kernels' row limit (native.MAX_ROWS)

_state = threading.local()


def reproducible() -> bool:
    """Whether the CPU runs rows by role (the default); False under the `fast_nondeterministic`
    setting. Asked at each step."""
    return not kernel_settings.current().fast_nondeterministic


def role() -> Role | None:
    """The role of the rows the current forward computes; None outside a role-planned forward
    (the row count then picks the kernel, as before)."""
    return getattr(_state, "role", None)


@contextlib.contextmanager
def rows_as(r: Role | None) -> Iterator[None]:
    """Runs the block with its linears taking rows of role `r`."""
    before = role()
    _state.role = r
    try:
        yield
    finally:
        _state.role = before


def in_groups(x: torch.Tensor, size: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn over row groups of at most `size` rows, concatenated (one call where x fits)."""
    if x.shape[0] <= size:
        return fn(x)
    return torch.cat([fn(x[i : i + size]) for i in range(0, x.shape[0], size)])


def padded(x: torch.Tensor, multiple: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn over x with zero rows added up to a multiple of `multiple` rows, cut back to x's rows."""
    rows = x.shape[0]
    target = -(-rows // multiple) * multiple
    if target == rows:
        return fn(x)
    return fn(torch.cat([x, x.new_zeros(target - rows, *x.shape[1:])]))[:rows]


def _row_invariant(fn: Callable[[torch.Tensor], torch.Tensor], k: int, multiple: int) -> bool:
    """Whether fn, with rows padded to `multiple`, gives every row the same result at any row
    count and offset (rows 1..40 and a few larger, at offsets 0, 1, 5)."""
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(0))
    full = padded(x, multiple, fn)
    for start in (0, 1, 5):
        for rows in (*range(1, 41), 61, 121, 130):
            if not torch.equal(padded(x[start : start + rows], multiple, fn), full[start : start + rows]):
                return False
    return True


CANDIDATES = (6, 8, 14, 24, 42, 120)


@functools.cache
def packed_multiple(split: bool = False) -> int | None:
    """Rows per call that keep fbgemm's fp16 GEMM row-invariant here, or None. Measured on the
    AVX2 EPYC: its 3..6-row micro-kernels agree, its 1- and 2-row ones (used for a remainder of
    1 or 2 rows) do not; padding to a multiple of 6 removes them. `split`: for a packed copy
    whose last input columns are kept apart in float32 (`quant.HalfPacked`, SmolLM2's 576 =
    512 + 64), whose float32 GEMM blocks rows its own way (there: multiples of 8), so the two
    need a common multiple (24). Probed once per process."""
    prepack = torch.ops.quantized.linear_prepack_fp16
    w = torch.randn(512, 576, generator=torch.Generator().manual_seed(1))
    fn: Callable[[torch.Tensor], torch.Tensor]
    try:
        if split:
            head, tail = prepack(w[:, :512].contiguous(), None), w[:, 512:].t().contiguous()

            def fn(a: torch.Tensor) -> torch.Tensor:
                out = torch.ops.quantized.linear_dynamic_fp16(a[:, :512].contiguous(), head)
                return out.addmm_(a[:, 512:], tail)  # type: ignore[no-any-return]
        else:
            packed = prepack(w, None)

            def fn(a: torch.Tensor) -> torch.Tensor:
                return torch.ops.quantized.linear_dynamic_fp16(a, packed)  # type: ignore[no-any-return]
    except (RuntimeError, AttributeError):
        return None
    for m in CANDIDATES:
        if _row_invariant(fn, 576, m):
            return m
    return None


@functools.cache
def dense_multiple(dtype: torch.dtype = torch.float32) -> int | None:
    """Rows per call that keep `F.linear` (oneDNN / MKL) row-invariant here in `dtype`, or None.
    Unpadded it was not on the AVX2 EPYC (1-3 rows take another path; with 2 threads 5-11 too);
    padded to 8 it was."""
    w = torch.randn(512, 576, generator=torch.Generator().manual_seed(2)).to(dtype)
    for m in CANDIDATES:
        if _row_invariant(lambda a: torch.nn.functional.linear(a.to(dtype), w).float(), 576, m):
            return m
    return None


def dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` for role-planned rows: padded to the probed multiple (unpadded where no
    multiple made it row-invariant: the result is then only as invariant as the library)."""
    multiple = dense_multiple(w.dtype if w.dtype in (torch.float32, torch.bfloat16) else torch.float32)
    fn = functools.partial(torch.nn.functional.linear, weight=w, bias=bias)
    return fn(x) if multiple is None else padded(x, multiple, fn)


def decode_sequences(query_lens: list[int], seq_lens: list[int], prompt_lens: list[int] | None) -> list[bool]:
    """Per sequence of a step: is it a decode (one generated token fed back)? Without the
    prompt lengths (the one-sequence reference path), a single new token counts as one."""
    if prompt_lens is None:
        return [q == 1 for q in query_lens]
    return [q == 1 and s - 1 >= p for q, s, p in zip(query_lens, seq_lens, prompt_lens, strict=True)]


def split_step(is_decode: list[bool]) -> list[tuple[Role, list[int]]] | None:
    """The forwards a step runs as, each (role, its sequences in step order): the prompt rows,
    then the decodes in groups of `DECODE_GROUP`. None when the step is already one of them.
    The order matters where rows of one sequence land in several parts (a verification cut into
    one-token sequences whose first token is its prompt's last, `runner.verify_rows_as_decodes`):
    a part's keys are in the cache before a later part attends."""
    decodes = [i for i, d in enumerate(is_decode) if d]
    prompts = [i for i, d in enumerate(is_decode) if not d]
    parts: list[tuple[Role, list[int]]] = [("prompt", prompts)] if prompts else []
    parts += [("decode", decodes[i : i + DECODE_GROUP]) for i in range(0, len(decodes), DECODE_GROUP)]
    return parts if len(parts) > 1 else None
