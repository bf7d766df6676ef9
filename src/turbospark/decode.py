"""The sequential decode loop over a `LogitProducer`: prefill, then one token at a time.

Used by backends that run one sequence at a time (the scripted backend). The engine's batched
scheduler has its own step loop but keeps the same semantics: the cancel flag is polled once per
prefill chunk and per decoded token, `on_progress` sees every token as it is sampled, an id in
`stop_token_ids` ends the sequence (and is not part of the output), and the context bound turns
into finish reason "length".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from turbospark.backend import (
    CancelFlag,
    CompletionResult,
    FinishReason,
    GenerationConfig,
    ProgressCallback,
)
from turbospark.sampling import DistinctIds, LoopGuard, make_generator, sample


class LogitProducer(Protocol):
    def prefill(self, prompt_ids: Sequence[int], cancel: CancelFlag) -> torch.Tensor | None:
        """Logits (vocab,) for the token after the prompt; None if cancelled mid-prefill."""

    def step(self, token_id: int) -> torch.Tensor:
        """Feeds one token, returns logits (vocab,) for the next."""


def run_decode_loop(
    producer: LogitProducer,
    prompt_ids: Sequence[int],
    config: GenerationConfig,
    max_context: int,
    cancel: CancelFlag,
    on_progress: ProgressCallback,
) -> CompletionResult:
    started = time.perf_counter()
    generator = make_generator(config.seed)
    context = list(prompt_ids)
    generated: list[int] = []
    distinct = DistinctIds()  # the context's distinct ids, grown token by token
    guard = LoopGuard(config.loop_window)
    logits = producer.prefill(prompt_ids, cancel)
    prefilled = time.perf_counter()
    finish = FinishReason.LENGTH
    budget = config.budget(len(prompt_ids), max_context)
    if logits is None:
        finish = FinishReason.CANCELLED
        budget = 0
    while len(generated) < budget:
        if cancel.is_set():
            finish = FinishReason.CANCELLED
            break
        assert logits is not None
        event = sample(logits, config, generator, context, generated, distinct, guard)
        if event.token_id in config.stop_token_ids:
            finish = FinishReason.STOP
            break
        generated.append(event.token_id)
        context.append(event.token_id)
        on_progress(event)
        if len(generated) < budget:
            logits = producer.step(event.token_id)
    if finish is FinishReason.LENGTH and cancel.is_set():
        finish = FinishReason.CANCELLED
    done = time.perf_counter()
    return CompletionResult(
        token_ids=generated,
        finish_reason=finish,
        num_prompt_tokens=len(prompt_ids),
        prefill_seconds=prefilled - started,
        decode_seconds=done - prefilled,
    )
