"""Operational endpoints: /tokenize and /detokenize, with the same rendering as generation.

Errors use OpenAI's envelope; a chat to tokenize is OpenAI-shaped (`messages`, `tools`).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbospark.api import fields as f
from turbospark.api.common import endpoint, read_json, state_of
from turbospark.api.envelopes import openai_error
from turbospark.api.parsing import parse_chat_messages, parse_function_tools
from turbospark.errors import invalid
from turbospark.plan import make_plan
from turbospark.request import ChatRequest


async def tokenize(request: Request) -> Response:
    """`{"model", "prompt"}` tokenizes raw text; `{"model", "messages"[, "tools"]}` the rendered chat."""
    body = await read_json(request)
    model = f.string(body, "model", required=True) or ""
    registry = state_of(request).registry
    if "messages" in body:
        chat = ChatRequest(
            model=model,
            messages=parse_chat_messages(body.get("messages")),
            tools=parse_function_tools(body.get("tools"), nested=True),
        )
        plan = make_plan(chat, registry)
        ids, text = plan.prompt_ids, plan.prompt_text
    else:
        text = f.string(body, "prompt", required=True) or ""
        backend = registry.resolve(model).backend
        ids = backend.tokenizer.encode(text, add_special_tokens=f.boolean(body, "add_special_tokens", True))
        plan = None
    backend = registry.resolve(model).backend
    out = {"tokens": ids, "count": len(ids), "max_model_len": backend.max_context}
    if f.boolean(body, "return_token_strs", False):
        out["token_strs"] = [backend.tokenizer.token_bytes_text(i) for i in ids]
    if plan is not None:
        out["prompt"] = text
    return JSONResponse(out)


async def detokenize(request: Request) -> Response:
    body = await read_json(request)
    model = f.string(body, "model", required=True) or ""
    tokens = f.array(body, "tokens", required=True) or []
    backend = state_of(request).registry.resolve(model).backend
    if not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < backend.vocab_size for t in tokens
    ):
        raise invalid(f"'tokens' must be token ids from 0 to {backend.vocab_size - 1}", "tokens")
    return JSONResponse({"prompt": backend.tokenizer.decode(tokens, skip_special_tokens=False)})


def routes() -> list[Route]:
    wrap = endpoint(openai_error)
    return [
        Route("/tokenize", wrap(tokenize), methods=["POST"]),
        Route("/detokenize", wrap(detokenize), methods=["POST"]),
    ]
