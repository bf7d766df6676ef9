"""`Sequence`: one request's state inside the engine.

A sequence owns its token ids (prompt, then generated), how many of them have keys/values in the
KV cache (`num_computed_tokens`, the one counter that covers prefill, chunked prefill, prefix
hits and decode), its block table, its sampling settings and seeded generator, and the outbox
its tokens travel through to the thread that submitted it. The scheduler moves it between
`WAITING`, `RUNNING` and `FINISHED`; nothing else changes its status.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from turbospark import metrics
from turbospark.backend import (
    CancelFlag,
    CompletionResult,
    FinishReason,
    GenerationConfig,
    Outbox,
    TokenEvent,
)
from turbospark.sampling import DistinctIds, LoopGuard


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SequenceFailed:
    """Put in a sequence's outbox when its generation raised: the submitter re-raises `error`."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    config: GenerationConfig
    max_new_tokens: int  # the request's budget, already bounded by the context
    cancel: CancelFlag
    generator: torch.Generator
    runner_state: Any = None  # what a model runner keeps per sequence (the scripted fake's reply)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    last_block_key: int | None = None  # chain key of the last registered block
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # TokenEvent ... then CompletionResult or SequenceFailed; the submitter's, or a queue
    outbox: Outbox = field(default_factory=queue.SimpleQueue[object])
    distinct_ids: DistinctIds = field(default_factory=DistinctIds)  # for the repetition penalty
    loop_guard: LoopGuard = field(init=False)  # `sampling.LoopGuard`, from config.loop_window
    # speculative decoding (`turbospark.engine.speculative`): this step's proposed next tokens
    # (not in token_ids until verified) and the proposer's per-sequence state
    draft_ids: list[int] = field(default_factory=list)
    speculation: Any = None

    def __post_init__(self) -> None:
        self.loop_guard = LoopGuard(self.config.loop_window)

    def cache_ids(self) -> list[int]:
        """The ids the prefix cache keys this sequence's blocks by: its token ids, but where a
        runner state says so (a vision model's images) the image tokens stand for a hash of
        the picture (`turbospark.engine.vision.ImagePrompt`)."""
        keyed = getattr(self.runner_state, "cache_ids", None)
        return self.token_ids if keyed is None else keyed(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def emit(self, event: TokenEvent) -> None:
        self.outbox.put(event)

    def append(self, event: TokenEvent, now: float, model: str) -> None:
        """A generated token: joins the ids, its timing is observed, and it leaves through the
        outbox."""
        self.token_ids.append(event.token_id)
        if self.first_token_time is None:
            self.first_token_time = now
            metrics.observe_first_token(model, now - self.arrival_time)
        else:
            metrics.observe_inter_token(model, now - (self.last_token_time or now))
        self.last_token_time = now
        self.outbox.put(event)

    def result(self) -> CompletionResult:
        assert self.finish_reason is not None
        prefill_end = self.first_token_time or self.last_token_time or time.monotonic()
        start = self.first_scheduled_time or self.arrival_time
        return CompletionResult(
            token_ids=self.generated_ids,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            prefill_seconds=max(0.0, prefill_end - start),
            decode_seconds=max(0.0, (self.last_token_time or prefill_end) - prefill_end),
        )
