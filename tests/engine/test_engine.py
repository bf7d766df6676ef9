"""The batched engine: same tokens as one request at a time, scheduler invariants, FIFO order,
the rate cap, preemption and cancellation."""

from __future__ import annotations

import random
import threading
import time

import pytest
from tiny_models import FAMILIES, checkpoint

from turbospark.backend import NEVER_CANCEL, EngineOverloaded, FinishReason, GenerationConfig, TokenEvent
from turbospark.engine.engine import Engine, StepOutput
from turbospark.engine.kv_cache import BlockManager
from turbospark.engine.models import build_model
from turbospark.engine.runner import ModelRunner
from turbospark.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from turbospark.ratecontrol import RateControl
from turbospark.scripted import Replay, ReplayRunner


def prompts(seed: int, num: int, vocab: int = 250) -> list[list[int]]:
    """Prompts of mixed lengths; half of them share a 40-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(num):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
        out.append(shared + tail if i % 2 else tail + shared[: rng.randint(0, 20)])
    return out


def engine_for(model, *, num_blocks: int, block_size: int = 4, **sched) -> Engine:
    """An engine whose every step, decoding or not, stays under the given token budget."""
    if "max_batched_tokens" in sched:
        sched.setdefault("max_prefill_tokens", sched["max_batched_tokens"])
    runner = ModelRunner(model, max_context=128, num_blocks=num_blocks, block_size=block_size)
    scheduler = Scheduler(SchedulerConfig(**sched), runner.block_manager)
    return Engine(runner, scheduler, max_context=128, name="test")


def run_all(engine: Engine, requests: list[list[int]], configs: list[GenerationConfig]) -> list[list[int]]:
    """Submits every request at once, from its own thread, and collects their tokens."""
    results: list[list[int] | None] = [None] * len(requests)

    def one(i: int) -> None:
        got: list[TokenEvent] = []
        result = engine.run(requests[i], configs[i], NEVER_CANCEL, got.append)
        assert [e.token_id for e in got] == result.token_ids
        results[i] = result.token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_greedy_equals_one_at_a_time(family: str) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES[family], seed=1, init_std=1.0)
    model = build_model(cfg, tensors)
    requests = prompts(seed=2, num=8)
    configs = [GenerationConfig(max_new_tokens=12 + i, temperature=0.0) for i in range(len(requests))]
    reference = ModelRunner(model, max_context=128, block_size=4)
    want = [
        reference.generate(p, c, NEVER_CANCEL, lambda _: None).token_ids
        for p, c in zip(requests, configs, strict=True)
    ]
    # a small token budget chunks every prompt and mixes chunks with decodes; a cache of 48
    # blocks (192 tokens) cannot hold 8 sequences of ~80 tokens, so some are preempted
    engine = engine_for(model, num_blocks=48, max_active=8, max_batched_tokens=16)
    got = run_all(engine, requests, configs)
    assert got == want
    scheduler = engine.scheduler
    assert scheduler.num_prefix_hit_tokens > 0  # the shared prefix was reused
    assert scheduler.num_preemptions > 0
    scheduler.check()
    assert scheduler.blocks.num_used_blocks == 0  # every block came back


def test_seeded_sampling_does_not_depend_on_the_batch() -> None:
    cfg, tensors, _ = checkpoint(FAMILIES["qwen2"], seed=3, init_std=1.0)
    model = build_model(cfg, tensors)
    requests = prompts(seed=4, num=6)
    configs = [
        GenerationConfig(
            max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, repetition_penalty=1.1
        )
        for i in range(len(requests))
    ]
    alone = [
        run_all(engine_for(model, num_blocks=64), [p], [c])[0] for p, c in zip(requests, configs, strict=True)
    ]
    together = run_all(engine_for(model, num_blocks=256, max_batched_tokens=32), requests, configs)
    assert together == alone


class CountingReplay(ReplayRunner):
    """The scripted fake model, checking the scheduler's invariants after every step."""

    def __init__(self, vocab_size: int, scheduler: Scheduler | None = None) -> None:
        super().__init__(vocab_size)
        self.scheduler = scheduler
        self.steps: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch, *, want_ids: bool = False) -> StepOutput:
        if self.scheduler is not None:
            self.scheduler.check()
            assert batch.num_tokens <= self.scheduler.config.max_batched_tokens
        self.steps.append(batch)
        return super().execute(batch)


def test_random_submit_cancel_finish_keeps_every_invariant() -> None:
    """1,000 random events: submits (with shared prefixes), cancels, natural finishes."""
    rng = random.Random(7)
    blocks = BlockManager(40, block_size=4)
    scheduler = Scheduler(
        SchedulerConfig(max_active=6, max_waiting=1000, max_batched_tokens=24, max_prefill_tokens=24), blocks
    )
    runner = CountingReplay(300, scheduler)
    engine = Engine(runner, scheduler, max_context=160, name="random")
    stems = [[rng.randrange(300) for _ in range(rng.randint(4, 40))] for _ in range(6)]
    live: list[tuple[threading.Event, object]] = []
    for _ in range(1000):
        if live and rng.random() < 0.3:
            cancel, _seq = live.pop(rng.randrange(len(live)))
            cancel.set()
        else:
            cancel = threading.Event()
            prompt = rng.choice(stems) + [rng.randrange(300) for _ in range(rng.randint(1, 20))]
            script = [rng.randrange(300) for _ in range(rng.randint(1, 40))]
            config = GenerationConfig(max_new_tokens=rng.randint(1, 40), temperature=0.0)
            seq = engine.submit(prompt, config, cancel, runner_state=Replay(script))
            live.append((cancel, seq))
        if rng.random() < 0.5:
            engine.step() if engine._thread is None else time.sleep(0)
    deadline = time.monotonic() + 60
    while scheduler.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not scheduler.has_work()
    with engine._lock:
        scheduler.check()
    assert blocks.num_used_blocks == 0 and scheduler.num_preemptions > 0


def test_requests_start_in_arrival_order_and_a_full_line_refuses_at_once() -> None:
    scheduler = Scheduler(SchedulerConfig(max_active=1, max_waiting=19), BlockManager(4096, 16))
    runner = CountingReplay(300)
    engine = Engine(runner, scheduler, max_context=4096, name="fifo")
    cancels = [threading.Event() for _ in range(21)]
    # each prompt token costs 10 ms, so the line is still full when the 21st arrives
    slow = [Replay([1, 2, 3], seconds_per_prompt_token=0.01) for _ in range(21)]
    seqs = [
        engine.submit([i + 1] * (5 + i), GenerationConfig(max_new_tokens=3), cancels[i], slow[i])
        for i in range(20)
    ]
    with pytest.raises(EngineOverloaded) as refused:
        engine.submit([9], GenerationConfig(max_new_tokens=3), cancels[20], slow[20])
    assert refused.value.retry_after > 0
    deadline = time.monotonic() + 30
    while scheduler.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    started = sorted(seqs, key=lambda s: s.first_scheduled_time or 0.0)
    assert [s.seq_id for s in started] == [s.seq_id for s in seqs]
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)


def test_a_prompt_alone_takes_the_prefill_budget_and_never_stalls_a_decoding_stream() -> None:
    """No sequence decoding: steps feed up to max_prefill_tokens; once one decodes, every step
    stays under max_batched_tokens, so the second prompt is chunked between its tokens."""
    scheduler = Scheduler(SchedulerConfig(max_batched_tokens=8, max_prefill_tokens=32), BlockManager(256, 4))
    seen: list[tuple[bool, int]] = []  # (some sequence decodes in the step, tokens fed)

    class Recording(ReplayRunner):
        def execute(self, batch: ScheduledBatch, *, want_ids: bool = False) -> StepOutput:
            decoding = any(s.num_tokens - s.num_computed_tokens == 1 for s in batch.seqs)
            seen.append((decoding, batch.num_tokens))
            return super().execute(batch)

    engine = Engine(Recording(300), scheduler, max_context=512, name="budget")
    cancel = threading.Event()
    first = engine.submit(list(range(1, 101)), GenerationConfig(max_new_tokens=200), cancel, Replay([7]))
    while first.num_computed_tokens < 100:
        time.sleep(0.001)
    second = engine.submit(list(range(101, 201)), GenerationConfig(max_new_tokens=2), cancel, Replay([7]))
    assert isinstance(second.outbox.get(timeout=30), TokenEvent)
    cancel.set()
    assert seen[:4] == [(False, 32), (False, 32), (False, 32), (False, 4)]  # 100 prompt tokens, alone
    with_decodes = [n for decoding, n in seen[4:] if decoding]
    assert with_decodes and max(with_decodes) <= 8
    assert with_decodes.count(8) >= 12  # one decode token + a 7-token chunk of the second prompt


@pytest.mark.parametrize("num_streams", [1, 8])
def test_the_rate_cap_holds_across_streams(num_streams: int) -> None:
    cap = 150.0
    rate = RateControl(cap)
    scheduler = Scheduler(SchedulerConfig(max_active=8), BlockManager(4096, 16))
    engine = Engine(ReplayRunner(300), scheduler, max_context=4096, rate=rate, name="capped")
    cancel = threading.Event()
    for i in range(num_streams):
        engine.submit([i + 1] * 8, GenerationConfig(max_new_tokens=100_000), cancel, Replay([5]))
    time.sleep(1.0)  # settle
    start_tokens, start = rate.num_tokens, time.monotonic()
    time.sleep(4.0)
    measured = (rate.num_tokens - start_tokens) / (time.monotonic() - start)
    cancel.set()
    assert abs(measured - cap) <= 0.1 * cap, measured


def test_a_cancel_in_prefill_stops_within_one_step() -> None:
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=0)
    model = build_model(cfg, tensors)
    engine = engine_for(model, num_blocks=64, max_batched_tokens=4)
    cancel = threading.Event()
    seq = engine.submit(list(range(3, 120)), GenerationConfig(max_new_tokens=5), cancel)
    while seq.num_computed_tokens < 8:
        time.sleep(0.001)
    cancel.set()
    result = seq.outbox.get(timeout=10)
    while not hasattr(result, "finish_reason"):
        result = seq.outbox.get(timeout=10)
    assert result.finish_reason is FinishReason.CANCELLED and result.token_ids == []
    assert seq.num_computed_tokens < 117  # the prompt was not finished
    assert engine.scheduler.blocks.num_used_blocks == 0


def test_64_concurrent_long_requests_all_complete_within_the_kv_budget() -> None:
    """64 requests whose contexts together need ~5x the cache: preempted and recomputed, none
    lost, every one the length it asked for, the cache never past its blocks."""
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=5, init_std=1.0)
    model = build_model(cfg, tensors)
    engine = engine_for(model, num_blocks=96, max_active=64, max_batched_tokens=64)
    blocks = engine.scheduler.blocks
    peak = 0

    class Watch:
        def __init__(self, inner) -> None:
            self.inner = inner
            self.vocab_size = inner.vocab_size

        def execute(self, batch, *, want_ids=False):
            nonlocal peak
            peak = max(peak, blocks.num_used_blocks)
            return self.inner.execute(batch)

    engine.runner = Watch(engine.runner)
    rng = random.Random(11)
    requests = [[rng.randrange(3, 250) for _ in range(rng.randint(10, 40))] for _ in range(64)]
    configs = [
        GenerationConfig(max_new_tokens=24, temperature=0.0, stop_token_ids=frozenset()) for _ in requests
    ]
    got = run_all(engine, requests, configs)
    assert all(len(tokens) == 24 for tokens in got)
    assert peak <= blocks.num_blocks and engine.scheduler.num_preemptions > 0
    assert blocks.num_used_blocks == 0
