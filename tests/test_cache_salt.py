"""Prefix-cache isolation: `cache_salt` (OpenAI, Anthropic, Responses bodies, as vLLM reads it)
and, where API keys are configured, the caller's key salt the block hashes, so requests with
different salts never share cached blocks (a shared cache lets one tenant time another's
prompts). Driven through the real client libraries against the scripted backend, whose engine
runs the real scheduler and block manager."""

from __future__ import annotations

import anthropic
import openai
import pytest

from turbospark.engine.kv_cache import BlockManager
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

# Long enough for several full 16-token blocks under the byte tokenizer.
PROMPT = "Summarise the quarterly figures for the northern region. " * 6


def anthropic_cached(client: anthropic.Anthropic, **extra: object) -> int:
    reply = client.messages.create(
        model="scripted",
        max_tokens=8,
        messages=[{"role": "user", "content": PROMPT}],
        extra_body=extra or None,
    )
    return reply.usage.cache_read_input_tokens or 0


def openai_cached(client: openai.OpenAI, **extra: object) -> int:
    reply = client.chat.completions.create(
        model="scripted",
        max_tokens=8,
        messages=[{"role": "user", "content": PROMPT}],
        extra_body=extra or None,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_anthropic_cache_salt_isolates_prefixes() -> None:
    with (
        LiveServer([ScriptedChatModel(["ok"])]) as server,
        anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client,
    ):
        assert anthropic_cached(client, cache_salt="tenant-a") == 0
        assert anthropic_cached(client, cache_salt="tenant-a") > 0  # a hit within one salt
        assert anthropic_cached(client, cache_salt="tenant-b") == 0  # none across salts
        assert anthropic_cached(client) == 0  # nor between a salt and none
        assert anthropic_cached(client) > 0
        with pytest.raises(anthropic.BadRequestError, match="cache_salt"):
            anthropic_cached(client, cache_salt="")


def test_openai_and_responses_cache_salt() -> None:
    with (
        LiveServer([ScriptedChatModel(["ok"])]) as server,
        openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        assert openai_cached(client, cache_salt="a") == 0
        assert openai_cached(client, cache_salt="a") > 0
        assert openai_cached(client, cache_salt="b") == 0
        with pytest.raises(openai.BadRequestError, match="cache_salt") as caught:
            openai_cached(client, cache_salt=7)
        assert caught.value.param == "cache_salt"  # type: ignore[attr-defined]

        def responses_cached(salt: str) -> int:
            reply = client.responses.create(
                model="scripted", input=PROMPT, max_output_tokens=8, extra_body={"cache_salt": salt}
            )
            assert reply.usage is not None
            return reply.usage.input_tokens_details.cached_tokens

        assert responses_cached("c") == 0
        assert responses_cached("c") > 0
        assert responses_cached("d") == 0


def test_api_keys_isolate_tenants() -> None:
    with LiveServer([ScriptedChatModel(["ok"])], api_keys=["key-one", "key-two"]) as server:
        url = server.url + "/v1"
        with (
            openai.OpenAI(base_url=url, api_key="key-one", max_retries=0) as one,
            openai.OpenAI(base_url=url, api_key="key-two", max_retries=0) as two,
        ):
            assert openai_cached(one) == 0
            assert openai_cached(one) > 0  # a tenant still hits its own prefixes
            assert openai_cached(two) == 0  # but never another key's
            assert openai_cached(two) > 0
            assert openai_cached(two, cache_salt="x") == 0  # a salt splits within a key, too
            assert openai_cached(one, cache_salt="x") == 0


def test_block_manager_salt_roots_the_chain() -> None:
    blocks = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(13))
    table = blocks.allocate(4)
    root = BlockManager.root_key("s")
    num_hashed, _ = blocks.register_full_blocks(tokens, table, len(tokens), 0, root)
    assert num_hashed == 3
    assert len(blocks.match_prefix(tokens, "s")[0]) == 3
    assert blocks.match_prefix(tokens, "other") == ([], BlockManager.root_key("other"))
    assert blocks.match_prefix(tokens) == ([], None)
    blocks.release(table)
    blocks.check()
