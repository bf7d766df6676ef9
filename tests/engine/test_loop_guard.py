"""The loop guard (`sampling.LoopGuard`, `serve --loop-guard`): a reply stuck repeating one short
block is made to leave it, the same way on every decode path.

A tiny random model decoded greedily falls into a loop within a few dozen tokens: without the
guard it goes round to the end of its budget; with it, no stretch longer than the window repeats,
and the plain engine, the speculative engine and the sequential reference give the same tokens."""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import run_all
from tiny_models import FAMILIES, checkpoint

from turbospark import metrics
from turbospark.backend import NEVER_CANCEL, GenerationConfig
from turbospark.engine.engine import Engine
from turbospark.engine.models import build_model
from turbospark.engine.runner import ModelRunner
from turbospark.engine.scheduler import Scheduler, SchedulerConfig
from turbospark.engine.speculative import SpeculativeConfig, Speculator
from turbospark.sampling import LoopGuard, loop_continuation

WINDOW = 48
PROMPTS = [[5, 9, 33, 2, 71, 14], [100, 3, 3, 18], [7, 7, 7, 40, 41, 42, 43, 9, 12]]


def test_loop_continuation_finds_the_token_that_goes_round_again() -> None:
    block = [11, 12, 13, 14, 15]
    looping = [1, 2, 3] + block * 10
    assert loop_continuation(looping, 40) == 11
    assert loop_continuation(looping[:-1], 40) == 15
    assert loop_continuation([9] * 40, 40) == 9
    assert loop_continuation(looping, 60) is None  # the loop is shorter than the window
    assert loop_continuation([*looping, 99], 40) is None  # just left it
    assert loop_continuation(list(range(100)), 40) is None
    assert loop_continuation([1, 2] * 3, 40) is None  # too short to tell
    paragraph = list(range(200, 300))  # a 100-token block (a code block written again and again)
    assert loop_continuation([7, *paragraph * 3], 256) == 200
    assert loop_continuation([7, *paragraph * 3, 5], 256) is None


def test_the_guard_masks_the_loop_and_its_respellings_then_lets_go() -> None:
    guard = LoopGuard(12)
    looping = [1, 2, 3] + [20, 21, 22] * 4
    assert guard.banned(looping[:-1]) == []
    assert guard.banned(looping) == [20]  # the block's first token again
    logits = torch.zeros(30)
    guard.apply(logits, looping)
    assert logits[20] == float("-inf") and torch.isfinite(logits[torch.arange(30) != 20]).all()
    # the same words spelled with other tokens: any run of LOOP_NGRAM tokens seen since the
    # loop began may not be repeated while the guard holds
    respelled = [*looping, 25, 21, 22, 20, 21, 22, 20, 21]
    assert guard.banned(respelled) == [22]
    # a grammar that allows only the masked token keeps it
    only = torch.full((30,), float("-inf"))
    only[20] = 0.0
    guard.apply(only, looping)
    assert only[20] == 0.0
    # the guard holds for a window's tokens after the loop, then stops looking back
    later = [*looping, *range(40, 40 + 12)]
    assert guard.banned(later) == []


@pytest.mark.parametrize("window", [16, 64, 256])
def test_skipping_quiet_stretches_answers_as_searching_every_token(window: int) -> None:
    """The guard searches only where a loop could complete (`LoopGuard.quiet_until`): over
    token streams that fall into loops of many periods, asked token by token and also from a
    verification's tail (a negative base), it answers exactly as a guard that searches at every
    token."""
    rng = random.Random(window)
    for _ in range(12):
        head = [rng.randrange(60) for _ in range(rng.randint(20, 400))]
        block = [rng.randrange(60) for _ in range(rng.randint(1, 70))]
        tokens = head + block * rng.randint(2, 12) + [rng.randrange(60) for _ in range(rng.randint(0, 90))]
        skipping, searching = LoopGuard(window), LoopGuard(window)
        for end in range(1, len(tokens) + 1):
            searching.quiet_until = 0
            want = searching.banned(tokens[:end])
            assert skipping.banned(tokens[:end]) == want
            cut = max(0, end - 2 * window - 8)
            assert skipping.copy().banned(tokens[cut:end], -cut) == want
        assert skipping.loops == searching.loops


def _model() -> torch.nn.Module:
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=3, init_std=0.02)
    return build_model(cfg, tensors)


def _longest_loop(tokens: list[int]) -> int:
    """The longest stretch (up to 200) that repeats one block of <= 32 tokens."""
    return max(
        (w for w in range(3, 201) for e in range(w, len(tokens) + 1) if loop_continuation(tokens[:e], w)),
        default=0,
    )


def _loops_broken() -> float:
    return metrics.REGISTRY.get_sample_value("turbospark_loops_broken_total", {"model": "loops"}) or 0.0


def _engine(model: torch.nn.Module, speculator: Speculator | None = None) -> Engine:
    runner = ModelRunner(model, max_context=512, num_blocks=512, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_active=4, max_batched_tokens=64), runner.block_manager)
    return Engine(runner, scheduler, max_context=512, name="loops", speculator=speculator)


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_a_greedy_loop_is_left_the_same_way_on_every_path(method: str) -> None:
    model = _model()
    off = GenerationConfig(max_new_tokens=240, temperature=0.0)
    on = GenerationConfig(max_new_tokens=240, temperature=0.0, loop_window=WINDOW)
    unguarded = run_all(_engine(model), PROMPTS, [off] * len(PROMPTS))
    assert max(_longest_loop(t) for t in unguarded) >= 200, "the tiny model no longer loops: pick another"
    reference = ModelRunner(model, max_context=512, block_size=4)
    want = [reference.generate(p, on, NEVER_CANCEL, lambda _: None).token_ids for p in PROMPTS]
    speculator = (
        Speculator(SpeculativeConfig(method="ngram", num_tokens=5, max_batch=8))
        if method == "ngram"
        else None
    )
    before = _loops_broken()
    got = run_all(_engine(model, speculator), PROMPTS, [on] * len(PROMPTS))
    assert _loops_broken() - before >= len(PROMPTS)  # /metrics counts each loop the guard broke
    assert got == want
    assert all(len(t) == 240 for t in got)
    assert max(_longest_loop(t) for t in got) <= WINDOW
    if speculator is not None:
        assert speculator.num_accepted > 0  # loops are what n-gram drafts predict
