"""Same request, same tokens on the CPU: a greedy or seeded request gives the tokens it gives
alone and cold, when its prompt comes from the prefix cache, when it is chunked differently,
and when it shares the batch with 7 others (`engine/row_kernels.py`). On the tiny random models
(float32 and quantized the way the server quantizes) and on the packaged SmolLM2 as served.

The tests hold whatever path this CPU runs: the native kernels where they build (x86 with
AVX2), torch's kernels elsewhere; `test_torch_kernels_are_reproducible_too` runs the torch path
with the native kernels off in a subprocess, so both are held on an x86 CI machine.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading

import pytest
import torch
from tiny_models import FAMILIES, checkpoint

from turbospark.backend import NEVER_CANCEL, GenerationConfig
from turbospark.engine import row_kernels
from turbospark.engine.engine import Engine
from turbospark.engine.models import build_model
from turbospark.engine.runner import ModelRunner
from turbospark.engine.scheduler import Scheduler, SchedulerConfig

GREEDY = GenerationConfig(max_new_tokens=24, temperature=0.0)
SEEDED = GenerationConfig(max_new_tokens=24, temperature=1.0, top_k=0, top_p=1.0, seed=7)


def engine_for(model: torch.nn.Module, budget: int, kv_dtype: torch.dtype | None = None) -> Engine:
    runner = ModelRunner(model, max_context=256, num_blocks=512, block_size=4, kv_dtype=kv_dtype)
    config = SchedulerConfig(max_active=8, max_batched_tokens=budget, max_prefill_tokens=budget)
    return Engine(runner, Scheduler(config, runner.block_manager), max_context=256, name="test")


def run(engine: Engine, prompt: list[int], config: GenerationConfig) -> list[int]:
    return engine.run(prompt, config, NEVER_CANCEL, lambda _: None).token_ids


def run_together(
    engine: Engine, prompts: list[list[int]], configs: list[GenerationConfig]
) -> list[list[int]]:
    """Every request submitted at once from its own thread: prompts chunked between decodes."""
    out: list[list[int] | None] = [None] * len(prompts)

    def one(i: int) -> None:
        out[i] = run(engine, prompts[i], configs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def every_way(
    make_engine: object, prompt: list[int], others: list[list[int]], config: GenerationConfig
) -> dict[str, list[int]]:
    """The request's tokens cold, prefix-cached (after itself and after a request sharing most
    of it), chunked small, and batched with the others (decoding while it prefills)."""
    assert callable(make_engine)
    seen: dict[str, list[int]] = {}
    engine = make_engine(64)
    seen["cold"] = run(engine, prompt, config)
    seen["cached, same prompt"] = run(engine, prompt, config)
    engine = make_engine(64)
    run(engine, [*prompt[: len(prompt) - 5], 11, 12, 13], GREEDY)  # shares all but the tail
    seen["cached, shared prefix"] = run(engine, prompt, config)
    seen["chunks of 3"] = run(make_engine(3), prompt, config)
    seen["chunks of 7"] = run(make_engine(7), prompt, config)
    batch = [*others[:4], prompt, *others[4:7]]
    configs = [GenerationConfig(max_new_tokens=8 + 3 * i, temperature=0.0) for i in range(8)]
    configs[4] = config
    seen["batched with 7"] = run_together(make_engine(16), batch, configs)[4]
    return seen


def random_prompts(seed: int, num: int, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(9, 50))] for _ in range(num)]


@pytest.mark.skipif(not row_kernels.reproducible(), reason="run with $TURBOSPARK_FAST_NONDETERMINISTIC")
@pytest.mark.parametrize("quant", [None, "int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_request_gives_the_same_tokens_every_way(family: str, quant: str | None) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES[family], seed=5, init_std=0.3)
    model = build_model(cfg, tensors, "cpu", torch.float32, quant=quant)
    kv = torch.float16 if quant else None  # as served on an AVX2 CPU

    def make(budget: int) -> Engine:
        return engine_for(model, budget, kv)

    prompts = random_prompts(seed=6, num=8)
    for config in (GREEDY, SEEDED):
        seen = every_way(make, prompts[0], prompts[1:], config)
        assert len(seen["cold"]) == config.max_new_tokens
        assert all(tokens == seen["cold"] for tokens in seen.values()), seen


@pytest.mark.skipif(not row_kernels.reproducible(), reason="run with $TURBOSPARK_FAST_NONDETERMINISTIC")
def test_a_later_turn_repeating_an_answer_gives_the_cold_tokens() -> None:
    """A conversation's next prompt holds the answer just generated: its keys came from the
    decode kernels, so it is computed again as a prompt, as a cold request computes it."""
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=5, init_std=0.3)
    model = build_model(cfg, tensors, "cpu", torch.float32, quant="int4")
    first = random_prompts(seed=8, num=1)[0]
    engine = engine_for(model, 64, torch.float16)
    answer = run(engine, first, GREEDY)
    turn = [*first, *answer, 20, 21, 22]
    warm = run(engine, turn, GREEDY)
    assert engine.scheduler.num_prefix_hit_tokens >= len(first) // 4 * 4  # the prompt was reused
    assert warm == run(engine_for(model, 64, torch.float16), turn, GREEDY)


@pytest.mark.skipif(not row_kernels.reproducible(), reason="run with $TURBOSPARK_FAST_NONDETERMINISTIC")
def test_torch_kernels_are_reproducible_too() -> None:
    """The same checks with the native kernels off (torch's kernels, which any CPU runs), in a
    process of their own: the CPU profile is fixed per process."""
    env = {**os.environ, "TURBOSPARK_NATIVE_KERNELS": "0"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "llama-int4 or qwen2-int8",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.dirname(__file__),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(not row_kernels.reproducible(), reason="run with $TURBOSPARK_FAST_NONDETERMINISTIC")
def test_smollm2_as_served_gives_the_same_tokens_every_way() -> None:
    """The packaged model loaded as `serve` loads it (int4, the CPU profile's activations and
    KV cache), each way on a fresh runner (an empty cache) over that one model."""
    pytest.importorskip("turbospark.engine.loader", reason="the checkpoint loader is not installed")
    from turbospark.engine.backend import load_backend

    backend = load_backend("smollm2", progress=False, max_context=512, kv_cache_gb=0.05)
    served = backend._runner
    model, kv_dtype = served.model, served.kv_cache.k.dtype

    def make(budget: int) -> Engine:
        return engine_for(model, budget, kv_dtype)

    texts = [
        "Tell me a story about a cat.",
        "What is 2 + 2?",
        "Name a color.",
        "Say hi.",
        "Write a haiku about rain.",
        "List three fruits.",
        "Who wrote Hamlet?",
        "Count to five.",
    ]
    tokenizer = backend._tokenizer
    prompts = [tokenizer.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n") for t in texts]
    for config in (GREEDY, SEEDED):
        seen = every_way(make, prompts[0], prompts[1:], config)
        assert all(tokens == seen["cold"] for tokens in seen.values()), seen
