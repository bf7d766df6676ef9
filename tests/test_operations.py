from __future__ import annotations

import httpx

from turbospark.scripted import DEMO_MAX_CONTEXT, byte_tokenizer
from turbospark.testing import LiveServer


def test_tokenize_text_and_chat_and_detokenize(scripted_server: LiveServer) -> None:
    url = scripted_server.url
    raw = httpx.post(
        url + "/tokenize", json={"model": "scripted", "prompt": "hé", "return_token_strs": True}
    ).json()
    assert raw["tokens"] == byte_tokenizer().encode("hé") and raw["count"] == 3
    chat = httpx.post(
        url + "/tokenize", json={"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    )
    body = chat.json()
    assert body["prompt"].startswith("<|im_start|>user\nhi<|im_end|>")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == DEMO_MAX_CONTEXT
    back = httpx.post(url + "/detokenize", json={"model": "scripted", "tokens": body["tokens"]}).json()
    assert back["prompt"] == body["prompt"]


def test_detokenize_rejects_out_of_range_ids(scripted_server: LiveServer) -> None:
    resp = httpx.post(scripted_server.url + "/detokenize", json={"model": "scripted", "tokens": [1, 10**9]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens"
