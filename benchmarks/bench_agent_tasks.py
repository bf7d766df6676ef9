"""Eight small coding-agent tasks through the real Claude Code CLI, headless, against a served model.

Each task runs in a throwaway project folder (always the same path, emptied and refilled per
task: Claude Code's system prompt names the working directory, so a fixed path lets the server's
prefix cache carry the ~18,800-token system prompt and tool list from one task to the next).
A task is scored by the file system and the transcript, never by the model's words alone: a
value counts as read only when a tool result in the transcript carried it, an edit only when
the file (or a test run on it) says so.

Per variant (a set of extra `turbospark serve` flags) and task it reports: passed, turns, tool
calls made / valid (accepted by Claude Code's input validation) / rejected (calls the server
returned as text: `turbospark_tool_calls_total{outcome="returned_as_text"}`), the first
request's TTFT and the later requests' median TTFT (a loopback proxy times each
`/v1/messages` request to its first content_block_delta), and wall time.

    PYTHONPATH=src python benchmarks/bench_agent_tasks.py --model qwen2.5-coder:0.5b \\
        --variant constrained= --variant free=--no-constrained-calls [--tasks read_value,create_file]

Claude Code runs with DISABLE_TELEMETRY=1, a throwaway HOME, and only the tools a task needs
(Read/Write/Edit/Glob/Grep/LS and a few harmless Bash commands) allowed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from turbospark.testing import ServerProcess, claude_env, free_port

ALLOWED_TOOLS = [
    "Read",
    "Write",
    "Edit",
    "Glob",
    "Grep",
    "LS",
    "Bash(cat:*)",
    "Bash(ls:*)",
    "Bash(find:*)",
    "Bash(grep:*)",
    "Bash(echo:*)",
    "Bash(head:*)",
    "Bash(python:*)",
    "Bash(python3:*)",
]


# ---------------------------------------------------------------- the tasks


@dataclass
class Transcript:
    result: str  # Claude Code's final text
    num_turns: int
    tool_uses: list[dict[str, Any]]  # {name, input, id}
    tool_results: dict[str, tuple[str, bool]]  # tool_use id -> (content as text, is_error)

    def results_text(self) -> str:
        return "\n".join(text for text, _ in self.tool_results.values())


@dataclass(frozen=True)
class Task:
    name: str
    prompt: str
    files: dict[str, str]
    check: Callable[[Path, Transcript], bool]
    max_turns: int | None = None  # Claude Code's --max-turns; None: its own default


def _run(folder: Path, *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=60, check=False)


def _read(folder: Path, name: str) -> str:
    path = folder / name
    return path.read_text() if path.is_file() else ""


CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TEST_CALC = (
    "from calc import add, mul\n\nassert add(2, 3) == 5, add(2, 3)\nassert mul(2, 3) == 6\nprint('ok')\n"
)
UTIL = "def get_val(x):\n    return x * 7\n"
MAIN = "from util import get_val\n\nprint(get_val(6))\n"
GREETER = "def greet(name):\n    return 'Hi ' + name.upper() + '!'\n"

TASKS = [
    Task(
        "read_value",
        "What port does config.ini set? Answer with the number only.",
        {"config.ini": "[server]\nhost = 127.0.0.1\nport = 48213\nworkers = 3\n"},
        lambda d, t: "48213" in t.result and "48213" in t.results_text(),
    ),
    Task(
        "list_pattern",
        "List the names of all .py files in this folder and its subfolders.",
        {"alpha.py": "", "beta.py": "", "notes.txt": "", "readme.md": "", "pkg/gamma.py": ""},
        lambda d, t: (
            all(n in t.result for n in ("alpha.py", "beta.py", "gamma.py")) and "gamma.py" in t.results_text()
        ),
    ),
    Task(
        "fix_bug",
        "There is a one-line bug in calc.py. Fix it so that `python3 test_calc.py` passes.",
        {"calc.py": CALC, "test_calc.py": TEST_CALC},
        lambda d, t: (
            _read(d, "test_calc.py") == TEST_CALC and _run(d, "python3", "test_calc.py").returncode == 0
        ),
    ),
    Task(
        "rename",
        "Rename the function get_val to fetch_value everywhere: in util.py and in main.py.",
        {"util.py": UTIL, "main.py": MAIN},
        lambda d, t: (
            "get_val" not in _read(d, "util.py") + _read(d, "main.py")
            and "fetch_value" in _read(d, "util.py")
            and "fetch_value" in _read(d, "main.py")
            and _run(d, "python3", "main.py").stdout.strip() == "42"
        ),
    ),
    Task(
        "create_file",
        "Create a file named hello.txt containing exactly this text: Hello from the agent",
        {},
        lambda d, t: _read(d, "hello.txt").strip() == "Hello from the agent",
    ),
    Task(
        "run_command",
        "Run the command `python3 magic.py` and tell me exactly what it prints.",
        {"magic.py": "print(sum(range(1234)) * 3)\n"},
        # sum(range(1234)) * 3 = 2282283 (the check named 2284983 before: no run could pass it)
        lambda d, t: "2282283" in t.result and "2282283" in t.results_text(),
    ),
    Task(
        "answer_no_tools",
        "Do not use any tools. Here is greeter.py:\n\n```python\n"
        + GREETER
        + "```\n\nWhat does greet('bob') return? Answer with the exact string.",
        {"greeter.py": GREETER},
        lambda d, t: "Hi BOB!" in t.result and not t.tool_uses,
    ),
    Task(
        "read_then_edit",
        "Read version.txt, then write the version with its last number increased by one back into "
        "version.txt (so 1.4.2 would become 1.4.3).",
        {"version.txt": "2.7.9\n"},
        lambda d, t: _read(d, "version.txt").strip() == "2.7.10",
    ),
]


# ---------------------------------------------------------------- a timing proxy


@dataclass
class Exchange:
    path: str
    ttft_s: float | None
    wall_s: float
    status: int


class TimingProxy:
    """Forwards Claude Code's requests to the server and times each /v1/messages stream to its
    first content_block_delta (the chunk that resets Claude Code's idle timer)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: list[Exchange] = []
        # `--requests DIR`: each /v1/messages body is written to capture_to / NN.json (replays)
        self.capture_to: Path | None = None
        self.port = free_port()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                proxy.capture(self.path, body)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                started = time.monotonic()
                ttft = None
                with (
                    httpx.Client(timeout=httpx.Timeout(None)) as client,
                    client.stream(
                        self.command, proxy.upstream + self.path, content=body, headers=headers
                    ) as up,
                ):
                    self.send_response(up.status_code)
                    for key, value in up.headers.items():
                        if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                            self.send_header(key, value)
                    self.send_header("transfer-encoding", "chunked")
                    self.send_header("connection", "close")
                    self.end_headers()
                    for chunk in up.iter_raw():
                        if ttft is None and b"content_block_delta" in chunk:
                            ttft = time.monotonic() - started
                        if self.command != "HEAD":
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            self.wfile.flush()
                    if self.command != "HEAD":
                        self.wfile.write(b"0\r\n\r\n")
                if self.path.startswith("/v1/messages") and "count_tokens" not in self.path:
                    proxy.exchanges.append(
                        Exchange(self.path, ttft, time.monotonic() - started, up.status_code)
                    )

            do_GET = do_POST = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def capture(self, path: str, body: bytes) -> None:
        if self.capture_to is None or not path.startswith("/v1/messages") or "count_tokens" in path:
            return
        self.capture_to.mkdir(parents=True, exist_ok=True)
        number = len(list(self.capture_to.glob("*.json")))
        (self.capture_to / f"{number:02d}.json").write_bytes(body)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> TimingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------- running


@dataclass
class TaskRow:
    variant: str
    task: str
    passed: bool = False
    turns: int = 0
    calls: int = 0
    valid: int = 0
    rejected: int = 0
    requests: int = 0
    first_ttft_s: float | None = None
    later_ttft_s: float | None = None
    wall_s: float = 0.0
    error: str | None = None
    result: str = field(default="", repr=False)
    tools: str = ""  # the tools called, with counts, most called first ("Read x3, Agent x1")


def metric_sum(url: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if (line.startswith(name + "{") and label in line) or (not label and line.startswith(name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def parse_transcript(stdout: str) -> Transcript:
    result, turns = "", 0
    uses: list[dict[str, Any]] = []
    results: dict[str, tuple[str, bool]] = {}
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind = event.get("type")
        if kind == "result":
            result = event.get("result") or ""
            turns = int(event.get("num_turns") or 0)
        message = event.get("message") or {}
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else []:
            if block.get("type") == "tool_use" and kind == "assistant":
                uses.append({"name": block.get("name"), "input": block.get("input"), "id": block.get("id")})
            elif block.get("type") == "tool_result":
                body = block.get("content")
                if isinstance(body, list):
                    body = "\n".join(str(b.get("text", "")) for b in body if isinstance(b, dict))
                results[str(block.get("tool_use_id"))] = (str(body), bool(block.get("is_error")))
    return Transcript(result, turns, uses, results)


def run_task(
    task: Task,
    variant: str,
    model: str,
    proxy: TimingProxy,
    server_url: str,
    base: Path,
    timeout: float,
    transcripts: Path | None = None,
    requests: Path | None = None,
) -> TaskRow:
    row = TaskRow(variant, task.name)
    home, work = base / "home", base / "project"
    for folder in (home, work):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    for name, text in task.files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    env = claude_env(home, proxy.url, "local")
    env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] = str(int(timeout * 1000))
    rejects_before = metric_sum(server_url, "turbospark_tool_calls_total", 'outcome="returned_as_text"')
    first_exchange = len(proxy.exchanges)
    proxy.capture_to = requests / f"{variant}-{task.name}" if requests is not None else None
    started = time.monotonic()
    cmd = [
        "claude",
        "-p",
        task.prompt,
        "--model",
        f"claude-turbospark-{model}",
        "--output-format",
        "stream-json",
        "--verbose",
        *(["--max-turns", str(task.max_turns)] if task.max_turns else []),
        "--allowedTools",
        *ALLOWED_TOOLS,
    ]
    try:
        done = subprocess.run(
            cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
        stdout = done.stdout
        if done.returncode != 0:
            row.error = f"exit {done.returncode}: {done.stderr[-300:]}"
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        row.error = f"timed out after {timeout:.0f} s"
    row.wall_s = round(time.monotonic() - started, 1)
    if transcripts is not None:
        transcripts.mkdir(parents=True, exist_ok=True)
        (transcripts / f"{variant}-{task.name}.jsonl").write_text(stdout)
    transcript = parse_transcript(stdout)
    row.result = transcript.result[:300]
    row.turns = transcript.num_turns
    row.calls = len(transcript.tool_uses)
    counts = collections.Counter(str(use.get("name")) for use in transcript.tool_uses)
    row.tools = ", ".join(f"{name} x{n}" for name, n in counts.most_common())
    row.valid = sum(
        1
        for use in transcript.tool_uses
        if "InputValidationError" not in transcript.tool_results.get(str(use["id"]), ("", False))[0]
        and "No such tool available" not in transcript.tool_results.get(str(use["id"]), ("", False))[0]
    )
    row.rejected = int(
        metric_sum(server_url, "turbospark_tool_calls_total", 'outcome="returned_as_text"') - rejects_before
    )
    exchanges = proxy.exchanges[first_exchange:]
    row.requests = len(exchanges)
    ttfts = [e.ttft_s for e in exchanges if e.ttft_s is not None]
    if exchanges and exchanges[0].ttft_s is not None:
        row.first_ttft_s = round(exchanges[0].ttft_s, 1)
    if len(ttfts) > 1:
        row.later_ttft_s = round(statistics.median(ttfts[1:]), 1)
    try:
        row.passed = row.error is None and task.check(work, transcript)
    except Exception as exc:  # a check that cannot even run is a failed task
        row.error = f"check: {type(exc).__name__}: {exc}"
    return row


def run_variant(name: str, serve_args: str, args: argparse.Namespace, tasks: list[Task]) -> list[TaskRow]:
    rows: list[TaskRow] = []
    cache = {k: os.environ[k] for k in ("HOME", "TURBOSPARK_CACHE", "XDG_CACHE_HOME") if k in os.environ}
    extra = shlex.split(serve_args)
    server = ServerProcess("--model", args.model, *shlex.split(args.serve_args), *extra, env=cache)
    try:
        server.wait_healthy(timeout=900)  # loading competes with other work on a shared machine
    except BaseException:
        server.__exit__(None, None, None)
        raise
    with server, TimingProxy(server.url) as proxy, tempfile.TemporaryDirectory(prefix="agent-tasks-") as tmp:
        if args.warm_up:
            # Claude Code's ~18,800-token system prompt and tools, prefilled once before the timed
            # tasks (the prefix cache then carries it): a first prefill of minutes on a small CPU
            # would otherwise eat the first task's time limit. One turn: a model that answers it with
            # tool calls would otherwise go on calling tools for as long as the turn may last
            warm = Task("warm_up", "Reply with the word ready.", {}, lambda _w, _t: True, max_turns=1)
            row = run_task(warm, name, args.model, proxy, server.url, Path(tmp), 3600.0)
            print(f"{name}: warm-up turn {row.wall_s:.0f} s, first TTFT {row.first_ttft_s} s", flush=True)
        for task in tasks:
            row = run_task(
                task, name, args.model, proxy, server.url, Path(tmp), args.timeout, args.transcripts,
                args.requests,
            )  # fmt: skip
            rows.append(row)
            print(json.dumps(asdict(row)), flush=True)
    return rows


def table(rows: list[TaskRow]) -> str:
    head = f"{'variant':<14}{'task':<17}{'pass':>5}{'turns':>6}{'calls':>6}{'valid':>6}{'rej':>5}"
    head += f"{'ttft1 s':>9}{'ttft2+ s':>9}{'wall s':>8}  tools called"
    lines = [head]
    for r in rows:
        first = "-" if r.first_ttft_s is None else f"{r.first_ttft_s:.1f}"
        later = "-" if r.later_ttft_s is None else f"{r.later_ttft_s:.1f}"
        lines.append(
            f"{r.variant:<14}{r.task:<17}{'yes' if r.passed else 'no':>5}{r.turns:>6}{r.calls:>6}{r.valid:>6}"
            f"{r.rejected:>5}{first:>9}{later:>9}{r.wall_s:>8.0f}  {r.tools}"
        )
    for variant in dict.fromkeys(r.variant for r in rows):
        mine = [r for r in rows if r.variant == variant]
        passed, calls = sum(r.passed for r in mine), sum(r.calls for r in mine)
        lines.append(
            f"{variant}: {passed}/{len(mine)} passed, calls {calls} "
            f"(valid {sum(r.valid for r in mine)}, rejected as text {sum(r.rejected for r in mine)}), "
            f"wall {sum(r.wall_s for r in mine):.0f} s"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder:0.5b")
    ap.add_argument(
        "--variant",
        action="append",
        help="NAME=EXTRA_SERVE_FLAGS, repeatable (default: constrained= and free=--no-constrained-calls)",
    )
    ap.add_argument("--serve-args", default="", help="flags every variant's server gets")
    ap.add_argument("--tasks", help="comma-separated task names (default: all)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per task")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--transcripts", type=Path, help="write each task's Claude Code stream-json here (VARIANT-TASK.jsonl)"
    )
    ap.add_argument(
        "--requests",
        type=Path,
        help="write each /v1/messages request Claude Code sends here (VARIANT-TASK/NN.json), to replay",
    )
    ap.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="time the first task's first prefill too (by default one untimed turn runs first)",
    )
    args = ap.parse_args()
    if shutil.which("claude") is None:
        sys.exit("the claude CLI is not on PATH")
    tasks = TASKS
    if args.tasks:
        wanted = args.tasks.split(",")
        tasks = [t for t in TASKS if t.name in wanted]
    variants = args.variant or ["constrained=", "free=--no-constrained-calls"]
    print(f"{platform.machine()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, model {args.model}")
    rows: list[TaskRow] = []
    for spec in variants:
        name, _, flags = spec.partition("=")
        rows += run_variant(name, flags, args, tasks)
    print(table(rows))
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
