"""Images through the APIs on tiny random-weight Qwen2-VL and Qwen2.5-VL folders
(tests/engine/tiny_qwen2vl.py) served on loopback, with the real client libraries: the same
picture gives the same greedy text in all four APIs, and that text is what the backend's own
greedy decode of the rendered prompt gives; a conversation with two pictures; the model lists
`vision`."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.engine import tiny_qwen2vl, tiny_vlm
from tests.test_vision_api import (
    B64,
    PICTURE,
    QUESTION,
    N,
    _anthropic,
    _ollama,
    _openai,
    _openai_chat,
    _responses,
)

from turbospark.backend import GenerationConfig, RequestImage
from turbospark.engine.backend import RealChatModel, load_backend
from turbospark.testing import LiveServer

pytest.importorskip("PIL")


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealChatModel]:
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    tiny_qwen2vl.save_folder(Path(folder), family=request.param)
    model = load_backend(str(folder), quant=None, dtype="float32", progress=False, kv_cache_gb=0.05)
    yield model
    model.close()


@pytest.fixture(scope="module")
def server(backend: RealChatModel) -> Iterator[LiveServer]:
    with LiveServer([backend]) as live:
        yield live


def _direct(backend: RealChatModel) -> str:
    """The backend's own greedy text for the picture and question, rendered as the plan does."""
    from turbospark.chat_template import render_chat_template

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = render_chat_template(backend.tokenizer.chat_template or "", messages, add_generation_prompt=True)
    result = backend.run_completion(
        backend.tokenizer.encode(text, add_special_tokens=False),
        GenerationConfig(max_new_tokens=N, temperature=0.0),
        [RequestImage(PICTURE, "image/png")],
        threading.Event(),
        lambda _: None,
    )
    return backend.tokenizer.decode(result.token_ids)


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
    assert texts["openai"] == _direct(backend)


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
    # 100x70 -> 10 x 14 patches (35 tokens), 40x90 -> 8 x 14 patches (28 tokens)
    assert reply.usage is not None and reply.usage.prompt_tokens > 35 + 28
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_the_model_lists_vision(server: LiveServer, backend: RealChatModel) -> None:
    listed = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert "vision" in listed[0]["capabilities"]
