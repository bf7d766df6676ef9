"""Images through every API, with the real client libraries, against a tiny random-weight
SmolVLM-shaped model (tests/engine/tiny_vlm.py) served on loopback: the same picture gives the
same greedy text in all four; a corrupt picture is a 400 in each API's own envelope naming the
content part; the model lists `vision`."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from tests.engine import tiny_vlm

from turbospark.engine.backend import RealChatModel, load_backend
from turbospark.testing import LiveServer

pytest.importorskip("PIL")

PICTURE = tiny_vlm.png(100, 70, seed=11)
B64 = base64.b64encode(PICTURE).decode()
# a readable header (so the pixel limit passes) over a cut-off body: only decoding finds it
CORRUPT = base64.b64encode(PICTURE[:80]).decode()
QUESTION = "What is in the picture?"
N = 6


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> RealChatModel:
    folder = tmp_path_factory.mktemp("tiny-smolvlm")
    tiny_vlm.save_folder(Path(folder))
    return load_backend(str(folder), quant=None, dtype="float32", progress=False, kv_cache_gb=0.05)


@pytest.fixture(scope="module")
def server(backend: RealChatModel) -> Iterator[LiveServer]:
    with LiveServer([backend]) as live:
        yield live


def _openai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def _openai_chat(server: LiveServer, model: str, b64: str = B64) -> str:
    with _openai(server) as client:
        reply = client.chat.completions.create(
            model=model,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
            max_tokens=N,
            temperature=0,
        )
    return reply.choices[0].message.content or ""


def _responses(server: LiveServer, model: str, b64: str = B64) -> str:
    with _openai(server) as client:
        reply = client.responses.create(
            model=model,
            input=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_image",
                            "image_url": f"data:image/png;base64,{b64}",
                            "detail": "auto",
                        },
                        {"type": "input_text", "text": QUESTION},
                    ],
                }
            ],
            max_output_tokens=N,
            temperature=0,
        )
    return reply.output_text


def _anthropic(server: LiveServer, model: str, b64: str = B64) -> str:
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as client:
        reply = client.messages.create(
            model=model,
            max_tokens=N,
            extra_body={"temperature": 0},  # this SDK version no longer takes it as an argument
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": b64},
                        },
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
        )
    return "".join(b.text for b in reply.content if b.type == "text")


def _ollama(server: LiveServer, model: str, b64: str = B64) -> str:
    client = ollama.Client(host=server.url)
    try:
        reply = client.chat(
            model=model,
            messages=[{"role": "user", "content": QUESTION, "images": [b64]}],
            options={"temperature": 0, "num_predict": N},
        )
    finally:
        client._client.close()
    return reply.message.content or ""


def test_same_picture_same_greedy_text_in_every_api(server: LiveServer, backend: RealChatModel) -> None:
    model = backend.model_id
    texts = {
        "openai": _openai_chat(server, model),
        "responses": _responses(server, model),
        "anthropic": _anthropic(server, model),
        "ollama": _ollama(server, model),
    }
    assert texts["openai"], texts
    assert len(set(texts.values())) == 1, texts


def test_two_pictures_in_a_conversation(server: LiveServer, backend: RealChatModel) -> None:
    other = base64.b64encode(tiny_vlm.png(40, 90, seed=12)).decode()
    with _openai(server) as client:
        reply = client.chat.completions.create(
            model=backend.model_id,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}},
                        {"type": "text", "text": "And this one?"},
                    ],
                },
                {"role": "assistant", "content": "A pattern."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{other}"}},
                        {"type": "text", "text": "Compare them."},
                    ],
                },
            ],
            max_tokens=4,
            temperature=0,
        )
    assert reply.usage is not None and reply.usage.prompt_tokens > 2 * 5 * tiny_vlm.SEQ_LEN
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_corrupt_picture_is_a_400_naming_the_part_in_every_api(
    server: LiveServer, backend: RealChatModel
) -> None:
    model = backend.model_id
    with pytest.raises(openai.BadRequestError) as oa:
        _openai_chat(server, model, CORRUPT)
    assert (
        "messages[0].content[0].image_url" in oa.value.message and "could not be decoded" in oa.value.message
    )
    with pytest.raises(openai.BadRequestError) as rs:
        _responses(server, model, CORRUPT)
    assert "could not be decoded" in rs.value.message
    with pytest.raises(anthropic.BadRequestError) as an:
        _anthropic(server, model, CORRUPT)
    assert "messages[0].content[0]" in an.value.message and "could not be decoded" in an.value.message
    with pytest.raises(ollama.ResponseError) as ol:
        _ollama(server, model, CORRUPT)
    assert ol.value.status_code == 400 and "could not be decoded" in ol.value.error


def test_pixel_limit_is_a_400(backend: RealChatModel) -> None:
    from turbospark.api.common import ServerState
    from turbospark.limits import Limits
    from turbospark.registry import ModelRegistry

    registry = ModelRegistry(limits=Limits(max_image_pixels=1000))
    registry.add(backend)
    with (
        LiveServer(state=ServerState(registry=registry)) as live,
        pytest.raises(openai.APIStatusError) as err,
    ):
        _openai_chat(live, backend.model_id)
    assert err.value.status_code in (400, 413) and "--max-image-pixels" in err.value.message


def test_the_model_lists_vision(server: LiveServer, backend: RealChatModel) -> None:
    listed = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert "vision" in listed[0]["capabilities"]
    client = ollama.Client(host=server.url)
    shown = client.show(backend.model_id)
    client._client.close()
    assert shown.capabilities is not None and "vision" in shown.capabilities
