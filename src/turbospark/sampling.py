"""Next-token selection: pure functions over one sequence's logits.

`sample` applies, in order: logit bias, repetition / presence / frequency penalties, the
sequence's logits processors (grammar masks, thinking budget), then greedy or temperature +
top-k + min-p + top-p sampling. Randomness comes only from the `torch.Generator` passed in, so a
request seeded the same way samples the same tokens.

`filter_logits` is the plain statement of the filters (masks over the whole vocabulary).
`candidates` computes the same kept set and probabilities without sorting the vocabulary
(a 150k-entry sort per token costs more than a small model's decode step), and `sample` draws
from it by inverting the cumulative distribution with one uniform number (`draw`): one random
number per token instead of one per vocabulary entry (the exponential race this replaced drew
49k numbers a token on SmolLM2: 0.45 ms of a ~17 ms decode step, measured on a 2-core EPYC).
Greedy rows take numpy's argmax (5 us over 49k logits against 75 us for torch's, same CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from turbospark.backend import GenerationConfig, TokenEvent


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


class DistinctIds:
    """The distinct ids of a token list that only grows (a sequence's prompt + generated ids),
    kept up to date from the ids appended since the last call: the repetition penalty's set.

    Rebuilding it per token cost a set over the whole context each step (an agent's 18,000-token
    prompt: about a millisecond per generated token); here a step adds one id, and the id
    tensor is rebuilt only when that id is new."""

    __slots__ = ("_count", "_ids", "_seen", "_tensor")

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        self._count = 0
        self._ids: list[int] = []
        self._seen: set[int] = set()
        self._tensor: torch.Tensor | None = None

    def of(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The distinct ids of `token_ids` (int64, in first-seen order); `token_ids` must extend
        the list of the previous call (a shorter list starts over)."""
        if len(token_ids) < self._count:
            self._start()
        for token_id in token_ids[self._count :]:
            if token_id not in self._seen:
                self._seen.add(token_id)
                self._ids.append(token_id)
                self._tensor = None
        self._count = len(token_ids)
        if self._tensor is None:
            self._tensor = torch.tensor(self._ids, dtype=torch.long)
        return self._tensor


def apply_penalties(
    logits: torch.Tensor,
    config: GenerationConfig,
    context_ids: Sequence[int],
    generated_ids: Sequence[int],
    distinct: DistinctIds | None = None,
) -> torch.Tensor:
    """Returns logits with bias and penalties applied. `logits` is (vocab,) float32. `distinct`,
    where the caller keeps one per sequence, saves re-collecting the context's ids per token."""
    if config.logit_bias:
        ids = torch.tensor(list(config.logit_bias.keys()), dtype=torch.long)
        vals = torch.tensor(list(config.logit_bias.values()), dtype=logits.dtype)
        logits.index_add_(0, ids, vals)
    if config.repetition_penalty != 1.0 and context_ids:
        ids = (distinct or DistinctIds()).of(context_ids)
        picked = logits.index_select(0, ids)
        picked = torch.where(
            picked > 0, picked / config.repetition_penalty, picked * config.repetition_penalty
        )
        logits.index_copy_(0, ids, picked)
    if (config.presence_penalty or config.frequency_penalty) and generated_ids:
        ids_t = torch.tensor(list(generated_ids), dtype=torch.long)
        counts = torch.bincount(ids_t, minlength=logits.shape[0])[: logits.shape[0]].to(logits.dtype)
        logits -= config.frequency_penalty * counts
        logits -= config.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


LOOP_MAX_PERIOD = 128  # the longest block the loop guard looks for, in tokens
LOOP_NGRAM = 8  # while the guard holds, no run of this many tokens may repeat one since the loop


def loop_continuation(ids: Sequence[int], window: int, base: int = 0) -> int | None:
    """The token that would extend an exact loop, or None: a loop is the last `window` generated
    tokens (`ids[base:]` are the generated ones; window >= 2 * period) being one block of at most
    `LOOP_MAX_PERIOD` tokens over and over. Reads only the last `window` ids: no copy of the
    sequence."""
    if window <= 2 or len(ids) - base < window:
        return None
    p = _suffix_period(ids, window, min(LOOP_MAX_PERIOD, window // 2))
    return None if p is None else ids[len(ids) - p]


def _suffix_period(ids: Sequence[int], length: int, reach: int) -> int | None:
    """The shortest p <= reach with the last `length` ids p-periodic (ids[i] == ids[i - p]), or
    None. Only the distances at which the last token occurred before (found by C-level list
    searches) are candidates, and one is checked in full only where the token before the last
    repeats at that distance too."""
    n = len(ids)
    last = ids[n - 1]
    recent = list(ids[n - 1 - reach : n - 1])
    periods: list[int] = []
    at = -1
    while True:
        try:
            at = recent.index(last, at + 1)
        except ValueError:
            break
        periods.append(len(recent) - at)
    for p in reversed(periods):  # the shortest period first
        if ids[n - 2] != ids[n - 2 - p]:
            continue
        if all(ids[i] == ids[i - p] for i in range(n - length + p, n)):
            return p
    return None


class LoopGuard:
    """One sequence's loop guard (`GenerationConfig.loop_window`, `serve --loop-guard`).

    Small models fall into loops at any temperature: seen, a 0.5B model writing
    "require_escalated; " inside a tool call's JSON string until the context ran out (20 minutes
    on a CPU). When the last `window` generated tokens are one short block over and over
    (`loop_continuation`), the guard holds for the next `window` tokens: the token that would go
    round again is masked, and so is every token that would repeat a run of `LOOP_NGRAM` tokens
    written since the loop began (masking only the exact continuation, the model went round the
    same words spelled with other tokens: "requirement_escalated; " for another 1,000 tokens).
    Outside a loop it changes nothing, and most tokens cost a comparison: a search that finds no
    block repeating over the last `window - q` tokens (q = window // 8) proves that no loop can
    complete in the next q tokens (a loop then would repeat over at least that much now), so the
    guard looks again only after them (at 64 sampled rows a step on a GPU, a search per row and
    token cost ~0.4 ms of an ~11 ms step).

    The state is the committed tokens' (the engine's `Sequence` keeps one guard); a
    verification's positions run on a `copy` that is written back where they are accepted."""

    __slots__ = ("_memo", "loops", "quiet_until", "start", "until", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.start = 0  # where the loop the guard holds against began (generated index)
        self.until = -1  # the guard holds while fewer tokens than this are generated
        self.loops = 0  # loops found (each counted once, however long the guard then holds)
        self.quiet_until = 0  # no loop can complete while fewer tokens than this are generated
        # the last answer, by sequence length: a step asks twice (`_edits`, then `apply`), and a
        # sequence's committed tokens only grow, so one length is one content
        self._memo: tuple[int, list[int]] = (-1, [])

    def copy(self) -> LoopGuard:
        twin = LoopGuard(self.window)
        twin.assign(self)
        return twin

    def assign(self, other: LoopGuard) -> None:
        self.start, self.until, self.loops = other.start, other.until, other.loops
        self.quiet_until = other.quiet_until
        self._memo = (-1, [])

    def banned(self, ids: Sequence[int], base: int = 0) -> list[int]:
        """The tokens masked before the next one is picked (none outside a loop); `ids[base:]`
        are the generated tokens (`base` may be negative for a tail of them: then `len(ids) -
        base` is their count, and the tail must reach back to where the loop began)."""
        total = len(ids)
        if self._memo[0] == total - base:
            return self._memo[1]
        n = total - base  # generated so far
        if n < self.quiet_until and n >= self.until:
            return []
        token = self._continuation(ids, n)
        if token is not None:
            if n >= self.until:  # a new loop
                self.start = n - self.window
                self.loops += 1
            self.until = n + self.window
        out: list[int] = []
        if n < self.until:
            if token is not None:
                out.append(token)
            key = list(ids[total - LOOP_NGRAM + 1 :])
            first = key[0] if key else None
            for i in range(max(base + self.start, 0), total - LOOP_NGRAM + 1):
                if ids[i] == first and list(ids[i : i + LOOP_NGRAM - 1]) == key:
                    out.append(ids[i + LOOP_NGRAM - 1])
            out = sorted(set(out))
        self._memo = (n, out)
        return out

    def _continuation(self, ids: Sequence[int], n: int) -> int | None:
        """`loop_continuation` for the `n` generated tokens ending `ids`, setting `quiet_until`
        where a weaker search proves the next tokens loop-free."""
        window = self.window
        if window <= 2:
            self.quiet_until = 1 << 62
            return None
        if n < window:
            self.quiet_until = window
            return None
        reach = min(LOOP_MAX_PERIOD, window // 2)
        quiet = window // 8
        if quiet > 1 and window - quiet > reach and _suffix_period(ids, window - quiet, reach) is None:
            self.quiet_until = n + quiet
            return None
        p = _suffix_period(ids, window, reach)
        return None if p is None else ids[len(ids) - p]

    def apply(self, logits: torch.Tensor, ids: Sequence[int], base: int = 0) -> None:
        """Masks `banned` in logits (vocab,), after every other edit: where that would leave no
        token allowed (a grammar allows only those), nothing is masked."""
        banned = self.banned(ids, base)
        if not banned:
            return
        index = torch.tensor(banned, dtype=torch.long)
        kept = logits[index].clone()
        logits[index] = float("-inf")
        if not bool(torch.isfinite(logits).any()):
            logits[index] = kept


def guard_of(row: object) -> LoopGuard | None:
    """A sampling row's loop guard, where its config asks for one."""
    guard = getattr(row, "loop_guard", None)
    return guard if isinstance(guard, LoopGuard) and guard.window > 0 else None


def filter_logits(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks. Returns scaled logits (vocab,)."""
    logits = logits / max(config.temperature, 1e-5)
    if config.top_k and config.top_k > 0 and config.top_k < logits.shape[0]:
        kth = torch.topk(logits, config.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < config.min_p * probs.max(), float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token once the mass before it already reaches top_p; always keep the first
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= config.top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def candidates(logits: torch.Tensor, config: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, probabilities) that `filter_logits` keeps, probabilities renormalized.

    Same filters, same order; only top-k ties at the k-th value differ (exactly k are kept).
    """
    scaled = logits / max(config.temperature, 1e-5)
    vocab = scaled.shape[0]
    ids: torch.Tensor | None = None  # None: every token, in vocabulary order
    if config.top_k and 0 < config.top_k < vocab:
        scaled, ids = torch.topk(scaled, config.top_k)  # sorted, descending
    probs = torch.softmax(scaled, dim=-1)
    if config.min_p > 0.0:
        probs = probs.masked_fill(probs < config.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if config.top_p < 1.0:
        probs, ids = _nucleus(probs, ids, config.top_p)
    if ids is None:
        ids = _vocab_ids(vocab)
        # nothing filtered (the usual plain-temperature case): no gathers; on the CPU numpy's
        # min is a tenth of torch's `(probs > 0).all()` over a vocabulary
        nothing_filtered = bool((probs > 0).all()) if probs.is_cuda else float(probs.numpy().min()) > 0.0
        if nothing_filtered:
            return ids, probs
    keep = probs > 0
    kept = probs[keep]
    return ids[keep], kept / kept.sum()


def draw(ids: torch.Tensor, probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `candidates`' (ids, probs): the first whose cumulative probability passes
    a uniform draw (float64, scaled to the sum so rounding in the sum cannot run off the end)."""
    cdf = torch.cumsum(probs.double(), dim=0)
    u = (
        torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device).to(cdf.device)
        * cdf[-1]
    )
    i = min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)
    return int(ids[i])


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """argmax of each row of (rows, vocab) logits; numpy's on the CPU (15x torch's there)."""
    if logits.is_cuda or logits.dtype != torch.float32:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    return [int(t) for t in np.argmax(logits.numpy(), axis=-1)]


@functools.lru_cache(maxsize=4)
def _vocab_ids(vocab: int) -> torch.Tensor:
    """0..vocab-1, built once per vocabulary size (read-only: callers index it, never write)."""
    return torch.arange(vocab)


def _nucleus(
    probs: torch.Tensor, ids: torch.Tensor | None, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p over (probs, ids): keeps a token while the mass before it is below top_p."""
    n = probs.shape[0]
    k = min(n, 64)
    while True:
        # only the head needs sorting once it holds top_p of the mass: everything past it goes
        top_probs, order = torch.topk(probs, k) if k < n else torch.sort(probs, descending=True)
        if k == n or float(top_probs.sum()) >= top_p:
            break
        k = min(n, k * 8)
    before = top_probs.cumsum(0) - top_probs
    kept = before < top_p
    kept[0] = True
    top_ids = order if ids is None else ids[order]
    return top_probs[kept], top_ids[kept]


def sample(
    logits: torch.Tensor,
    config: GenerationConfig,
    generator: torch.Generator,
    context_ids: Sequence[int],
    generated_ids: Sequence[int],
    distinct: DistinctIds | None = None,
    guard: LoopGuard | None = None,
) -> TokenEvent:
    """Picks the next token from one sequence's raw logits (vocab,).

    `context_ids` is prompt + generated (for the repetition penalty); `generated_ids` is the
    generated tail alone (for presence / frequency penalties and processors); `distinct`, kept
    by the caller across a sequence's tokens, holds the context's distinct ids; `guard`, kept
    the same way, is its loop guard.
    """
    num_threads = torch.get_num_threads()
    if num_threads == 1 or logits.device.type != "cpu":
        return _sample(logits, config, generator, context_ids, generated_ids, distinct, guard)
    # One intra-op thread (a per-thread setting, restored after): torch splits each op over a
    # 150k vocabulary across its threads, and on a busy 2-core machine every such op waits
    # ~10 ms for a descheduled thread; a t=0.8 draw measured 190 ms on 2 threads, 3 ms on 1.
    torch.set_num_threads(1)
    try:
        return _sample(logits, config, generator, context_ids, generated_ids, distinct, guard)
    finally:
        torch.set_num_threads(num_threads)


class SamplingRow(Protocol):
    """One sequence as the batched sampler reads it (the engine's `Sequence`)."""

    config: GenerationConfig
    generator: torch.Generator
    token_ids: list[int]
    num_prompt_tokens: int  # token_ids[num_prompt_tokens:] are the generated ones
    distinct_ids: DistinctIds  # token_ids' distinct ids, for the repetition penalty

    @property
    def generated_ids(self) -> list[int]: ...


def sample_batch(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[TokenEvent | Exception]:
    """The next token of every row of logits (num_rows, vocab), row i belonging to `rows[i]`.

    Greedy rows take one argmax over the whole batch; a row with penalties or processors is
    edited in place first; sampled rows draw from their own seeded generator, so a seed gives the
    same tokens whatever else shares the batch. A row whose processor raises gets the exception
    instead of a token (its request fails; the others go on).
    """
    if not rows:
        return []
    num_threads = torch.get_num_threads()
    # greedy rows with nothing to edit or report only take numpy's argmax: no torch op to confine
    single = num_threads > 1 and logits.device.type == "cpu" and not argmax_only(rows)
    if single:
        torch.set_num_threads(1)  # see `sample`: small ops over the vocabulary stall on busy cores
    try:
        return _sample_batch(logits, rows)
    finally:
        if single:
            torch.set_num_threads(num_threads)


def _sample_batch(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[TokenEvent | Exception]:
    edited = [_edits(row) for row in rows]
    # a copy where a row is edited in place: the runner's logits are inference tensors (no
    # in-place edits outside inference mode) and may be a CUDA graph's static output buffer.
    # Rows only read (greedy, plain sampling) read them as they are: on CPU the copy was a fresh
    # vocabulary-sized allocation per step, page faults included. On a GPU, lower-precision
    # logits are read as they are too: the sampler there widens only the candidates it keeps.
    logits = logits.detach()
    if any(edited) or (logits.dtype != torch.float32 and not logits.is_cuda):
        logits = logits.to(torch.float32, copy=True)
    out: list[TokenEvent | Exception | None] = [None] * len(rows)
    for i, row in enumerate(rows):
        c = row.config
        if edited[i]:
            try:
                apply_penalties(logits[i], c, row.token_ids, row.generated_ids, row.distinct_ids)
                for proc in c.processors:
                    proc(row.generated_ids, logits[i])
                guard = guard_of(row)
                if guard is not None:
                    guard.apply(logits[i], row.token_ids, row.num_prompt_tokens)
            except Exception as exc:
                out[i] = exc
    greedy = [i for i, row in enumerate(rows) if row.config.is_greedy and out[i] is None]
    if greedy:
        picked = greedy_ids(logits[greedy] if len(greedy) < len(rows) else logits)
        for i, token_id in zip(greedy, picked, strict=True):
            out[i] = TokenEvent(token_id=int(token_id))
    if logits.is_cuda and any(e is None for e in out):
        _sample_on_device(logits, rows, out)
    for i, row in enumerate(rows):
        if out[i] is None:
            out[i] = TokenEvent(token_id=draw(*candidates(logits[i], row.config), row.generator))
    wants_logprobs = [
        i
        for i, row in enumerate(rows)
        if row.config.num_top_logprobs is not None and isinstance(out[i], TokenEvent)
    ]
    if wants_logprobs:
        logprobs = torch.log_softmax(logits[wants_logprobs], dim=-1, dtype=torch.float32)
        for j, i in enumerate(wants_logprobs):
            event = out[i]
            assert isinstance(event, TokenEvent)
            _attach_logprobs(event, logprobs[j], rows[i].config)
    return [e for e in out if e is not None]


def argmax_only(rows: Sequence[SamplingRow]) -> bool:
    """Every row's token is its logits' argmax, with nothing edited first or reported beside
    it: the ids are all that is needed (a runner asked with `want_ids` may have them already)."""
    return all(r.config.is_greedy and r.config.num_top_logprobs is None and not _edits(r) for r in rows)


def _edits(row: SamplingRow) -> bool:
    """The row's logits are edited in place before its token is picked."""
    c = row.config
    penalized = c.repetition_penalty != 1.0 or c.presence_penalty or c.frequency_penalty
    guard = guard_of(row)
    return bool(
        c.logit_bias
        or penalized
        or c.processors
        or (guard is not None and guard.banned(row.token_ids, row.num_prompt_tokens))
    )


def _sample_on_device(
    logits: torch.Tensor, rows: Sequence[SamplingRow], out: list[TokenEvent | Exception | None]
) -> None:
    """Every row of `out` still empty, drawn on the GPU: Gumbel-max sampling (an exact draw like
    the CPU's `draw`, from another random stream), with row i's noise keyed by a seed drawn from
    its own generator, so a seed reproduces its tokens on that device. One host sync for the
    batch.

    Rows with a top-k (the built-in defaults give every request top-k 40, top-p 0.95, min-p
    0.05) take one `torch.topk` of the raw logits over all of them, then one kernel
    (`cuda_ops.sample_truncated`) that scales the k survivors by the temperature, applies
    top-k, min-p and top-p as `truncate_rows` does and draws; the row parameters travel in one
    host tensor. A positive temperature keeps the order, so only the survivors are scaled (the
    float32 scale of the whole (rows, vocab) logits this replaced was a pass over them, and five
    parameter tensors and a dozen small launches a step went with it). Rows that truncate
    without a top-k, or with one wider than the kernel takes, go through `truncate_rows` and
    `cuda_ops.sample_rows`; rows that truncate nothing are only scaled, in `sample_rows`.

    The per-row loop before that (`filter_logits` row by row) cost ~88% of every step at 64
    sampled streams once the built-in defaults applied to every request (a 0.5B config on an
    H100: 22.6 ms a step instead of 9.8).
    """
    from turbospark.engine import cuda_ops

    vocab = logits.shape[1]
    limit = cuda_ops.TRUNCATED_MAX_WIDTH
    # row indices and (temperature, top-k, min-p, top-p, seed) by route: top-k kernel,
    # truncated otherwise, plain
    groups: tuple[list[int], list[int], list[int]] = ([], [], [])
    params: tuple[list[tuple[float, int, float, float, int]], ...] = ([], [], [])
    for i, event in enumerate(out):
        if event is not None:
            continue
        row = rows[i]
        c = row.config
        # one seed per row from its own generator (CPU generators: no device sync)
        seed = int(torch.randint(0, 2**31 - 1, (), generator=row.generator))
        k = _top_k(c, vocab)
        truncates = k < vocab or c.min_p > 0.0 or c.top_p < 1.0
        route = 2 if not truncates else 0 if k <= limit else 1
        groups[route].append(i)
        params[route].append((max(c.temperature, 1e-5), k, c.min_p, c.top_p, seed))
    device = logits.device
    picked: list[torch.Tensor] = []
    fused, wide, plain = groups
    if fused:
        table = torch.tensor(params[0], dtype=torch.float64).to(device, non_blocking=True)
        width = max(p[1] for p in params[0])
        # every row in order (the usual step) needs no gather
        raw = logits if len(fused) == logits.shape[0] else logits[fused]
        values, ids = torch.topk(raw, width, dim=-1)  # sorted, descending
        picked.append(cuda_ops.sample_truncated(values.float(), ids, table))
    if wide:
        seeds = torch.tensor([p[4] for p in params[1]], dtype=torch.int64).to(device, non_blocking=True)
        values, ids = truncate_rows(logits[wide], [rows[i].config for i in wide])
        ones = torch.ones(len(wide), dtype=torch.float32, device=device)
        at = cuda_ops.sample_rows(values, ones, seeds).long()
        picked.append(ids.gather(1, at[:, None])[:, 0])
    if plain:
        host = torch.tensor([(1.0 / p[0], float(p[4])) for p in params[2]], dtype=torch.float64)
        table = host.to(device, non_blocking=True)
        inv_temperature = table[:, 0].float()
        seeds = table[:, 1].long()
        picked.append(cuda_ops.sample_rows(logits[plain].contiguous(), inv_temperature, seeds).long())
    token_ids = torch.cat(picked).tolist() if picked else []
    for i, token_id in zip(fused + wide + plain, token_ids, strict=True):
        out[i] = TokenEvent(token_id=int(token_id))


def _top_k(config: GenerationConfig, vocab: int) -> int:
    """The candidates a row's top-k keeps: the whole vocabulary where it sets none."""
    return config.top_k if config.top_k and 0 < config.top_k < vocab else vocab


def truncate_rows(
    logits: torch.Tensor, configs: Sequence[GenerationConfig]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`filter_logits` for many rows at once: (values, ids), each (rows, width), row r's
    candidates sorted by scaled logit, descending, with the cut ones at -inf and their token ids
    beside them (values float32). width is the largest top-k among the rows (the whole
    vocabulary, one sort, where a row has none). Same filters in the same order as
    `filter_logits`; only ties at the k-th value differ (exactly k are kept, as `candidates`
    does). The top-k runs on the raw logits and only the survivors are scaled: dividing by a
    positive temperature keeps the order."""
    vocab = logits.shape[1]
    device = logits.device
    ks = [_top_k(c, vocab) for c in configs]
    inf = float("inf")
    # temperature, top-k, min-p, top-p (inf where off: nothing cut, whatever the rounding of
    # its cumulative sum) per row: one host tensor, one copy
    rows = [
        (max(c.temperature, 1e-5), k, c.min_p, c.top_p if c.top_p < 1.0 else inf)
        for c, k in zip(configs, ks, strict=True)
    ]
    table = torch.tensor(rows, dtype=torch.float32).to(device, non_blocking=True)
    width = max(ks)
    if width < vocab:
        values, ids = torch.topk(logits, width, dim=-1)  # sorted, descending
    else:
        values, ids = torch.sort(logits, dim=-1, descending=True)
    values = values.float() / table[:, 0:1]
    neg_inf = float("-inf")
    if min(ks) < width:
        values = values.masked_fill(torch.arange(width, device=device)[None, :] >= table[:, 1:2], neg_inf)
    if any(c.min_p > 0.0 for c in configs):
        probs = torch.softmax(values, dim=-1)
        values = values.masked_fill(probs < table[:, 2:3] * probs[:, :1], neg_inf)
    if any(c.top_p < 1.0 for c in configs):
        probs = torch.softmax(values, dim=-1)
        drop = (probs.cumsum(-1) - probs) >= table[:, 3:4]
        drop[:, 0] = False  # the most likely token always stays
        values = values.masked_fill(drop, neg_inf)
    return values.contiguous(), ids


def _attach_logprobs(event: TokenEvent, logprobs: torch.Tensor, config: GenerationConfig) -> None:
    event.logprob = float(logprobs[event.token_id])
    if config.num_top_logprobs:
        top = torch.topk(logprobs, min(config.num_top_logprobs, logprobs.shape[0]))
        event.top_logprobs = [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]


def _sample(
    logits: torch.Tensor,
    config: GenerationConfig,
    generator: torch.Generator,
    context_ids: Sequence[int],
    generated_ids: Sequence[int],
    distinct: DistinctIds | None,
    guard: LoopGuard | None,
) -> TokenEvent:
    logits = logits.detach().to(torch.float32).clone()
    apply_penalties(logits, config, context_ids, generated_ids, distinct)
    for proc in config.processors:
        proc(generated_ids, logits)
    if guard is not None:
        guard.apply(logits, generated_ids)
    if config.is_greedy:
        token_id = greedy_ids(logits[None])[0]
    else:
        token_id = draw(*candidates(logits, config), generator)
    event = TokenEvent(token_id=token_id)
    if config.num_top_logprobs is not None:
        _attach_logprobs(event, torch.log_softmax(logits, dim=-1), config)
    return event
