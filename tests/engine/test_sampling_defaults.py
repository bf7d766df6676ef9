"""Sampling defaults of a served model, end to end: a tiny random-weight Hugging Face folder with
a generation_config.json, loaded by the real loader, served on loopback and asked through the real
`openai`, `anthropic` and `ollama` clients; `turbospark serve --sampling-defaults none` as a
user starts it.

The observable is what the sampler does: the folder recommends top_k 1, so a request that leaves
top_k unset decodes greedily (every seed gives the temperature-0 reply), while one that sets
top_k 0 (off), or a server that applies no defaults, samples (the seeds disagree). The Responses
API echoes the temperature and top_p the reply was sampled with; /api/show lists the defaults.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import ollama
import openai
import pytest
from tiny_models import FAMILIES, save_folder

from turbospark.api.common import ServerState
from turbospark.backend import BUILTIN_SAMPLING, NO_SAMPLING_DEFAULTS, SamplingDefaults
from turbospark.engine.backend import RealChatModel, load_backend
from turbospark.engine.hf_loader import generation_sampling
from turbospark.registry import ModelRegistry, ServedModel
from turbospark.testing import LiveServer, ServerProcess

GENERATION_CONFIG = {
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 1,
    "repetition_penalty": 1.05,
    "eos_token_id": 2,
}
PROMPT = "w5 w17 w42 w8"
SEEDS = range(4)
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sampling") / "tiny-qwen2"
    save_folder(path, FAMILIES["qwen2"], seed=0)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return path


@pytest.fixture(scope="module")
def model(folder: Path) -> RealChatModel:
    return load_backend(str(folder), dtype="float32", quant="none", progress=False, kv_cache_gb=0.01)


def serve(model: RealChatModel, sampling: SamplingDefaults | None = None) -> LiveServer:
    registry = ModelRegistry()
    registry.add(ServedModel(model, sampling=sampling))
    return LiveServer(state=ServerState(registry=registry))


def openai_replies(url: str, **kwargs: Any) -> list[str]:
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        out = []
        for seed in SEEDS:
            reply = client.chat.completions.create(
                model="tiny-qwen2",
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=MAX_TOKENS,
                seed=seed,
                **kwargs,
            )
            out.append(reply.choices[0].message.content or "")
        return out


def test_the_loader_reads_generation_config(folder: Path, model: RealChatModel) -> None:
    own = SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=1, repetition_penalty=1.05, source="generation_config.json"
    )
    assert generation_sampling(folder) == own
    assert model.sampling_defaults() == own
    # Served: the model's values where it gives one, the built-in min_p where it does not.
    served = ServedModel(model).sampling_defaults
    assert (served.temperature, served.top_p, served.top_k, served.min_p, served.repetition_penalty) == (
        0.7,
        0.8,
        1,
        BUILTIN_SAMPLING.min_p,
        1.05,
    )
    assert served.source == "generation_config.json over built-in"


def test_a_bad_generation_config_value_is_skipped_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"temperature": "hot", "top_p": 0.0, "top_k": 2.5, "min_p": 0.1, "repetition_penalty": None}
        )
    )
    assert generation_sampling(tmp_path) == SamplingDefaults(min_p=0.1, source="generation_config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert generation_sampling(tmp_path).is_empty()


def test_unset_fields_take_the_models_defaults_over_http(model: RealChatModel) -> None:
    with serve(model) as server:
        greedy = openai_replies(server.url, temperature=0.0)
        assert len(set(greedy)) == 1 and greedy[0]
        # top_k unset: the folder's top_k 1 makes every seed decode the greedy reply
        assert openai_replies(server.url) == greedy
        assert openai_replies(server.url, temperature=1.5) == greedy
        # top_k sent as 0 (off) or -1 (vLLM's off) is honoured: the seeds sample different replies
        assert len(set(openai_replies(server.url, extra_body={"top_k": 0}))) > 1
        assert len(set(openai_replies(server.url, extra_body={"top_k": -1}))) > 1
        # null is unset
        assert openai_replies(server.url, extra_body={"top_k": None}) == greedy

        with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as client:
            texts = set()
            for seed in SEEDS:
                message = client.messages.create(
                    model="tiny-qwen2",
                    max_tokens=MAX_TOKENS,
                    messages=[{"role": "user", "content": PROMPT}],
                    metadata={"user_id": f"seed-{seed}"},
                )
                texts.add("".join(b.text for b in message.content if b.type == "text"))
            assert texts == {greedy[0]}  # Anthropic has no seed: greedy is the only way all agree

        with ollama.Client(host=server.url) as client:
            replies = {
                client.generate(
                    model="tiny-qwen2",
                    prompt=PROMPT,
                    raw=True,
                    options={"seed": s, "num_predict": MAX_TOKENS},
                ).response
                for s in SEEDS
            }
            assert len(replies) == 1
            off = {
                client.generate(
                    model="tiny-qwen2",
                    prompt=PROMPT,
                    raw=True,
                    options={"seed": s, "num_predict": MAX_TOKENS, "top_k": 0},
                ).response
                for s in SEEDS
            }
            assert len(off) > 1
            shown = client.show("tiny-qwen2").parameters or ""
            for line in ("temperature 0.7", "top_k 1", "top_p 0.8", "min_p 0.05", "repeat_penalty 1.05"):
                assert line in shown.splitlines(), shown

        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            echoed = client.responses.create(model="tiny-qwen2", input=PROMPT, max_output_tokens=4)
            assert (echoed.temperature, echoed.top_p) == (0.7, 0.8)
            sent = client.responses.create(
                model="tiny-qwen2", input=PROMPT, max_output_tokens=4, temperature=1.0, top_p=1.0
            )
            assert (sent.temperature, sent.top_p) == (1.0, 1.0)


def test_no_defaults_samples_with_temperature_alone(model: RealChatModel) -> None:
    with serve(model, NO_SAMPLING_DEFAULTS) as server:
        assert len(set(openai_replies(server.url))) > 1
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            echoed = client.responses.create(model="tiny-qwen2", input=PROMPT, max_output_tokens=4)
            assert (echoed.temperature, echoed.top_p) == (1.0, 1.0)
        with ollama.Client(host=server.url) as client:
            shown = (client.show("tiny-qwen2").parameters or "").splitlines()
            assert "top_k 0" in shown and "top_p 1" in shown and "min_p 0" in shown


@pytest.fixture
def spawned(request: pytest.FixtureRequest, folder: Path) -> Iterator[str]:
    """`turbospark serve --model <folder> <flags>` as a user starts it."""
    flags = ["--dtype", "float32", "--quant", "none", "--kv-cache-gb", "0.01", *request.param]
    with ServerProcess("--model", str(folder), *flags) as server:
        yield server.url


@pytest.mark.parametrize(
    ("spawned", "samples"),
    [([], False), (["--sampling-defaults", "none"], True)],
    indirect=["spawned"],
    ids=["model", "none"],
)
def test_the_serve_flag(spawned: str, samples: bool) -> None:
    # default: the folder's top_k 1 (greedy whatever the seed); none: temperature alone
    assert (len(set(openai_replies(spawned))) > 1) is samples
