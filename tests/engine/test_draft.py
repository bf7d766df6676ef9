"""Speculation with a draft model (`--speculative draft:MODEL`, `engine/draft.py`): the target
verifies, so the tokens are plain decoding's whatever the draft proposes; a draft that tokenizes
otherwise is refused by name; the draft's cache is given back as sequences end."""

from __future__ import annotations

import pytest
import torch
from test_engine import prompts, run_all
from tiny_models import FAMILIES, checkpoint

from turbospark.backend import NEVER_CANCEL, GenerationConfig
from turbospark.engine.draft import DraftProposer
from turbospark.engine.engine import Engine
from turbospark.engine.models import build_model
from turbospark.engine.pull import pulled_path
from turbospark.engine.runner import ModelRunner
from turbospark.engine.scheduler import Scheduler, SchedulerConfig
from turbospark.engine.speculative import SpeculativeConfig, Speculator, parse_speculative

QWEN = "qwen2.5-coder:0.5b"


def _engine(model: torch.nn.Module, speculator: Speculator) -> Engine:
    runner = ModelRunner(model, max_context=128, num_blocks=128, block_size=4)
    config = SchedulerConfig(max_active=4, max_batched_tokens=32, max_prefill_tokens=32)
    return Engine(
        runner, Scheduler(config, runner.block_manager), max_context=128, name="t", speculator=speculator
    )


@pytest.mark.parametrize("draft_seed", [5, 9])
def test_a_draft_model_changes_the_speed_never_the_tokens(draft_seed: int) -> None:
    """Draft = target (seed 5: nearly every draft accepted) or another random model of the same
    vocabulary (seed 9: most rejected): greedy tokens equal plain decoding's either way, batched,
    with prompts chunked, and every draft cache block is back once the requests end."""
    cfg, tensors, _ = checkpoint(FAMILIES["qwen2"], seed=5, init_std=1.0)
    target = build_model(cfg, tensors)
    dcfg, dtensors, _ = checkpoint(FAMILIES["qwen2"], seed=draft_seed, init_std=1.0)
    draft_runner = ModelRunner(build_model(dcfg, dtensors), max_context=128, num_blocks=4 * 32, block_size=4)
    requests = prompts(seed=21, num=6)
    configs = [GenerationConfig(max_new_tokens=24, temperature=0.0) for _ in requests]
    reference = ModelRunner(target, max_context=128, block_size=4)
    want = [
        reference.generate(p, c, NEVER_CANCEL, lambda _: None).token_ids
        for p, c in zip(requests, configs, strict=True)
    ]
    speculator = Speculator(SpeculativeConfig(method="draft", draft_model="tiny", num_tokens=4, max_batch=4))
    speculator.proposer = DraftProposer(draft_runner, max_seqs=4)
    engine = _engine(target, speculator)
    assert run_all(engine, requests, configs) == want
    assert speculator.num_proposed > 0
    rate = speculator.num_accepted / speculator.num_proposed
    assert rate > 0.9 if draft_seed == 5 else rate < 0.5
    engine.step()  # a step with nothing running: the proposer lets the ended sequences' caches go
    assert draft_runner.block_manager.num_used_blocks == 0


@pytest.mark.slow
@pytest.mark.skipif(pulled_path(QWEN) is None, reason=f"run `turbospark pull {QWEN}` first")
def test_load_backend_refuses_a_draft_of_another_tokenizer_and_runs_one_of_the_same() -> None:
    from turbospark.engine.backend import load_backend

    with pytest.raises(ValueError, match="does not tokenize as"):
        load_backend(
            "smollm2", progress=False, max_context=512, speculative=parse_speculative(f"draft:{QWEN}")
        )
    backend = load_backend(
        QWEN, progress=False, max_context=1024, speculative=parse_speculative(f"draft:{QWEN}")
    )
    try:
        prompt = backend.tokenizer.encode(
            "<|im_start|>user\nList the days of the week.<|im_end|>\n<|im_start|>assistant\n"
        )
        config = GenerationConfig(max_new_tokens=40, temperature=0.0)
        speculator = backend.engine.speculator
        assert speculator is not None and isinstance(speculator.proposer, DraftProposer)
        with_draft = backend.engine.run(prompt, config, NEVER_CANCEL, lambda _: None).token_ids
        assert speculator.num_accepted > 0.8 * speculator.num_proposed > 0  # it drafts for itself
        backend.engine.speculator = None
        assert backend.engine.run(prompt, config, NEVER_CANCEL, lambda _: None).token_ids == with_draft
    finally:
        backend.close()
