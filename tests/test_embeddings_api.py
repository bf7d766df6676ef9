"""The embedding routes over a tiny random-weight BERT, driven by the real openai and ollama
clients on loopback: every input shape, both encodings, usage, errors in each API's envelope,
the listings, and a chat model beside it that cannot embed.

Expected vectors come from the backend's own encoder run on each input alone (its equivalence
to transformers is pinned in test_embeddings_model.py); the slow real-model test compares with
sentence-transformers.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import ollama
import openai
import pytest

from embedding_models import bert_tokenizer, write_bert_folder
from turbospark.engine.embedder import EmbeddingModel, load_embedding_model
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

MODEL = "tiny-bert"
TEXTS = ["the cat sat on the mat", "a dog", "quick brown fox jumps over the lazy dog", "stocks"]
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)  # 74 tokens: over the limit of 64


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> EmbeddingModel:
    return load_embedding_model(str(write_bert_folder(tmp_path_factory.mktemp("m") / MODEL)), progress=False)


@pytest.fixture(scope="module")
def server(backend: EmbeddingModel) -> Iterator[LiveServer]:
    with LiveServer([ScriptedChatModel(), backend]) as live:
        yield live


@pytest.fixture
def ollama_client(server: LiveServer) -> Iterator[ollama.Client]:
    with ollama.Client(host=server.url) as client:
        yield client


def ids_of(text: str) -> list[int]:
    tok = bert_tokenizer()
    tok.no_truncation()
    tok.no_padding()
    return tok.encode(text).ids


def alone(backend: EmbeddingModel, text: str) -> np.ndarray:
    return backend.embed_ids([ids_of(text)])[0]


def assert_same(got, expected: np.ndarray) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), expected, atol=1e-6, rtol=0)


def test_openai_sdk_default_base64_and_float(server: LiveServer, backend: EmbeddingModel) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        default = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64
        floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        one = client.embeddings.create(model=MODEL, input=TEXTS[0])
    assert [d.index for d in default.data] == [0, 1, 2, 3]
    assert default.model == MODEL and default.object == "list"
    for i, text in enumerate(TEXTS):
        assert_same(default.data[i].embedding, alone(backend, text))
        assert_same(floats.data[i].embedding, alone(backend, text))
    assert_same(one.data[0].embedding, alone(backend, TEXTS[0]))
    tokens = sum(len(ids_of(t)) for t in TEXTS)
    assert default.usage.prompt_tokens == tokens and default.usage.total_tokens == tokens
    assert one.usage.prompt_tokens == len(ids_of(TEXTS[0]))


def test_openai_base64_is_little_endian_float32(server: LiveServer, backend: EmbeddingModel) -> None:
    body = {"model": MODEL, "input": "a dog", "encoding_format": "base64"}
    reply = httpx.post(server.url + "/v1/embeddings", json=body).json()
    raw = base64.b64decode(reply["data"][0]["embedding"])
    assert len(raw) == 4 * backend.dimensions
    assert_same(np.frombuffer(raw, dtype="<f4"), alone(backend, "a dog"))


def test_openai_token_id_inputs(server: LiveServer, backend: EmbeddingModel) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        single = client.embeddings.create(model=MODEL, input=ids_of("a dog"), encoding_format="float")
        many = client.embeddings.create(
            model=MODEL, input=[ids_of(t) for t in TEXTS], encoding_format="float"
        )
    assert len(single.data) == 1
    assert_same(single.data[0].embedding, alone(backend, "a dog"))
    for i, text in enumerate(TEXTS):
        assert_same(many.data[i].embedding, alone(backend, text))
    assert many.usage.prompt_tokens == sum(len(ids_of(t)) for t in TEXTS)


def test_ollama_client_embed_and_embeddings(
    ollama_client: ollama.Client, server: LiveServer, backend: EmbeddingModel
) -> None:
    client = ollama_client
    reply = client.embed(model=MODEL, input=TEXTS)
    assert reply.model == MODEL and len(reply.embeddings) == len(TEXTS)
    for i, text in enumerate(TEXTS):
        assert_same(reply.embeddings[i], alone(backend, text))
    assert reply.prompt_eval_count == sum(len(ids_of(t)) for t in TEXTS)
    assert reply.total_duration and reply.total_duration > 0 and reply.load_duration == 0
    single = client.embed(model=f"{MODEL}:latest", input="a dog", keep_alive="5m", dimensions=32)
    assert_same(single.embeddings[0], alone(backend, "a dog"))
    legacy = client.embeddings(model=MODEL, prompt="a dog", keep_alive=0)
    assert_same(legacy.embedding, alone(backend, "a dog"))


def test_ollama_truncates_by_default_and_refuses_when_told_not_to(
    ollama_client: ollama.Client, server: LiveServer, backend: EmbeddingModel
) -> None:
    client = ollama_client
    full = ids_of(LONG)
    assert len(full) > backend.max_context
    cut = client.embed(model=MODEL, input=LONG)
    assert cut.prompt_eval_count == backend.max_context
    kept = [*full[: backend.max_context - 1], full[-1]]
    assert_same(cut.embeddings[0], backend.embed_ids([kept])[0])
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model=MODEL, input=["a dog", LONG], truncate=False)
    assert err.value.status_code == 400
    assert err.value.error == (
        f"input 1 is {len(full)} tokens, more than model {MODEL!r} accepts (64 tokens); "
        "shorten it or leave 'truncate' at true to cut it to fit"
    )
    with pytest.raises(ollama.ResponseError, match="/api/embed cuts over-long inputs") as err:
        client.embeddings(model=MODEL, prompt=LONG)
    assert err.value.status_code == 400


def test_openai_over_long_input_is_a_400(server: LiveServer) -> None:
    with (
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client,
        pytest.raises(openai.BadRequestError) as err,
    ):
        client.embeddings.create(model=MODEL, input=["a dog", LONG])
    assert err.value.body["param"] == "input"  # type: ignore[index]
    assert f"input 1 is {len(ids_of(LONG))} tokens, more than model {MODEL!r} accepts (64" in str(err.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": ""}, "'input' is empty: there is nothing to embed"),
        ({"input": []}, "'input' is empty: there is nothing to embed"),
        ({"input": ["a", ""]}, "'input[1]' is empty"),
        ({"input": [[2, 3], []]}, "'input[1]' is empty"),
        ({"input": [1, "a"]}, "'input' must be a string, an array of strings, an array of token ids"),
        ({"input": {"text": "a"}}, "'input' must be a string"),
        ({}, "'input' is required"),
        ({"input": [2, 99999, 3]}, "token ids must lie in [0, "),
        ({"input": "a", "encoding_format": "int8"}, "'encoding_format' must be 'float' or 'base64'"),
        (
            {"input": "a", "dimensions": 16},
            "makes 32-dimensional vectors and was not trained for shorter ones",
        ),
        ({"input": "a", "dimensions": 0}, "'dimensions' must be at least 1"),
        ({"input": ["a"] * 2049}, "at most 2048 per request"),
    ],
)
def test_openai_bad_requests_are_400s_in_openai_envelope(
    server: LiveServer, body: dict, message: str
) -> None:
    reply = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"], error


def test_ollama_bad_requests_are_400s_in_ollama_envelope(server: LiveServer) -> None:
    cases = [
        ("/api/embed", {"input": ""}, "'input' is empty"),
        ("/api/embed", {"input": []}, "'input' is empty"),
        ("/api/embed", {"input": [1, 2]}, "'input' must be a string or an array of strings"),
        ("/api/embed", {"input": "a", "dimensions": 8}, "cannot cut them to 8"),
        ("/api/embed", {"input": "a", "truncate": "yes"}, "'truncate' must be a boolean"),
        ("/api/embed", {"input": "a", "keep_alive": [1]}, "'keep_alive' must be a number of seconds"),
        ("/api/embeddings", {"prompt": ""}, "'prompt' is empty"),
    ]
    for path, body, message in cases:
        reply = httpx.post(server.url + path, json={"model": MODEL, **body})
        assert reply.status_code == 400, (path, body, reply.text)
        assert message in reply.json()["error"], (path, body, reply.json())
    # a body with no input at all is Ollama's "load the model" request
    assert httpx.post(server.url + "/api/embed", json={"model": MODEL}).json() == {
        "model": MODEL,
        "embeddings": [],
    }
    assert httpx.post(server.url + "/api/embeddings", json={"model": MODEL}).json() == {"embedding": []}


def test_chat_model_cannot_embed_and_embedding_model_cannot_chat(
    ollama_client: ollama.Client, server: LiveServer
) -> None:
    named = f"model 'scripted' is a chat model and cannot create embeddings; this server embeds with: {MODEL}"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match=named):
            client.embeddings.create(model="scripted", input="hi")
        for stream in (False, True):
            with pytest.raises(
                openai.BadRequestError, match=f"model '{MODEL}' is an embedding model and cannot chat"
            ):
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream
                )
        with pytest.raises(openai.NotFoundError, match="model 'nope' not found"):
            client.embeddings.create(model="nope", input="hi")
    client = ollama_client
    with pytest.raises(ollama.ResponseError, match=named) as err:
        client.embed(model="scripted", input="hi")
    assert err.value.status_code == 400
    for stream in (False, True):
        with pytest.raises(
            ollama.ResponseError, match=f"model '{MODEL}' is an embedding model and cannot chat"
        ) as err:
            reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream)
            if stream:
                list(reply)
        assert err.value.status_code == 400


def test_listings_say_which_models_embed(ollama_client: ollama.Client, server: LiveServer) -> None:
    models = httpx.get(server.url + "/v1/models").json()["data"]
    kinds = {m["id"]: m["capabilities"] for m in models}
    assert kinds == {
        "scripted": ["completion"],
        "claude-turbospark-scripted": ["completion"],
        MODEL: ["embedding"],
    }
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == list(kinds)
    client = ollama_client
    tags = {m.model: m for m in client.list().models}
    assert set(tags) == {"scripted:latest", f"{MODEL}:latest"}
    raw_tags = httpx.get(server.url + "/api/tags").json()["models"]
    assert {m["name"]: m["capabilities"] for m in raw_tags}[f"{MODEL}:latest"] == ["embedding"]
    shown = client.show(MODEL)
    assert shown.capabilities == ["embedding"]
    assert shown.details.family == "bert"
    assert shown.modelinfo["bert.embedding_length"] == 32
    assert shown.modelinfo["bert.context_length"] == 64
    assert "completion" in client.show("scripted").capabilities


def test_metrics_count_embedding_requests(server: LiveServer) -> None:
    def value(series: str) -> float:
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        return float(next(x for x in lines if x.startswith(series + " ")).rsplit(" ", 1)[1])

    ok = f'turbospark_embedding_requests_total{{model="{MODEL}",outcome="ok"}}'
    inputs = f'turbospark_embedding_inputs_total{{model="{MODEL}"}}'
    tokens = f'turbospark_embedding_tokens_total{{model="{MODEL}"}}'
    before = (value(ok), value(inputs), value(tokens))
    httpx.post(
        server.url + "/v1/embeddings", json={"model": MODEL, "input": ["a", "b", "c"]}
    ).raise_for_status()
    assert (value(ok), value(inputs), value(tokens)) == (before[0] + 1, before[1] + 3, before[2] + 9)
    assert value(f'turbospark_embedding_batches_total{{model="{MODEL}"}}') >= 1


def test_auth_applies_to_embeddings(backend: EmbeddingModel) -> None:
    with LiveServer([backend], api_keys=["k"]) as live:
        reply = httpx.post(live.url + "/v1/embeddings", json={"model": MODEL, "input": "a"})
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        reply = httpx.post(live.url + "/api/embed", json={"model": MODEL, "input": "a"})
        assert reply.status_code == 401 and "API key" in reply.json()["error"]
        with openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0) as client:
            assert len(client.embeddings.create(model=MODEL, input="a").data[0].embedding) == 32
