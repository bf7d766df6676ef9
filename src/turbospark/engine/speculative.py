"""Speculative decoding inside the batched engine: propose, verify in the step's forward, accept.

Per decoding sequence, a `Proposer` guesses the next k tokens (`Sequence.draft_ids`); the
scheduler feeds the sequence's last token and its k drafts in one step (they count against the
step's token budget), the runner returns logits for all 1 + k positions, and `sample_step`
picks, position by position, the token the sequence's own sampler would have picked there:
greedy rows keep a draft while it equals the argmax, sampled rows by rejection sampling (a draft
`x` proposed with probability q(x) is kept with probability min(1, p(x) / q(x)); on rejection
the token comes from the residual max(0, p - q), renormalized), so the output distribution is
the target's (Leviathan et al. 2023; a draftless proposer is the point mass q = 1 at `x`). The
first rejected position still yields a token (the argmax, or the residual draw), and a fully
accepted run yields one more from the last row: a verification emits 1 to k + 1 tokens.

Rollback (`Scheduler.settle`): the KV written for rejected drafts is left in place but never read (the
sequence's computed length stops at the accepted tokens), blocks past the accepted length go
back to the block manager, and only blocks made of accepted tokens are registered in the prefix
cache (the scheduler counts only the sequence's last token as computed, `Scheduler.settle` adds the
accepted drafts).

Draftless proposers (no second model, so no second forward):

- `ngram`: prompt lookup. The last n tokens (n from `max_n` down to `min_n`) are looked up in an
  index of the sequence's own prompt and output (the most recent earlier occurrence), and the
  tokens that followed it are proposed. An agent that re-emits a file it read, quotes code or
  repeats a tool call's JSON is copying its context.
- `suffix`: the same, and on a miss the same lookup in a bounded index over earlier responses
  of this engine's model (agents repeat themselves across turns and sub-agents), oldest
  responses dropped first past `max_suffix_tokens`.

Both are written here (no library offers a per-sequence incremental n-gram index in Python;
vLLM's and llama.cpp's are tied to their engines): dicts from n-gram to its last end position,
extended by the tokens appended since the last step, so a lookup costs O(max_n) whatever the
context length.

A step's drafts may be bounded in rows (`max_rows`, on the CPU the rows one pass of the native
kernels reads each weight for): then the decoding sequences share what is left of them in turn.

Adaptive k: each sequence starts at `num_tokens` and after each verification moves to one more
than the drafts it got accepted (all accepted: k grows); a proposal rejected outright backs the
sequence off (no proposals for 1, 2, 4 ... up to 32 steps), so text that does not repeat its
context pays for few verifications. A step with more decoding sequences than `max_batch` does
not speculate: there the batch already fills the forward.

Grammar-constrained sequences (logits processors) never get drafts: their processors keep
state that only moves forward. Sequences with penalties, logprobs or sampling do: each position
is sampled with the context as it would be with the drafts before it accepted.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from turbospark import metrics
from turbospark.backend import FinishReason, TokenEvent
from turbospark.engine.sequence import Sequence as EngineSequence
from turbospark.engine.sequence import SequenceStatus
from turbospark.sampling import (
    LOOP_NGRAM,
    DistinctIds,
    LoopGuard,
    SamplingRow,
    _attach_logprobs,
    _edits,
    apply_penalties,
    candidates,
    greedy_ids,
    guard_of,
    sample_batch,
)

METHODS = ("ngram", "suffix", "off")
# what `serve` runs without --speculative, per device kind: on the CPU, n-gram drafts verified
# as decode rows pay 2.0-2.7x on agent-like edits and tool calls and lose at most 3% where nothing
# matches (benchmarks/RESULTS.md: AVX2 and Zen 4 EPYCs). On CUDA batch 1 pays as much (2.34x on
# edits, an H100 by replay), but the serving smoke A/B (random 8B, c64, an H100) with it on gave
# 0.96-1.00x of off, 0.98x over three runs each, ITL p99 the same: off until that loss is gone
DEFAULT_SPECULATIVE = {"cpu": "ngram", "cuda": "off"}


def default_method(device: str) -> str:
    """`DEFAULT_SPECULATIVE` for a `--device` value (cpu, cuda, cuda:N)."""
    return DEFAULT_SPECULATIVE.get(device.split(":")[0], "off")


# ---- configuration --------------------------------------------------------------------------


@dataclass(slots=True)
class SpeculativeConfig:
    """`method`: "ngram" or "suffix"; `num_tokens`: most drafts per sequence and step."""

    method: str = "ngram"
    draft_model: str | None = None  # method "draft": the model that drafts (same tokenizer)
    num_tokens: int = 5  # a verification of 6 rows runs as 6 decode rows: about one step's cost
    max_batch: int = 4  # decoding sequences above which a step does not speculate
    # rows (decoding sequences plus their drafts) a speculating step may feed; None: no bound.
    # On the CPU the native kernels read each weight once per 8 rows (`row_kernels.DECODE_GROUP`):
    # drafts beyond the rows of one pass would cost another pass each step they are made
    max_rows: int | None = None
    min_n: int = 2
    max_n: int = 5
    max_suffix_tokens: int = 65536  # tokens of earlier responses the suffix index holds
    max_backoff: int = 32  # steps a sequence whose drafts all failed waits, at most

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "suffix", "draft"):
            raise ValueError(f"unknown speculative method {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model goes with method 'draft' and only with it")
        if self.num_tokens < 1:
            raise ValueError("the number of speculative tokens must be >= 1")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("n-gram sizes must satisfy 1 <= min_n <= max_n")


def parse_speculative(value: str | None, num_tokens: int | None = None) -> SpeculativeConfig | None:
    """`--speculative` as given: ngram | suffix | draft:MODEL | off (None)."""
    if value is None or value == "off":
        return None
    if value.startswith("draft:"):
        if not value[len("draft:") :].strip():
            raise ValueError(f"--speculative {value!r}: name the draft model, as draft:qwen2.5-coder:0.5b")
        config = SpeculativeConfig(method="draft", draft_model=value[len("draft:") :].strip())
    elif value in METHODS:
        config = SpeculativeConfig(method=value)
    else:
        raise ValueError(f"--speculative {value!r}: expected one of ngram, suffix, draft:MODEL, off")
    if num_tokens is not None:
        config.num_tokens = num_tokens
        config.__post_init__()
    return config


# ---- proposers ------------------------------------------------------------------------------


class Proposer(Protocol):
    """Guesses a sequence's next tokens. `propose` returns up to `k` ids (none: no guess);
    `finished` sees every sequence that ended normally (for indexes over earlier responses)."""

    name: str

    def propose(self, seq: EngineSequence, k: int) -> list[int]: ...

    def finished(self, seq: EngineSequence) -> None: ...

    def retain(self, live: Iterable[int]) -> None:
        """Called before each step's proposals with the running sequences' ids: per-sequence
        state of any other sequence may go (the draft model's caches do)."""


class NgramIndex:
    """The n-grams (min_n..max_n) of a token list that only grows, each mapped to the position of
    its last token in its most recent occurrence; the n-grams ending at the list's last token
    are left out, so a lookup of the list's own suffix finds an earlier occurrence."""

    __slots__ = ("_maps", "indexed", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.indexed = 0  # n-grams ending before this position are in

    def extend(self, tokens: Sequence[int], end: int) -> None:
        """Indexes the n-grams ending at positions [indexed, end)."""
        maps, lo, hi = self._maps, self.min_n, self.max_n
        for e in range(self.indexed, end):
            for n in range(lo, min(hi, e + 1) + 1):
                maps[n][tuple(tokens[e - n + 1 : e + 1])] = e
        self.indexed = max(self.indexed, end)

    def find(self, tokens: Sequence[int]) -> int | None:
        """End position of the most recent earlier occurrence of the longest suffix of `tokens`
        (max_n down to min_n tokens) found, or None."""
        size = len(tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            e = self._maps[n].get(tuple(tokens[size - n :]))
            if e is not None:
                return e
        return None


class NgramProposer:
    """Prompt lookup over the sequence's own prompt and output."""

    name = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def _index(self, seq: EngineSequence) -> NgramIndex:
        state = seq.speculation
        assert isinstance(state, SequenceSpeculation)
        if state.index is None:
            state.index = NgramIndex(self.config.min_n, self.config.max_n)
        return state.index

    def propose(self, seq: EngineSequence, k: int) -> list[int]:
        tokens = seq.token_ids
        index = self._index(seq)
        index.extend(tokens, len(tokens) - 1)
        e = index.find(tokens)
        return [] if e is None else tokens[e + 1 : e + 1 + k]

    def finished(self, seq: EngineSequence) -> None:
        pass

    def retain(self, live: Iterable[int]) -> None:
        pass  # its per-sequence index lives on the sequence


class ResponseIndex:
    """N-grams of earlier responses, bounded: past `max_tokens` the oldest responses go, and the
    maps are rebuilt from those kept once stale entries outnumber live ones."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self._responses: OrderedDict[int, list[int]] = OrderedDict()
        self._ids = itertools.count()
        self.num_tokens = 0
        self._maps: list[dict[tuple[int, ...], tuple[int, int]]] = [{} for _ in range(max_n + 1)]
        self._num_live = 0  # index entries pointing into kept responses (an upper bound)

    def __len__(self) -> int:
        return len(self._responses)

    def add(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens[-self.max_tokens :])
        if len(tokens) <= self.min_n:
            return
        rid = next(self._ids)
        self._responses[rid] = tokens
        self.num_tokens += len(tokens)
        self._index(rid, tokens)
        while self.num_tokens > self.max_tokens:
            _, dropped = self._responses.popitem(last=False)
            self.num_tokens -= len(dropped)
        entries = sum(len(m) for m in self._maps)
        if entries > 2 * max(self._num_live, 1024):
            self._rebuild()

    def _index(self, rid: int, tokens: list[int]) -> None:
        for e in range(len(tokens) - 1):  # an n-gram at the very end has nothing after it
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                self._maps[n][tuple(tokens[e - n + 1 : e + 1])] = (rid, e)
                self._num_live += 1

    def _rebuild(self) -> None:
        self._maps = [{} for _ in range(self.max_n + 1)]
        self._num_live = 0
        for rid, tokens in self._responses.items():
            self._index(rid, tokens)
        self._num_live = sum(len(m) for m in self._maps)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        size = len(context)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            hit = self._maps[n].get(tuple(context[size - n :]))
            if hit is None:
                continue
            tokens = self._responses.get(hit[0])
            if tokens is not None:
                return tokens[hit[1] + 1 : hit[1] + 1 + k]
        return []


class SuffixProposer(NgramProposer):
    """The sequence's own context first, then earlier responses of the same model."""

    name = "suffix"

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.responses = ResponseIndex(config.min_n, config.max_n, config.max_suffix_tokens)

    def propose(self, seq: EngineSequence, k: int) -> list[int]:
        own = super().propose(seq, k)
        if len(own) >= k:
            return own
        earlier = self.responses.propose(seq.token_ids, k)
        return earlier if len(earlier) > len(own) else own

    def finished(self, seq: EngineSequence) -> None:
        self.responses.add(seq.generated_ids)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The n-gram proposers; a draft model's (`engine/draft.py`) is built where its model loads
    (`load_backend`), which sets it on the `Speculator`: until then this one stands in."""
    return SuffixProposer(config) if config.method == "suffix" else NgramProposer(config)


# ---- per-sequence state and the engine's hooks ------------------------------------------------


@dataclass(slots=True)
class SequenceSpeculation:
    """One sequence's adaptive state (kept on `Sequence.speculation`)."""

    k: int
    index: NgramIndex | None = None
    wait: int = 0  # steps left before the next proposal
    misses: int = 0  # proposals in a row rejected outright
    proposed: int = 0
    accepted: int = 0


def _seeded_draws(seq: EngineSequence) -> bool:
    """A seeded request that samples: its tokens must not depend on what shares its steps, and
    a verification draws its random numbers differently from plain decoding (rejection sampling),
    while whether a step speculates depends on how many sequences decode in it. Greedy requests
    speculate (their tokens are plain decoding's), and so do unseeded ones (nothing to reproduce)."""
    return seq.config.seed is not None and not seq.config.is_greedy


@dataclass
class Speculator:
    """The engine's side: proposes drafts before the schedule, learns from each verification."""

    config: SpeculativeConfig
    model: str = "model"
    proposer: Proposer = field(init=False)
    num_proposed: int = 0
    num_accepted: int = 0
    num_verifications: int = 0

    def __post_init__(self) -> None:
        self.proposer = make_proposer(self.config)

    def propose(self, running: Iterable[EngineSequence], max_context: int) -> None:
        """Sets `draft_ids` of every running sequence (empty where it does not speculate)."""
        running = list(running)
        self.proposer.retain(s.seq_id for s in running)
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        for seq in running:
            seq.draft_ids = []
        if len(decoding) > self.config.max_batch:
            return
        spare = None if self.config.max_rows is None else self.config.max_rows - len(decoding)
        for seq in decoding:
            if spare is not None and spare <= 0:
                break
            if seq.config.processors or seq.cancel.is_set() or _seeded_draws(seq):
                continue
            state = seq.speculation
            if not isinstance(state, SequenceSpeculation):
                state = seq.speculation = SequenceSpeculation(k=self.config.num_tokens)
            if state.wait > 0:
                state.wait -= 1
                continue
            # the drafts and the token after them must fit the request's budget and the context
            room = min(seq.max_new_tokens - seq.num_generated - 1, max_context - seq.num_tokens)
            k = min(state.k, room, spare if spare is not None else room)
            if k <= 0:
                continue
            seq.draft_ids = self.proposer.propose(seq, k)[:k]
            if spare is not None:
                spare -= len(seq.draft_ids)

    def observe(
        self,
        seqs: Sequence[EngineSequence],
        drafts: Sequence[Sequence[int]],
        results: Sequence[list[TokenEvent] | Exception],
    ) -> None:
        """After a step: adapts each verifying sequence's k, counts, and hands sequences that
        ended normally to the proposer."""
        proposed = accepted = verifications = 0
        histogram: list[float] = []
        for seq, draft, got in zip(seqs, drafts, results, strict=True):
            if draft and isinstance(got, list):
                state = seq.speculation
                assert isinstance(state, SequenceSpeculation)
                a = num_accepted(draft, got)
                state.proposed += len(draft)
                state.accepted += a
                proposed += len(draft)
                accepted += a
                verifications += 1
                histogram.append(a / len(draft))
                if a == 0:
                    state.misses += 1
                    state.wait = min(self.config.max_backoff, 1 << (state.misses - 1))
                    state.k = max(1, state.k // 2)
                else:
                    state.misses = 0
                    state.k = min(self.config.num_tokens, a + 1 if a < len(draft) else 2 * state.k)
            if seq.status is SequenceStatus.FINISHED and seq.finish_reason in (
                FinishReason.STOP,
                FinishReason.LENGTH,
            ):
                self.proposer.finished(seq)
        if verifications:
            self.num_proposed += proposed
            self.num_accepted += accepted
            self.num_verifications += verifications
            metrics.count_speculation(self.model, self.proposer.name, proposed, accepted, histogram)


def num_accepted(draft: Sequence[int], emitted: Sequence[TokenEvent]) -> int:
    """Drafts kept: the emitted tokens are the accepted drafts and then one more."""
    a = 0
    for d, e in zip(draft, emitted, strict=False):
        if d != e.token_id:
            break
        a += 1
    return min(a, len(emitted) - 1)


# ---- acceptance -----------------------------------------------------------------------------


def accept_greedy(draft: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens greedy decoding emits: drafts while they equal the argmax at their position,
    then the argmax where they first differ (or after the last draft). len(targets) must be
    len(draft) + 1."""
    assert len(targets) == len(draft) + 1
    out: list[int] = []
    for d, t in zip(draft, targets, strict=False):
        out.append(t)
        if d != t:
            return out
    out.append(targets[len(draft)])
    return out


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


def _draw_dense(probs: torch.Tensor, generator: torch.Generator) -> int:
    cdf = torch.cumsum(probs.double(), dim=0)
    u = _uniform(generator) * float(cdf[-1])
    return min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)), len(cdf) - 1)


def rejection_step(
    p: torch.Tensor, draft: int, generator: torch.Generator, q: torch.Tensor | None = None
) -> tuple[bool, int]:
    """One position of speculative sampling. `p` is the target's distribution (vocab,), `draft`
    the proposed token, `q` the proposer's distribution (None: it proposed `draft` for sure).
    Returns (accepted, token): the draft with probability min(1, p / q), else a draw from
    max(0, p - q) renormalized. The token is distributed as p either way."""
    p_x = float(p[draft])
    q_x = 1.0 if q is None else float(q[draft])
    if q_x > 0 and _uniform(generator) < min(1.0, p_x / q_x):
        return True, draft
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    if float(residual.sum()) <= 0.0:  # p equals q (or is the point mass at the draft)
        residual = p
    return False, _draw_dense(residual, generator)


class _DraftedRow:
    """A sequence as the sampler would see it with `extra` tokens appended."""

    __slots__ = ("_base", "_extra", "distinct_ids", "num_prompt_tokens")

    def __init__(self, base: SamplingRow, extra: list[int]) -> None:
        self._base = base
        self._extra = extra
        self.num_prompt_tokens = base.num_prompt_tokens
        self.distinct_ids = _ExtendedDistinct(base.distinct_ids, len(base.token_ids))

    @property
    def token_ids(self) -> list[int]:
        return self._base.token_ids + self._extra

    @property
    def generated_ids(self) -> list[int]:
        return self._base.generated_ids + self._extra


class _ExtendedDistinct(DistinctIds):
    """The base sequence's distinct ids (kept incrementally on it) plus those of a few drafts,
    without re-collecting the context."""

    __slots__ = ("_base", "_base_len")

    def __init__(self, base: DistinctIds, base_len: int) -> None:
        super().__init__()
        self._base = base
        self._base_len = base_len

    def of(self, token_ids: Sequence[int]) -> torch.Tensor:
        head = self._base.of(token_ids[: self._base_len])
        seen = set(head.tolist()) if len(token_ids) > self._base_len else set()
        extra = []
        for t in token_ids[self._base_len :]:
            if t not in seen:
                seen.add(t)
                extra.append(t)
        return torch.cat([head, torch.tensor(extra, dtype=torch.long)]) if extra else head


def _guard_bans_within(guard: LoopGuard | None, row: SamplingRow, draft: list[int]) -> bool:
    """Whether the loop guard masks tokens at some position of this verification (the drafts
    accepted before a position may complete a loop): then every position is sampled as plain
    decoding samples it. Asked of a copy of the sequence's guard, over the tail the guard reads
    (the last two windows: a held loop began at most one window before it was found, and is held
    one window after), not a copy of the whole sequence per position."""
    if guard is None or not draft:
        return False
    probe = guard.copy()
    ids = row.token_ids
    cut = max(row.num_prompt_tokens, len(ids) - 2 * guard.window - LOOP_NGRAM)
    tail = ids[cut:]
    base = row.num_prompt_tokens - cut  # <= 0: the generated count stays len(tail) - base
    for token in draft:
        tail.append(token)
        if probe.banned(tail, base):
            return True
    return False


def _verify_one(logits: torch.Tensor, row: SamplingRow, draft: list[int]) -> list[TokenEvent]:
    """The tokens one sequence emits from its (1 + len(draft), vocab) logits."""
    c = row.config
    base_guard = guard_of(row)
    guard = base_guard.copy() if base_guard is not None else None
    edits = _edits(row) or _guard_bans_within(guard, row, draft)
    if c.is_greedy and not edits and c.num_top_logprobs is None:
        return [TokenEvent(token_id=t) for t in accept_greedy(draft, greedy_ids(logits))]
    out: list[TokenEvent] = []
    for j in range(len(draft) + 1):
        x = logits[j].to(torch.float32, copy=True)
        if edits:
            view = _DraftedRow(row, draft[:j])
            apply_penalties(x, c, view.token_ids, view.generated_ids, view.distinct_ids)
            if guard is not None:
                guard.apply(x, view.token_ids, view.num_prompt_tokens)
        if c.is_greedy:
            token = greedy_ids(x[None])[0]
            accepted = j < len(draft) and token == draft[j]
        else:
            ids, probs = candidates(x, c)
            p = torch.zeros(x.shape[0], dtype=torch.float32)
            p[ids] = probs.to(torch.float32)
            if j < len(draft):
                accepted, token = rejection_step(p, draft[j], row.generator)
            else:
                accepted, token = False, _draw_dense(p, row.generator)
        event = TokenEvent(token_id=token)
        if c.num_top_logprobs is not None:
            _attach_logprobs(event, torch.log_softmax(x, dim=-1), c)
        out.append(event)
        if not accepted:
            break
    if base_guard is not None and guard is not None and edits:
        base_guard.assign(guard)  # the guard as plain decoding left it after the last position
    return out


def sample_step(
    logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]
) -> list[list[TokenEvent] | Exception]:
    """Every sampling row's tokens from a step where some rows verify drafts: `logits` holds
    1 + len(drafts[i]) consecutive rows per sequence i, in order. Rows without drafts are
    sampled by `sample_batch` exactly as in a plain step."""
    starts = [0, *itertools.accumulate(1 + len(d) for d in drafts)]
    plain = [i for i, d in enumerate(drafts) if not d]
    out: list[list[TokenEvent] | Exception] = [[] for _ in rows]
    if plain:
        events = sample_batch(logits[[starts[i] for i in plain]], [rows[i] for i in plain])
        for i, e in zip(plain, events, strict=True):
            out[i] = [e] if isinstance(e, TokenEvent) else e
    logits = logits.detach()
    num_threads = torch.get_num_threads()
    single = num_threads > 1 and logits.device.type == "cpu"
    if single:
        torch.set_num_threads(1)  # as `sampling.sample`: small ops over the vocabulary
    try:
        host = logits if logits.device.type == "cpu" else logits.float().cpu()
        for i, d in enumerate(drafts):
            if d:
                try:
                    out[i] = _verify_one(host[starts[i] : starts[i + 1]], rows[i], list(d))
                except Exception as exc:  # as `sample_batch`: this request fails, others go on
                    out[i] = exc
    finally:
        if single:
            torch.set_num_threads(num_threads)
    return out
