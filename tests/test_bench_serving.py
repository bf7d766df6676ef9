"""`benchmarks/bench_serving.py --offline`: the request set straight into the served engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench_serving.py"


def bench(tmp_path: Path, serve: str, *args: str, timeout: float = 300) -> tuple[dict[str, Any], str]:
    """Runs the benchmark as a user does; returns its --result-json and its output."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(BENCH), "--serve", serve, "--result-json", str(out), *args]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout + done.stderr


def check_offline(result: dict[str, Any], num_prompts: int, output_len: int) -> dict[str, Any]:
    offline = next(s for s in result["scenarios"] if s["scenario"] == "offline")
    assert offline["completed"] == num_prompts and offline["failed"] == 0
    assert 0 < offline["output_tokens"] <= num_prompts * output_len
    assert offline["input_tokens"] > 0
    assert offline["output_throughput"] > 0 and offline["input_throughput"] > 0
    assert offline["engine_steps"] > 0 and offline["engine_step_ms"] > 0
    assert offline["tokens_per_step"] > 0
    return offline


def test_offline_runs_the_scripted_engine_with_its_step_profile(tmp_path: Path) -> None:
    args = ("--offline", "--concurrency", "", "--num-prompts", "8", "--input-len", "32", "--output-len", "16")
    result, output = bench(tmp_path, "--model scripted --profile-steps 4", *args)
    offline = check_offline(result, 8, 16)
    assert result["model"] == "scripted" and len(result["scenarios"]) == 1
    assert "http_over_offline" not in result  # no HTTP scenario ran
    profile = offline["step_profile"]
    assert profile["all"]["steps"] == offline["engine_steps"]  # the warm-up's steps are not in it
    assert profile["all"]["ms"]["forward"] > 0
    assert "step profile over 4 steps" in output  # the engine's log, every 4 steps
    assert "engine step profile over the offline requests" in output


@pytest.mark.slow
def test_http_and_offline_in_one_run_give_their_ratio(tmp_path: Path) -> None:
    args = (
        "--offline",
        "--concurrency",
        "4",
        "--num-prompts",
        "8",
        "--input-len",
        "32",
        "--output-len",
        "16",
    )
    result, output = bench(tmp_path, "--model scripted", *args)
    check_offline(result, 8, 16)
    http = next(s for s in result["scenarios"] if s["scenario"] == "concurrency 4")
    assert http["completed"] == 8
    ratio = result["http_over_offline"]["concurrency 4"]["output_throughput"]
    offline = next(s for s in result["scenarios"] if s["scenario"] == "offline")
    assert ratio == pytest.approx(http["output_throughput"] / offline["output_throughput"])
    assert "HTTP / offline" in output
    assert "step_profile" not in offline  # no --profile-steps


@pytest.mark.slow
def test_offline_runs_the_default_model(tmp_path: Path) -> None:
    """The packaged SmolLM2 that `serve` loads by default, bounded to a few prompts and tokens."""
    args = ("--offline", "--concurrency", "", "--num-prompts", "4", "--input-len", "16", "--output-len", "8")
    result, _ = bench(tmp_path, "--model smollm2 --max-active 4 --profile-steps 8", *args)
    offline = check_offline(result, 4, 8)
    assert result["model"] == "smollm2"
    assert offline["step_profile"]["decode"]["ms"]["forward"] > 0
    assert offline["step_profile"]["decode"]["ms"]["inputs"] > 0  # the runner's inputs, timed apart
