"""Models by name, on demand: the store's listing, loading on a request's demand, keep_alive,
LRU unloading under --max-loaded-models, and load failures, driven by the real `ollama` client
(and the openai client for /v1/models) against a server on loopback.

The models are tiny random-weight Hugging Face folders in a --model-dir, plus a broken GGUF.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import ollama
import openai
import pytest

from store_models import write_tiny_hf
from turbospark import cli
from turbospark.api.common import ServerState
from turbospark.registry import ModelRegistry, ServedModel
from turbospark.store import ModelStore
from turbospark.testing import LiveServer

pytestmark = pytest.mark.slow  # loads (tiny) models


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache of the test's own: models pulled on this machine are not listed."""
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    for i, name in enumerate(("tiny-a", "tiny-b", "tiny-c")):
        write_tiny_hf(folder / name, seed=i)
    (folder / "broken.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    return folder


def start(model_dir: Path, *flags: str) -> tuple[LiveServer, ModelRegistry]:
    args = cli.parser().parse_args(["serve", "--model-dir", str(model_dir), *flags])
    registry = cli.build_registry(args)
    assert registry.store is not None
    registry.store = ModelStore([model_dir], packaged=False)  # only the folder's models
    return LiveServer(state=ServerState(registry=registry)), registry


@pytest.fixture
def served(model_dir: Path) -> Iterator[tuple[ollama.Client, ModelRegistry, LiveServer]]:
    server, registry = start(model_dir)
    with server, ollama.Client(host=server.url) as client:
        yield client, registry, server
    registry.close()


def loaded(client: ollama.Client) -> list[str]:
    return sorted(m.model or "" for m in client.ps().models)


def test_lists_models_before_loading(served: tuple[ollama.Client, ModelRegistry, LiveServer]) -> None:
    client, registry, server = served
    tags = {m.model: m for m in client.list().models}
    assert set(tags) == {"tiny-a:latest", "tiny-b:latest", "tiny-c:latest", "broken:latest"}
    tiny = tags["tiny-a:latest"]
    assert tiny.size is not None and tiny.size > 1_000_000  # the folder's files
    assert tiny.modified_at is not None and tiny.details is not None
    assert tiny.details.family == "llama" and tiny.details.format == "safetensors"
    assert loaded(client) == []
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x") as oa:
        ids = {m.id for m in oa.models.list()}
    assert {"tiny-a", "tiny-b", "claude-turbospark-tiny-a"} <= ids
    assert registry.num_loads == 0  # listing loads nothing


def test_chat_loads_the_model_on_first_request(
    served: tuple[ollama.Client, ModelRegistry, LiveServer],
) -> None:
    client, registry, _ = served
    reply = client.chat(
        model="tiny-a", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 4}
    )
    assert reply.done and reply.eval_count == 4
    assert loaded(client) == ["tiny-a:latest"]
    (ps,) = client.ps().models
    assert ps.context_length == 2048
    assert ps.expires_at is not None
    left = ps.expires_at.timestamp() - time.time()
    assert 200 < left <= 300  # the default keep_alive, 5 minutes, counted from the reply's end
    # the OpenAI API loads on demand too
    with openai.OpenAI(base_url=_url(client) + "/v1", api_key="x") as oa:
        chat = oa.chat.completions.create(
            model="tiny-b", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    assert loaded(client) == ["tiny-a:latest", "tiny-b:latest"]
    assert registry.num_loads == 2


def _url(client: ollama.Client) -> str:
    return str(client._client.base_url).rstrip("/")


def test_concurrent_first_requests_share_one_load(
    served: tuple[ollama.Client, ModelRegistry, LiveServer],
) -> None:
    client, registry, _ = served
    assert registry.loader is not None
    real_loader = registry.loader
    calls: list[str] = []

    def slow_loader(spec: str) -> ServedModel:
        calls.append(spec)
        time.sleep(1.0)  # both requests arrive while this load runs
        return real_loader(spec)

    registry.loader = slow_loader
    replies: list[ollama.ChatResponse] = []

    def ask() -> None:
        replies.append(
            client.chat(
                model="tiny-c", messages=[{"role": "user", "content": "x"}], options={"num_predict": 2}
            )
        )

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(replies) == 2 and all(r.done for r in replies)
    assert len(calls) == 1 and registry.num_loads == 1
    assert loaded(client) == ["tiny-c:latest"]


def test_request_during_the_start_up_load_waits_for_it(model_dir: Path) -> None:
    """A request that names a --model while serve still loads it at start (clients that do not
    wait for /health) shares that load: one load, a reply, and the model stays pinned."""
    given = str(model_dir / "tiny-b")  # --model by path: the store lists the folder as tiny-b
    server, registry = start(model_dir, "--model", given)
    assert registry.loader is not None
    real_loader = registry.loader
    calls: list[str] = []
    entered = threading.Event()

    def slow_loader(spec: str) -> ServedModel:
        calls.append(spec)
        entered.set()
        time.sleep(1.0)  # the request arrives while this load runs
        return real_loader(spec)

    registry.loader = slow_loader
    args = cli.parser().parse_args(["serve", "--model-dir", str(model_dir), "--model", given])
    registry.num_loading = 1
    with server, ollama.Client(host=server.url) as client:
        loading = threading.Thread(target=cli.load_into, args=(registry, args))
        loading.start()
        assert entered.wait(30)
        reply = client.chat(
            model="tiny-b", messages=[{"role": "user", "content": "x"}], options={"num_predict": 2}
        )
        loading.join(60)
        assert reply.done and reply.eval_count == 2
        assert len(calls) == 1 and registry.num_loads == 0  # no load on demand beside it
        assert loaded(client) == ["tiny-b:latest"]
        (pinned,) = registry.served()
        assert registry.expires_at(pinned) is None
    registry.close()


def test_keep_alive_zero_unloads(served: tuple[ollama.Client, ModelRegistry, LiveServer]) -> None:
    client, _, _ = served
    load = client.generate(model="tiny-a")  # Ollama's "load the model" request
    assert load.done_reason == "load"
    assert loaded(client) == ["tiny-a:latest"]
    unload = client.generate(model="tiny-a", keep_alive=0)
    assert unload.done_reason == "unload"
    assert loaded(client) == []
    # keep_alive on a chat: the model goes once the reply is done
    client.chat(
        model="tiny-b", messages=[{"role": "user", "content": "x"}], options={"num_predict": 2}, keep_alive=0
    )
    deadline = time.monotonic() + 10
    while loaded(client) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loaded(client) == []
    # a duration string, and -1 pins (ps shows a far-off expiry)
    client.generate(model="tiny-a", keep_alive="90s")
    (ps,) = client.ps().models
    assert ps.expires_at is not None and 60 < ps.expires_at.timestamp() - time.time() <= 90
    client.generate(model="tiny-a", keep_alive=-1)
    (ps,) = client.ps().models
    assert ps.expires_at is not None and ps.expires_at.timestamp() - time.time() > 10 * 365 * 86400


def test_short_keep_alive_expires(model_dir: Path) -> None:
    server, registry = start(model_dir, "--keep-alive", "1s")
    with server, ollama.Client(host=server.url) as client:
        client.chat(model="tiny-a", messages=[{"role": "user", "content": "x"}], options={"num_predict": 2})
        assert loaded(client) == ["tiny-a:latest"]
        deadline = time.monotonic() + 15
        while loaded(client) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert loaded(client) == []
    registry.close()


def test_lru_unload_spares_the_model_that_is_serving(model_dir: Path) -> None:
    # decode capped at 50 tokens/s: the stream on tiny-a runs while the other models load
    server, registry = start(model_dir, "--max-loaded-models", "2", "--max-decode-rate", "50")
    with server, ollama.Client(host=server.url) as client:
        stream = client.chat(
            model="tiny-a",
            messages=[{"role": "user", "content": "x"}],
            options={"num_predict": 1500, "temperature": 0},
            stream=True,
        )
        first = next(stream)
        assert not first.done
        client.chat(model="tiny-b", messages=[{"role": "user", "content": "x"}], options={"num_predict": 2})
        assert loaded(client) == ["tiny-a:latest", "tiny-b:latest"]
        # a third model: tiny-b (idle) goes, tiny-a (older, but serving) stays
        client.chat(model="tiny-c", messages=[{"role": "user", "content": "x"}], options={"num_predict": 2})
        assert loaded(client) == ["tiny-a:latest", "tiny-c:latest"]
        parts = [next(stream) for _ in range(20)]
        assert not any(p.done for p in parts)  # the stream went on through both loads
        stream.close()
    registry.close()


def test_broken_model_fails_that_request_only(
    served: tuple[ollama.Client, ModelRegistry, LiveServer],
) -> None:
    client, _, server = served
    client.chat(model="tiny-a", messages=[{"role": "user", "content": "x"}], options={"num_predict": 2})
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="broken", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 500
    assert "broken" in caught.value.error and "cannot load" in caught.value.error
    # the same failure in the OpenAI envelope
    with (
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as oa,
        pytest.raises(openai.InternalServerError) as failed,
    ):
        oa.chat.completions.create(model="broken", messages=[{"role": "user", "content": "x"}])
    assert "broken" in str(failed.value)
    reply = client.chat(
        model="tiny-a", messages=[{"role": "user", "content": "x"}], options={"num_predict": 2}
    )
    assert reply.done and loaded(client) == ["tiny-a:latest"]
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat(model="nothing-here", messages=[{"role": "user", "content": "x"}])
    assert unknown.value.status_code == 404
