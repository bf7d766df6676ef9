"""A streamed reply starts (HTTP headers and its opening event) as soon as the engine has taken
the request into its line, not when its first token comes: a request queued behind another
still gets `message_start` / `response.created` / its first chunk at once."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
from test_backend import WORDS, word_tokenizer
from tiny_models import FAMILIES, checkpoint

from turbospark.api.common import ServerState
from turbospark.engine.backend import RealChatModel
from turbospark.engine.models import build_model
from turbospark.engine.scheduler import SchedulerConfig
from turbospark.ratecontrol import RateControl
from turbospark.registry import ModelRegistry
from turbospark.testing import LiveServer

PROMPT = " ".join(WORDS[10:30])


def one_at_a_time() -> RealChatModel:
    """The tiny llama running one sequence at a time, held to 20 tokens/s, so a second request
    waits in line for the whole of the first."""
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=0, init_std=1.0)
    return RealChatModel(
        "tiny-llama",
        build_model(cfg, tensors),
        word_tokenizer(),
        max_context=400,
        scheduler=SchedulerConfig(max_active=1),
        rate=RateControl(20.0),
    )


def sse_data(lines: Iterator[str]) -> Iterator[dict[str, object]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def test_queued_requests_start_their_streams_at_once() -> None:
    model = one_at_a_time()
    registry = ModelRegistry()
    registry.add(model)
    # No pings to fall back on: without the start at admission the queued stream would say
    # nothing until the first request ended.
    state = ServerState(registry=registry, ping_interval=3600.0)
    body = {"model": "tiny-llama", "max_tokens": 300, "temperature": 0, "stream": True}
    with LiveServer(state=state) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        eos = next(iter(model.tokenizer.eos_token_ids))
        first_body = {
            **body,
            "messages": [{"role": "user", "content": PROMPT}],
            "logit_bias": {str(eos): -100},
        }
        with client.stream("POST", "/v1/chat/completions", json=first_body) as first:
            first_events = sse_data(first.iter_lines())
            assert next(first_events)["object"] == "chat.completion.chunk"
            queued = {**body, "messages": [{"role": "user", "content": PROMPT + " again"}]}
            with client.stream("POST", "/v1/messages", json=queued) as second:
                assert second.status_code == 200
                opening = next(sse_data(second.iter_lines()))
                assert opening["type"] == "message_start"
                # Still in line behind the first request (which cannot end early: its end-of-text
                # token is banned): the reply started before any token of its own.
                assert len(model.engine.scheduler.waiting) == 1
            responses = {**body, "input": PROMPT + " once more", "max_output_tokens": 300}
            del responses["max_tokens"]
            with client.stream("POST", "/v1/responses", json=responses) as third:
                assert next(sse_data(third.iter_lines()))["type"] == "response.created"
                # (the cancelled second request may still be in line too, until the next step)
                assert model.engine.scheduler.waiting
