"""`turbospark serve` as a user starts it: a subprocess on loopback, health, defaults from flags."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from turbospark.testing import free_port

SRC = Path(__file__).resolve().parent.parent / "src"


def spawn(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "turbospark", "serve", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(
        cmd, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, stderr=subprocess.PIPE
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "server exited"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server never became healthy")


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[str]:
    proc, url = spawn(*request.param)
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()


@pytest.mark.parametrize("served", [["--model", "scripted", "--system", "Answer in French."]], indirect=True)
def test_serve_scripted_with_default_system(served: str) -> None:
    with openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content and "scripted demo" in reply.choices[0].message.content
        health = httpx.get(served + "/health").json()
        assert health["status"] == "ok" and health["models"] == ["scripted"]


def test_bad_model_spec_exits_with_its_reason(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    proc, _ = spawn("--model", str(missing))
    try:
        assert proc.wait(timeout=60) != 0
        assert proc.stderr is not None
        assert "nope.gguf" in proc.stderr.read().decode()
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr:
            proc.stderr.close()


def test_terminal_chat_streams_replies() -> None:
    cmd = [sys.executable, "-m", "turbospark", "chat", "--model", "scripted"]
    done = subprocess.run(
        cmd,
        input=b"hello\n/reset\nagain\n/quit\n",
        capture_output=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC)},
    )
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    assert out.count("scripted demo model") == 2
    assert out.startswith("turbospark chat with scripted")


@pytest.mark.parametrize(
    ("value", "says"), [("draft:", "name the draft model"), ("eagle", "expected one of")]
)
def test_an_unknown_speculative_method_exits_naming_it(value: str, says: str) -> None:
    proc, _ = spawn("--model", "smollm2", "--speculative", value)
    try:
        assert proc.wait(timeout=60) != 0
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        assert value in err and says in err
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr:
            proc.stderr.close()


KERNEL_OPTIONS = (
    "--cpu-kernels",
    "--native-kernels",
    "--native-vnni",
    "--no-native-vnni",
    "--hugepages",
    "--no-hugepages",
    "--fast-nondeterministic",
    "--no-fast-nondeterministic",
    "--pool-steal",
    "--no-pool-steal",
)


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_help_lists_the_kernel_options_and_their_variables(command: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "turbospark", command, "--help"],
        capture_output=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC), "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    for option in KERNEL_OPTIONS:
        assert option in out
    assert "{auto,avx2,float32,bf16,bf16-native}" in out and "{auto,on,off}" in out
    assert "$TURBOSPARK_CPU_KERNELS" in out and "$TURBOSPARK_POOL_STEAL" in out


def test_kernel_options_set_the_process_settings_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from turbospark.cli import configure_kernels, parser
    from turbospark.engine import kernel_settings

    monkeypatch.setenv("TURBOSPARK_CPU_KERNELS", "float32")
    monkeypatch.setenv("TURBOSPARK_HUGEPAGES", "0")
    args = parser().parse_args(
        [
            "serve",
            "--cpu-kernels",
            "avx2",
            "--native-kernels",
            "off",
            "--no-pool-steal",
            "--fast-nondeterministic",
        ]
    )
    try:
        settings = configure_kernels(args)
        assert settings == kernel_settings.current()
        assert (settings.cpu_kernels, settings.native_kernels) == ("avx2", "off")
        assert not settings.pool_steal and settings.fast_nondeterministic
        assert not settings.hugepages and settings.native_vnni  # environment, default
        defaults = configure_kernels(parser().parse_args(["serve"]))  # none given
        assert defaults.cpu_kernels == "float32" and not defaults.fast_nondeterministic
    finally:
        kernel_settings.configure()


def test_a_bad_kernel_variable_stops_serve_naming_it() -> None:
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "turbospark", "serve", "--port", str(port), "--model", "scripted"],
        capture_output=True,
        timeout=60,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "TURBOSPARK_NATIVE_KERNELS": "maybe"},
    )
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert "TURBOSPARK_NATIVE_KERNELS='maybe'" in err and "auto, on, off" in err


def test_profile_steps_turns_the_engines_step_profile_on() -> None:
    import logging

    from turbospark import cli
    from turbospark.engine.profile import log as profile_log

    parser = cli.parser()
    level = profile_log.level
    try:
        backend = cli.load_model("scripted", parser.parse_args(["serve", "--profile-steps", "8"]))
        profile = backend.engine.profile  # type: ignore[attr-defined]
        assert profile is not None and profile.every == 8 and profile.name == "scripted"
        assert profile_log.level == logging.INFO  # shown under --log-level warning too
    finally:
        profile_log.setLevel(level)
    assert cli.load_model("scripted", parser.parse_args(["serve"])).engine.profile is None  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--profile-steps", "0"])
