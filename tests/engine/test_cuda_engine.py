"""The batched engine on CUDA: Triton paged attention, CUDA-graph decode steps, the same tokens
as one request at a time on the eager path. Runs on a CUDA device (marker `gpu`)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_engine import prompts
from tiny_models import FAMILIES, checkpoint

from turbospark.backend import NEVER_CANCEL, GenerationConfig
from turbospark.engine.engine import Engine
from turbospark.engine.models import build_model
from turbospark.engine.runner import ModelRunner
from turbospark.engine.scheduler import Scheduler, SchedulerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_on_cuda_equals_one_at_a_time(family: str) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES[family], seed=1, init_std=1.0)
    model = build_model(cfg, tensors, "cuda", torch.bfloat16)
    requests = prompts(seed=2, num=8)
    configs = [GenerationConfig(max_new_tokens=12 + i, temperature=0.0) for i in range(len(requests))]
    reference = ModelRunner(model, max_context=128, block_size=16, device="cuda", cuda_graphs=False)
    want = [
        reference.generate(p, c, NEVER_CANCEL, lambda _: None).token_ids
        for p, c in zip(requests, configs, strict=True)
    ]
    runner = ModelRunner(model, max_context=128, num_blocks=64, block_size=16, device="cuda")
    assert runner.graphs is not None
    engine = Engine(
        runner,
        Scheduler(SchedulerConfig(max_batched_tokens=32, max_prefill_tokens=32), runner.block_manager),
        max_context=128,
        name="cuda",
    )
    got: list[list[int] | None] = [None] * len(requests)

    def one(i: int) -> None:
        got[i] = engine.run(requests[i], configs[i], NEVER_CANCEL, lambda _: None).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == want
    assert engine.scheduler.num_prefix_hit_tokens > 0
    assert runner.block_manager.num_used_blocks == 0


def test_seeded_sampling_on_cuda_reproduces() -> None:
    cfg, tensors, _ = checkpoint(FAMILIES["qwen2"], seed=1, init_std=1.0)
    model = build_model(cfg, tensors, "cuda", torch.bfloat16)
    runner = ModelRunner(model, max_context=128, num_blocks=64, block_size=16, device="cuda")
    engine = Engine(runner, Scheduler(SchedulerConfig(), runner.block_manager), max_context=128, name="cuda")
    prompt = prompts(seed=3, num=1)[0]

    def run(**kwargs: object) -> list[int]:
        config = GenerationConfig(max_new_tokens=16, **kwargs)  # type: ignore[arg-type]
        return engine.run(prompt, config, NEVER_CANCEL, lambda _: None).token_ids

    first = run(temperature=0.9, seed=7)
    assert run(temperature=0.9, seed=7) == first
    assert run(temperature=0.9, seed=8) != first
    filtered = run(temperature=0.9, seed=7, top_k=5, top_p=0.8)  # masked on the GPU first
    assert len(filtered) == 16 and all(0 <= t < cfg["vocab_size"] for t in filtered)
    engine.stop(wait=5.0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_speculation_on_cuda_gives_plain_decodings_tokens(family: str) -> None:
    """Verifications of random accept lengths (the oracle's drafts, half of them corrupted) run
    through the CUDA graph runner (mixed steps piecewise): the tokens of plain decoding on the same
    runner, every block back."""
    from test_engine import run_all
    from test_speculative import OracleProposer

    from turbospark.engine.speculative import SpeculativeConfig, Speculator

    cfg, tensors, _ = checkpoint(FAMILIES[family], seed=1, init_std=1.0)
    model = build_model(cfg, tensors, "cuda", torch.bfloat16)
    requests = prompts(seed=4, num=6)
    configs = [GenerationConfig(max_new_tokens=24, temperature=0.0) for _ in requests]

    def engine_of(speculator: Speculator | None) -> Engine:
        runner = ModelRunner(
            model, max_context=128, num_blocks=64, block_size=16, device="cuda", max_step_tokens=64
        )
        scheduler = Scheduler(
            SchedulerConfig(max_active=6, max_batched_tokens=64, max_prefill_tokens=64), runner.block_manager
        )
        return Engine(runner, scheduler, max_context=128, name="cuda-spec", speculator=speculator)

    plain = engine_of(None)
    want = run_all(plain, requests, configs)
    plain.stop(wait=5.0)
    speculator = Speculator(SpeculativeConfig(num_tokens=5, max_batch=8))
    speculator.proposer = OracleProposer({tuple(p): w for p, w in zip(requests, want, strict=True)}, 3)
    engine = engine_of(speculator)
    assert engine.runner.graphs is not None
    got = run_all(engine, requests, configs)
    engine.stop(wait=5.0)
    assert got == want
    assert 0 < speculator.num_accepted < speculator.num_proposed
    engine.scheduler.check()
    assert engine.scheduler.blocks.num_used_blocks == 0
