"""The runner's generation semantics: those of `turbospark.decode.run_decode_loop`."""

from __future__ import annotations

import threading

import torch
from tiny_models import FAMILIES, checkpoint

from turbospark.backend import NEVER_CANCEL, FinishReason, GenerationConfig, TokenEvent
from turbospark.engine.models import build_model
from turbospark.engine.runner import ModelRunner

PROMPT = [5, 17, 99, 230, 41, 8, 77, 3, 150, 12, 9, 260]


def make(max_context: int = 128, prefill_chunk_size: int = 256, **ckpt) -> tuple[ModelRunner, object]:
    cfg, tensors, ref = checkpoint(FAMILIES["llama"], **ckpt)
    model = build_model(cfg, tensors)
    return ModelRunner(model, max_context=max_context, prefill_chunk_size=prefill_chunk_size), ref


def naive_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """The reference's own greedy loop: a full forward per token, no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


class Collect:
    def __init__(self) -> None:
        self.events: list[TokenEvent] = []

    def __call__(self, event: TokenEvent) -> None:
        self.events.append(event)


def test_greedy_generation_equals_the_reference_loop() -> None:
    runner, ref = make(seed=0, init_std=1.0)
    progress = Collect()
    result = runner.generate(
        PROMPT, GenerationConfig(max_new_tokens=16, temperature=0.0), NEVER_CANCEL, progress
    )
    assert result.token_ids == naive_greedy(ref, PROMPT, 16)
    assert [e.token_id for e in progress.events] == result.token_ids  # every token, in order
    assert result.finish_reason is FinishReason.LENGTH
    assert result.num_prompt_tokens == len(PROMPT)
    assert runner.block_manager.num_free_blocks == runner.block_manager.num_blocks  # blocks returned


def test_stop_token_ends_the_sequence_and_is_not_emitted() -> None:
    runner, _ = make(seed=0, init_std=1.0)
    free_run = runner.generate(
        PROMPT, GenerationConfig(max_new_tokens=10, temperature=0.0), NEVER_CANCEL, Collect()
    )
    stop_id = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_id)
    config = GenerationConfig(max_new_tokens=10, temperature=0.0, stop_token_ids=frozenset({stop_id}))
    result = runner.generate(PROMPT, config, NEVER_CANCEL, Collect())
    assert result.token_ids == free_run.token_ids[:first]
    assert result.finish_reason is FinishReason.STOP


def test_context_bound_gives_length() -> None:
    runner, _ = make(max_context=len(PROMPT) + 3)
    result = runner.generate(
        PROMPT, GenerationConfig(max_new_tokens=50, temperature=0.0), NEVER_CANCEL, Collect()
    )
    assert len(result.token_ids) == 3
    assert result.finish_reason is FinishReason.LENGTH


def test_seeded_sampling_reproduces() -> None:
    runner, _ = make()
    config = GenerationConfig(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    a = runner.generate(PROMPT, config, NEVER_CANCEL, Collect()).token_ids
    b = runner.generate(PROMPT, config, NEVER_CANCEL, Collect()).token_ids
    c = runner.generate(
        PROMPT, GenerationConfig(max_new_tokens=12, temperature=1.0, seed=99), NEVER_CANCEL, Collect()
    )
    assert a == b
    assert a != c.token_ids


class CancelAfter:
    """A cancel flag that turns on after it has been polled `polls` times."""

    def __init__(self, polls: int) -> None:
        self.polls_left = polls
        self.num_polls = 0

    def is_set(self) -> bool:
        self.num_polls += 1
        self.polls_left -= 1
        return self.polls_left < 0


class CountingRunner(ModelRunner):
    num_forwards = 0

    def forward(self, batch):
        self.num_forwards += 1
        return super().forward(batch)


def test_cancel_during_prefill_stops_at_the_next_chunk() -> None:
    cfg, tensors, _ = checkpoint(FAMILIES["llama"])
    runner = CountingRunner(build_model(cfg, tensors), max_context=128, prefill_chunk_size=4)
    prompt = PROMPT * 4  # 48 tokens: 12 chunks
    cancel = CancelAfter(polls=2)  # the flag turns on after the second chunk
    progress = Collect()
    result = runner.generate(prompt, GenerationConfig(max_new_tokens=5), cancel, progress)
    assert runner.num_forwards == 2
    assert result.finish_reason is FinishReason.CANCELLED
    assert result.token_ids == [] and progress.events == []
    assert runner.block_manager.num_free_blocks == runner.block_manager.num_blocks


def test_cancel_during_decode_stops_within_one_token() -> None:
    runner, _ = make()
    cancel = threading.Event()
    progress = Collect()

    def on_progress(event: TokenEvent) -> None:
        progress(event)
        if len(progress.events) == 3:
            cancel.set()

    result = runner.generate(PROMPT, GenerationConfig(max_new_tokens=50), cancel, on_progress)
    assert len(result.token_ids) == 3
    assert result.finish_reason is FinishReason.CANCELLED


def test_batched_step_serves_two_sequences_like_two_runs() -> None:
    """The step function the scheduler will drive: two greedy sequences decoded in lockstep."""
    from turbospark.engine.runner import SequenceState

    cfg, tensors, ref = checkpoint(FAMILIES["qwen2"], seed=0, init_std=1.0)
    runner = ModelRunner(build_model(cfg, tensors), max_context=64, max_num_seqs=2)
    prompts = [PROMPT, PROMPT[3:9]]
    seqs = [SequenceState(), SequenceState()]
    logits = runner.forward(list(zip(seqs, prompts, strict=True)))
    outputs: list[list[int]] = [[], []]
    for _ in range(8):
        next_ids = [int(row.argmax()) for row in logits]
        for out, t in zip(outputs, next_ids, strict=True):
            out.append(t)
        logits = runner.forward([(s, [t]) for s, t in zip(seqs, next_ids, strict=True)])
    assert outputs == [naive_greedy(ref, p, 8) for p in prompts]
