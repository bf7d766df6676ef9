"""`turbospark launch claude`: the missing-CLI message, the model it picks by context, the agent
environment it execs with, and the server it starts when none answers. The real Claude Code turn
through launch is tests/test_claude_code_real.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from store_models import write_tiny_hf
from turbospark import cli
from turbospark.launch import AGENT_MIN_CONTEXT, LaunchError, pick_model
from turbospark.scripted import ScriptedChatModel
from turbospark.store import ModelStore
from turbospark.testing import LiveServer, free_port

LAUNCH = [sys.executable, "-m", "turbospark", "launch", "claude"]
SRC = str(Path(__file__).resolve().parent.parent / "src")


def test_missing_agent_cli_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no claude here
    assert cli.main(["launch", "claude", "--model", "smollm2"]) == 127
    err = capsys.readouterr().err
    assert "'claude' command is not on PATH" in err and "npm install -g @anthropic-ai/claude-code" in err


@pytest.mark.slow
def test_picks_the_smallest_model_whose_context_holds_the_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path / "cache"))
    write_tiny_hf(tmp_path / "short", max_positions=2048)
    store = ModelStore([tmp_path], packaged=False)
    with pytest.raises(LaunchError, match=r"turbospark pull qwen2\.5-coder:0\.5b"):
        pick_model(store)
    write_tiny_hf(tmp_path / "long", max_positions=AGENT_MIN_CONTEXT)
    assert pick_model(store) == "long"


def test_execs_the_agent_with_every_tier_on_the_local_model(tmp_path: Path) -> None:
    """A stand-in `claude` on PATH records the argv and environment launch execs it with."""
    record = tmp_path / "record.json"
    fake = tmp_path / "bin" / "claude"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    with LiveServer([ScriptedChatModel()]) as server:
        done = subprocess.run(
            [*LAUNCH, "--model", "scripted", "--port", str(server.port), "--", "-p", "say hi"],
            env={"PATH": f"{fake.parent}:{os.environ['PATH']}", "PYTHONPATH": SRC, "HOME": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    seen = json.loads(record.read_text())
    alias = "claude-turbospark-scripted"
    assert seen["argv"] == ["--model", alias, "-p", "say hi"]
    env = seen["env"]
    assert env["ANTHROPIC_BASE_URL"] == server.url
    assert env["ANTHROPIC_API_KEY"]
    for tier in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "ANTHROPIC_SMALL_FAST_MODEL",
        "CLAUDE_CODE_SUBAGENT_MODEL",
    ):
        assert env[tier] == alias, tier
    assert env["DISABLE_TELEMETRY"] == "1" and env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"


def test_starts_a_server_when_none_answers_and_stops_it_after(tmp_path: Path) -> None:
    """No server on the port: launch starts one for the model, the agent talks to it, and the
    server is gone once the agent exits."""
    record = tmp_path / "record.json"
    fake = tmp_path / "bin" / "claude"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys, urllib.request\n"
        "body = urllib.request.urlopen(os.environ['ANTHROPIC_BASE_URL'] + '/v1/models').read()\n"
        f"open({str(record)!r}, 'wb').write(body)\n"
    )
    fake.chmod(0o755)
    port = free_port()
    done = subprocess.run(
        [*LAUNCH, "--model", "scripted", "--port", str(port)],
        env={
            "PATH": f"{fake.parent}:{os.environ['PATH']}",
            "PYTHONPATH": SRC,
            "HOME": str(tmp_path),
            "TURBOSPARK_CACHE": str(tmp_path / "cache"),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "started a server for scripted" in done.stderr
    ids = {m["id"] for m in json.loads(record.read_text())["data"]}
    assert "claude-turbospark-scripted" in ids
    with pytest.raises(OSError):  # stopped with the agent
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_codex_command_points_at_the_server_and_turns_off_what_reaches_out() -> None:
    from turbospark.launch import agent_command

    argv = agent_command("codex", "codex", "http://127.0.0.1:8000", "qwen2.5-coder:0.5b", {}, context=32768)
    overrides = argv[2::2]
    assert argv[0] == "codex" and set(argv[1::2]) == {"-c"}
    assert 'model="qwen2.5-coder:0.5b"' in overrides and 'model_provider="turbospark"' in overrides
    assert any('base_url = "http://127.0.0.1:8000/v1"' in o for o in overrides)
    # no plugin marketplace clone from github, no analytics, no update check
    for off in ("features.plugins=false", "features.remote_plugin=false", "analytics.enabled=false"):
        assert off in overrides
    assert "model_context_window=32768" in overrides
