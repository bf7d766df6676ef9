"""The headline, as a user meets it: the real Claude Code CLI, run by `turbospark launch claude
--model qwen2.5-coder:0.5b -- -p ...`, against a fresh `turbospark serve --model
qwen2.5-coder:0.5b` with no other flag, on this CPU. (The launcher uses a server that answers on
its port as it is; that it starts one when none answers, and stops it after, is
tests/test_launch.py's, with a stand-in agent: a second real first turn would cost minutes.)

Claude Code's first request carries its system prompt and 24 tool schemas (18,755 Qwen tokens
as sent; 7,089 as a model under 4B parameters reads them by default, each description cut to its
lead: `serve --tool-descriptions auto`); it gives up when no content chunk arrives within 300 s,
so the first turn's prefill has to finish well inside that (`benchmarks/bench_agent.py` times it
request by request). Later requests reuse the cached prefix.

The session asks for a shell command. Claude Code declares 24 tools; a model under 4B
parameters reads only its shell and file tools (`serve --tool-focus auto`: Bash, Read, Write, Edit,
Glob, Grep), and every call it starts is held to a declared tool's schema (the lazy call
constraint). Before the focus the 0.5B model picked among all 24 and called Agent, Skill or
CronCreate; with it, it called Bash with `cat notes.txt` first in each of six runs (Zen 4 EPYC;
what it does after the result varies: Claude Code samples). So the test holds the round trip: a
Bash call ran `cat notes.txt` and its output, the file's marker, went back to the model (or, for a
call it asked to run in the background, reached the output file Claude Code names in the result);
besides, the session ends without an API error and every tool call Claude Code received passed
its input validation. The session stays bounded (`--max-turns`, and no Agent tool: a subagent's
turns do not count toward that bound).

The first turn took 244-262 s to its first token on a 2-core AVX2 machine, inside Claude Code's
default 300 s stream-idle limit but not by much; the launcher raises that limit
(`CLAUDE_STREAM_IDLE_TIMEOUT_MS`) so a slower or busier CI machine checks the session's
correctness, not its speed. The timing is `benchmarks/bench_agent.py`'s job.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from turbospark.engine.pull import pulled_path
from turbospark.testing import ServerProcess, claude_env

LAUNCH = [sys.executable, "-m", "turbospark", "launch", "claude"]

MODEL = "qwen2.5-coder:0.5b"
MARKER = "turbospark-notes-4711"
# generous: the first turn prefills ~7,100 tokens on two cores, the follow-ups are cached
CLAUDE_TIMEOUT_S = 1200
MAX_TURNS = 4  # tool rounds of the main session; a first turn and a few cached follow-ups

pytestmark = [
    pytest.mark.slow,
    pytest.mark.claude,
    pytest.mark.skipif(
        pulled_path(MODEL) is None and not os.environ.get("TURBOSPARK_REQUIRE_MODELS"),
        reason=f"run `python -m turbospark.engine.pull {MODEL}` first",
    ),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """`turbospark serve --model qwen2.5-coder:0.5b` on a free loopback port, no other flag."""
    cache = {k: os.environ[k] for k in ("HOME", "TURBOSPARK_CACHE", "XDG_CACHE_HOME") if k in os.environ}
    with ServerProcess("--model", MODEL, env=cache) as served:
        yield served


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (all label sets) from /metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run_or_report(server: ServerProcess, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """subprocess.run, failing a run past its timeout with what the server was doing."""
    try:
        return subprocess.run(argv, **kwargs)
    except subprocess.TimeoutExpired as late:
        pytest.fail(f"{argv[:3]} ran past {late.timeout:.0f} s; the server:\n{server.what_it_does()}")


def test_claude_code_session_on_qwen_05b_with_default_flags(
    claude: str, server: ServerProcess, tmp_path: Path
) -> None:
    url = server.url
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "notes.txt").write_text(f"{MARKER}\n")
    env = claude_env(home, url, "local")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent / "src")
    started = time.monotonic()
    done = run_or_report(
        server,
        [
            *LAUNCH,
            "--model",
            MODEL,
            "--port",
            str(server.port),
            "--",
            "-p",
            "Run the shell command: cat notes.txt",
            "--allowedTools",
            "Bash",
            "--max-turns",
            str(MAX_TURNS),
            "--disallowedTools",
            "Agent",  # a subagent's own turns are not bounded by --max-turns
            "--output-format",
            "json",
        ],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CLAUDE_TIMEOUT_S,
    )
    elapsed = time.monotonic() - started
    lines = done.stdout.strip().splitlines()
    server_log = server.log()[-3000:]
    assert lines, f"claude printed nothing (exit {done.returncode}): {done.stderr[-2000:]}\n{server_log}"
    result: dict[str, Any] = json.loads(lines[-1])
    print(json.dumps({"elapsed_s": round(elapsed, 1), **result})[:3000])  # the transcript's summary
    assert result["type"] == "result", (result, server_log)
    assert f"claude on {MODEL} at {url}" in done.stderr  # the launcher used the running server
    if result["subtype"] == "success":
        assert result["is_error"] is False and done.returncode == 0, (result, done.stderr[-2000:])
    else:  # the model kept calling tools
        assert result["subtype"] == "error_max_turns", (result, server_log)
    assert "API Error" not in str(result.get("result")), result
    requests = metric(url, "turbospark_engine_requests_total")  # generations the engine ran
    uses, outcomes = transcript(home, result["session_id"])
    print(json.dumps({"tool_uses": uses, "tool_results": outcomes})[:3000])
    # each tool result went back to the model, but the last when the turns ran out
    assert requests >= len(outcomes) + (result["subtype"] == "success")
    for outcome in outcomes.values():
        assert "InputValidationError" not in outcome["text"], outcome
    round_trips = 0
    for use_id, use in uses.items():
        ran = outcomes.get(use_id)
        if use["name"] == "Bash" and "notes.txt" in str(use["input"]) and ran and not ran["is_error"]:
            assert MARKER in command_output(use, ran), (use, ran)
            round_trips += 1
    # the headline: the model ran the command through Bash and its output went back to it
    assert round_trips >= 1, (uses, outcomes)


def command_output(use: dict[str, Any], ran: dict[str, Any]) -> str:
    """What a Bash call printed: its result's text, or, for a call the model asked to run in the
    background, the output file Claude Code names by task id under its temporary folder (the
    result then says only where the output goes)."""
    background = re.search(r"running in background with ID: (\w+)", ran["text"])
    if not (isinstance(use["input"], dict) and use["input"].get("run_in_background") and background):
        return str(ran["text"])
    task_id = background.group(1)
    deadline = time.monotonic() + 30  # `cat` is done at once; the file may trail the session by a moment
    while True:
        found = list(Path(tempfile.gettempdir()).glob(f"claude-*/**/tasks/{task_id}.output"))
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(found) == 1, f"no output file for background task {task_id}: {ran['text']}"
    return found[0].read_text(encoding="utf-8", errors="replace")


def transcript(home: Path, session: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The session's tool calls (id -> name, input) and their results (id -> is_error, text), from
    the transcript Claude Code writes under its home."""
    (path,) = home.glob(f".claude/projects/*/{session}.jsonl")
    uses: dict[str, Any] = {}
    outcomes: dict[str, Any] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        content = (json.loads(line).get("message") or {}).get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "tool_use":
                uses[part["id"]] = {"name": part["name"], "input": part.get("input")}
            elif part.get("type") == "tool_result":
                body = part.get("content")
                text = body if isinstance(body, str) else json.dumps(body)
                outcomes[part["tool_use_id"]] = {"is_error": bool(part.get("is_error")), "text": text}
    return uses, outcomes
