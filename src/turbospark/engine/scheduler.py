"""The scheduler: the FIFO admission line, the running set, and what each step computes.

Each step is decided as `{sequence: num_tokens}` under a token budget (`max_batched_tokens`):
running sequences first, in age order (a decoding sequence takes one token, a prefilling one the
rest of its prompt up to the budget, so a long prompt is fed in chunks between other streams'
tokens), then waiting sequences in arrival order while the budget, `max_active` and the KV cache
allow. A step with no decoding sequence in it stalls nobody's stream, so its budget is the larger
`max_prefill_tokens`: a long prompt alone goes in big chunks, which run faster per token (on a
2-core AVX2 CPU, Qwen2.5-0.5B: 1,024-token chunks reach 126 GFLOP/s in attention against 97 at
256, and the matmuls gain likewise). Admission never skips the head of the line: requests start
in the order they arrived. A new sequence first takes every block of its prompt's prefix that is
in the prefix cache.

When the KV cache cannot hold a running sequence's next tokens, the newest running sequence is
preempted: its blocks are released (kept findable in the prefix cache), it goes back to the
front of the line and is recomputed when readmitted. A request that fits the context is never
failed for lack of cache.

`Scheduler` is used under the engine's lock; it owns `waiting`, `running` and the block manager,
and is the only place a sequence's status changes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from turbospark.backend import EngineOverloaded, FinishReason, TokenEvent
from turbospark.engine.kv_cache import BlockManager
from turbospark.engine.sequence import Sequence, SequenceFailed, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_active: int = 8  # running sequences at once
    max_waiting: int = 64  # sequences in line before new ones are refused
    max_batched_tokens: int = 256  # tokens fed per step, all sequences together
    max_prefill_tokens: int = 1024  # the budget of a step in which no sequence decodes
    retry_after: float = 1.0

    def __post_init__(self) -> None:
        if self.max_active < 1 or self.max_waiting < 0 or self.max_batched_tokens < 1:
            raise ValueError("max_active and max_batched_tokens must be >= 1, max_waiting >= 0")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")


@dataclass(slots=True)
class ScheduledBatch:
    """One step: sequence i feeds `num_new[i]` tokens; `samples[i]` says whether they end at its
    last known token, so a new token is sampled from that row's logits. The last `num_draft[i]`
    of them are speculative drafts (`Sequence.draft_ids`) after its last known token: every one
    of its 1 + num_draft[i] last positions gets logits, and the engine keeps what verifies."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    num_draft: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, n: int, num_draft: int = 0) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)
        self.samples.append(seq.num_computed_tokens + n - num_draft == seq.num_tokens)
        self.num_draft.append(num_draft)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that get a new token this step, in batch order (the logits' rows)."""
        return [seq for seq, wants in zip(self.seqs, self.samples, strict=True) if wants]

    def drafts(self) -> list[list[int]]:
        """Each sampling sequence's drafts verified this step (empty where none), batch order."""
        return [
            seq.draft_ids[:d]
            for seq, d, wants in zip(self.seqs, self.num_draft, self.samples, strict=True)
            if wants
        ]

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Joins the line, or raises `EngineOverloaded` at once when the line is full (a free
        running slot counts as room: the next step admits into it)."""
        free_slots = max(0, self.config.max_active - len(self.running))
        if len(self.waiting) >= self.config.max_waiting + free_slots:
            raise EngineOverloaded(
                f"server is at capacity: {len(self.running)} generating, {len(self.waiting)} waiting; "
                "retry later",
                self.config.retry_after,
            )
        if self.blocks.num_blocks_for(seq.num_tokens) > self.blocks.num_blocks:
            raise ValueError(f"a {seq.num_tokens}-token prompt does not fit the KV cache")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        self._finish_cancelled()
        batch = ScheduledBatch()
        budget = self.config.max_batched_tokens
        if not any(seq.num_tokens - seq.num_computed_tokens == 1 for seq in self.running):
            budget = max(budget, self.config.max_prefill_tokens)  # no stream to stall
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.draft_ids:  # a decoding sequence verifies its drafts: they count in the budget
                del seq.draft_ids[max(0, budget - 1) :]
                n = min(1 + len(seq.draft_ids), budget)
                if not self.blocks.grow(seq.block_table, seq.num_computed_tokens + n):
                    seq.draft_ids.clear()  # drafts never preempt anybody
                    n = 1
            while not self.blocks.grow(seq.block_table, seq.num_computed_tokens + n):
                victim = self.running[-1]
                assert victim is not seq or len(self.running) > 1, "a lone sequence outgrew the cache"
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                batch.add(seq, n, len(seq.draft_ids))
                budget -= n
                i += 1
        # after a preemption the cache is tight: admitting more now would only preempt again
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_active:
            if not self._admit(self.waiting[0], batch, budget):
                break
            budget -= batch.num_new[-1]
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:  # its queue time ends here (`Sequence.result`)
                seq.first_scheduled_time = now
        return batch

    def _admit(self, seq: Sequence, batch: ScheduledBatch, budget: int) -> bool:
        assert not seq.block_table and seq.num_computed_tokens == 0
        blocks = self.blocks
        ids = seq.cache_ids()
        hits, key = blocks.match_prefix(ids, seq.config.cache_salt)
        stored = blocks.stored_continuation(ids, len(hits), key)  # on disk past the memory hits
        num_computed = (len(hits) + len(stored)) * blocks.block_size
        n = min(seq.num_tokens - num_computed, budget)
        needed = blocks.num_blocks_for(num_computed + n) - len(hits)
        unreferenced_hits = sum(1 for b in hits if blocks.ref_counts[b] == 0)
        if needed > blocks.num_free_blocks - unreferenced_hits:
            return False
        blocks.share(hits)
        fresh = blocks.allocate(needed)
        if stored:
            loaded = blocks.load_stored(stored, fresh[: len(stored)])
            if loaded:
                key = stored[loaded - 1]
            # a block that could not be read is computed: the step feeds the same n tokens from
            # an earlier position, inside the blocks already taken
            num_computed = (len(hits) + loaded) * blocks.block_size
            hits = hits + fresh[:loaded]
            fresh = fresh[loaded:]
        seq.block_table = hits + fresh
        seq.num_computed_tokens = num_computed
        seq.num_hashed_blocks, seq.last_block_key = len(hits), key
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_computed
            self.num_prefix_hit_tokens += num_computed
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.add(seq, n)
        return True

    def update(self, batch: ScheduledBatch) -> None:
        """After the forward: each sequence's fed tokens are in the cache; the blocks that
        became full are registered in the prefix cache. Drafts are not counted: the engine
        counts those that verify (`settle`)."""
        for seq, n, d in zip(batch.seqs, batch.num_new, batch.num_draft, strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # failed during the step
            seq.num_computed_tokens += n - d
            hashed = self.blocks.register_full_blocks(
                seq.cache_ids(),
                seq.block_table,
                _cacheable(seq, self.blocks),
                seq.num_hashed_blocks,
                seq.last_block_key,
            )
            seq.num_hashed_blocks, seq.last_block_key = hashed

    def post(
        self,
        batch: ScheduledBatch,
        sampling: list[Sequence],
        results: list[list[TokenEvent] | Exception],
        model: str,
    ) -> int:
        """After a step's forward and sampling: the fed tokens are in the cache (`update`), and
        each sampling sequence takes its tokens (one, or a verification's accepted drafts and one
        more): a failure fails it, a stop token or its length budget finishes it, each token goes
        to its outbox; a verifying sequence's cache is then cut back to what it kept (`settle`).
        Returns the tokens handed out."""
        self.update(batch)
        now = time.monotonic()
        emitted = 0
        for seq, got, d in zip(sampling, results, batch.drafts(), strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if isinstance(got, BaseException):
                self.fail(seq, got)
                continue
            for event in got:
                if event.token_id in seq.config.stop_token_ids:
                    seq.last_token_time = now
                    self.finish(seq, FinishReason.STOP)
                    break
                seq.append(event, now, model)
                emitted += 1
                if seq.num_generated >= seq.max_new_tokens:
                    self.finish(seq, FinishReason.LENGTH)
                    break
            if d and seq.status is SequenceStatus.RUNNING:
                self.settle(seq)
        return emitted

    def settle(self, seq: Sequence) -> None:
        """After a verification's tokens were appended: the accepted drafts count as computed,
        their full blocks join the prefix cache, blocks past the kept length go back."""
        blocks = self.blocks
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.num_hashed_blocks, seq.last_block_key = blocks.register_full_blocks(
            seq.cache_ids(),
            seq.block_table,
            seq.num_computed_tokens,
            seq.num_hashed_blocks,
            seq.last_block_key,
        )
        keep = blocks.num_blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            tail = seq.block_table[keep:]
            del seq.block_table[keep:]
            blocks.release(tail)
        seq.draft_ids = []

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Ends a sequence: its blocks go back, its result goes to its outbox."""
        self._leave(seq)
        seq.finish_reason = reason
        seq.outbox.put(seq.result())

    def fail(self, seq: Sequence, error: BaseException) -> None:
        self._leave(seq)
        seq.finish_reason = FinishReason.CANCELLED
        seq.outbox.put(SequenceFailed(error))

    def _leave(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.release(seq.block_table)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        seq.draft_ids.clear()
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks, seq.last_block_key = 0, self.blocks.root_key(seq.config.cache_salt)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _finish_cancelled(self) -> None:
        for seq in [s for s in (*self.running, *self.waiting) if s.cancel.is_set()]:
            self.finish(seq, FinishReason.CANCELLED)

    def check(self) -> None:
        """Invariants (tests): statuses match the lines, blocks are referenced as held."""
        assert all(s.status is SequenceStatus.RUNNING for s in self.running)
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in self.waiting)
        assert len(self.running) <= self.config.max_active
        held: dict[int, int] = {}
        for s in self.running:
            assert len(s.block_table) >= self.blocks.num_blocks_for(s.num_computed_tokens)
            for b in s.block_table:
                held[b] = held.get(b, 0) + 1
        for b in range(self.blocks.num_blocks):
            assert self.blocks.ref_counts[b] == held.get(b, 0), f"block {b} referenced wrongly"
        self.blocks.check()


def _cacheable(seq: Sequence, blocks: BlockManager) -> int:
    """How many of the sequence's computed tokens may enter the prefix cache: all of them, or
    where the blocks hold no generated tokens' keys (`BlockManager.cache_generated` off: the CPU
    running rows by role, `row_kernels`) only its prompt's, so a later prompt that repeats an
    answer computes it as a cold prompt would."""
    if blocks.cache_generated:
        return seq.num_computed_tokens
    return min(seq.num_computed_tokens, seq.num_prompt_tokens)
