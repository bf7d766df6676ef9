"""Same request, same reply, through the HTTP API as a user meets it: `turbospark serve` with
default flags (the packaged SmolLM2) and the real `openai` client. A greedy and a seeded request
are sent cold, again (their prompt now from the prefix cache), while seven other requests share
the batch, and to a second server that cuts prompts into 8-token chunks
(`--max-prefill-tokens 8`); every reply must be the cold one. The engine-level test with the
tiny models is tests/engine/test_reproducible.py; this one holds the served path (template,
sampling defaults, scheduler, prefix cache) end to end on whatever CPU runs it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from turbospark.testing import ServerProcess

pytestmark = pytest.mark.slow

STORY = "Write a short story about a cat who finds a lost key in an old library. Keep it simple."
OTHERS = [f"List {n} fruits and say in one sentence each why they are healthy." for n in range(3, 10)]
SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "seed": 11},
}


def ask(client: openai.OpenAI, content: str, **sampling: Any) -> str:
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": content}], max_tokens=40, **sampling
    )
    return reply.choices[0].message.content or ""


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    with (
        ServerProcess() as plain,
        ServerProcess("--max-prefill-tokens", "8") as chunked,
        openai.OpenAI(base_url=plain.url + "/v1", api_key="x", timeout=300) as a,
        openai.OpenAI(base_url=chunked.url + "/v1", api_key="x", timeout=300) as b,
    ):
        yield a, b


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_cached_batched_and_chunked_replies_equal_the_cold_one(
    clients: tuple[openai.OpenAI, openai.OpenAI], setting: str
) -> None:
    plain, chunked = clients
    sampling = SETTINGS[setting]
    cold = ask(plain, f"{STORY} ({setting})", **sampling)
    assert len(cold) > 40  # a real reply, not an empty one that would match anything
    assert ask(plain, f"{STORY} ({setting})", **sampling) == cold, "prefix-cached"

    replies: list[str] = []
    others = [
        threading.Thread(target=lambda o=o: replies.append(ask(plain, o, temperature=0.0))) for o in OTHERS
    ]
    for t in others:
        t.start()
    batched = ask(plain, f"{STORY} ({setting})", **sampling)
    for t in others:
        t.join(300)
    assert len(replies) == len(OTHERS)
    assert batched == cold, "batched with 7 others"

    assert ask(chunked, f"{STORY} ({setting})", **sampling) == cold, "chunked by 8 tokens"
