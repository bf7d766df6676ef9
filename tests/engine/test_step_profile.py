"""`serve --profile-steps N`: the engine's step profile (`turbospark.engine.profile`)."""

from __future__ import annotations

import logging
import threading

import pytest
from tiny_models import FAMILIES, checkpoint

from turbospark.backend import NEVER_CANCEL, GenerationConfig
from turbospark.engine.engine import Engine
from turbospark.engine.models import build_model
from turbospark.engine.profile import KINDS, PARTS, StepProfile, step_kind
from turbospark.engine.runner import ModelRunner
from turbospark.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from turbospark.engine.sequence import Sequence


def tiny_engine() -> Engine:
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=0)
    runner = ModelRunner(build_model(cfg, tensors), max_context=128, num_blocks=64, block_size=4)
    config = SchedulerConfig(max_active=4, max_batched_tokens=16, max_prefill_tokens=16)
    return Engine(runner, Scheduler(config, runner.block_manager), max_context=128, name="tiny")


def run(engine: Engine, num: int) -> None:
    """`num` requests at once, each from its own thread, until all are done."""
    threads = [
        threading.Thread(
            target=engine.run,
            args=(
                list(range(3 + i, 30 + i)),
                GenerationConfig(max_new_tokens=6),
                NEVER_CANCEL,
                lambda _: None,
            ),
        )
        for i in range(num)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


def test_a_profiled_engine_logs_and_reports_its_steps_split(caplog: pytest.LogCaptureFixture) -> None:
    engine = tiny_engine()
    assert engine.profile is None  # off unless asked for
    profile = engine.enable_profile(4)
    with caplog.at_level(logging.INFO, logger="turbospark.engine.profile"):
        run(engine, 6)
    engine.stop(wait=10)
    lines = [r.getMessage() for r in caplog.records if r.name == "turbospark.engine.profile"]
    assert lines and all(line.startswith("tiny: step profile over 4 steps") for line in lines)
    # 27-token prompts under a 16-token budget are chunked beside decodes: every kind but verify
    summary = profile.summary()
    assert {"decode", "all"} <= set(summary) <= {*KINDS, "all"}
    assert "prefill" in summary or "mixed" in summary
    assert (
        summary["all"]["steps"] == engine.num_steps == sum(summary[k]["steps"] for k in summary if k != "all")
    )
    for kind, r in summary.items():
        assert set(r["ms"]) == set(r["share"]) == set(PARTS), kind
        assert r["ms"]["forward"] > 0, kind
        assert all(v >= 0 for v in r["ms"].values()), kind
        assert sum(r["ms"].values()) <= r["total_ms"] * (1 + 1e-9), kind
        assert sum(r["share"].values()) <= 1 + 1e-9, kind
        assert r["fed_tokens"] >= r["generated_tokens"] > 0, kind
    assert summary["decode"]["fed_tokens"] == summary["decode"]["generated_tokens"]
    assert profile.last_window and profile.last_window["all"]["steps"] == 4


def test_a_reset_forgets_the_steps_so_far() -> None:
    engine = tiny_engine()
    profile = engine.enable_profile(1000)  # no window closes: the summary holds the open one
    run(engine, 2)
    assert profile.summary()["all"]["steps"] == engine.num_steps
    profile.reset()
    assert profile.summary() == {}
    run(engine, 1)
    engine.stop(wait=10)
    assert 0 < profile.summary()["all"]["steps"] < engine.num_steps


def batch_of(*rows: tuple[int, bool, int]) -> ScheduledBatch:
    batch = ScheduledBatch()
    for n, samples, drafts in rows:
        seq = Sequence(0, [1], 1, GenerationConfig(max_new_tokens=1), 1, NEVER_CANCEL, None)
        batch.seqs.append(seq)
        batch.num_new.append(n)
        batch.samples.append(samples)
        batch.num_draft.append(drafts)
    return batch


def test_step_kinds() -> None:
    assert step_kind(batch_of((1, True, 0), (1, True, 0))) == "decode"
    assert step_kind(batch_of((16, False, 0))) == "prefill"
    assert step_kind(batch_of((5, True, 0))) == "prefill"  # a prompt's last chunk
    assert step_kind(batch_of((1, True, 0), (12, False, 0))) == "mixed"
    assert step_kind(batch_of((1, True, 0), (4, True, 3))) == "verify"


def test_a_window_needs_a_step() -> None:
    with pytest.raises(ValueError):
        StepProfile(0)
