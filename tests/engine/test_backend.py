"""`RealChatModel` on a tiny random-weight model with a tokenizer built here."""

from __future__ import annotations

import threading

import pytest
import tokenizers
from tiny_models import FAMILIES, checkpoint

from turbospark.backend import (
    NEVER_CANCEL,
    BackendError,
    ChatModel,
    FinishReason,
    GenerationConfig,
    RequestImage,
    TokenEvent,
)
from turbospark.engine.backend import RealChatModel, resolve_numerics
from turbospark.engine.models import build_model
from turbospark.registry import ModelRegistry
from turbospark.tokenizer import Tokenizer

WORDS = [f"w{i}" for i in range(316)]


def word_tokenizer() -> Tokenizer:
    """A word-level tokenizer over the tiny model's 320 ids: 4 specials, then 316 words."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3} | {w: i + 4 for i, w in enumerate(WORDS)}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    hf.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    hf.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(hf, {"bos_token": "<s>", "eos_token": "</s>", "eos_token_ids": [2]})


def backend(max_context: int = 8192) -> RealChatModel:
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=0, init_std=1.0)
    return RealChatModel("tiny-llama", build_model(cfg, tensors), word_tokenizer(), max_context=max_context)


def greedy(n: int, **kwargs) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, temperature=0.0, **kwargs)


def test_protocol_surface() -> None:
    model = backend()
    assert isinstance(model, ChatModel)
    assert model.model_id == "tiny-llama"
    # The Claude Code alias is the registry's (a wire-format rule), not the backend's.
    assert ModelRegistry().add(model).names() == ["tiny-llama", "claude-turbospark-tiny-llama"]
    assert model.vocab_size == 320
    assert model.max_context == 512  # capped by the config's max_position_embeddings
    assert backend(max_context=100).max_context == 100
    assert model.vision() is None
    assert model.tokenizer.eos_token_ids == frozenset({2})
    details = model.details()
    assert (details.family, details.quantization) == ("llama", "F32")
    assert details.num_parameters == sum(p.numel() for p in model.runner.model.parameters())
    assert details.size_bytes == sum(p.numel() * p.element_size() for p in model.runner.model.parameters())


def test_run_completion_from_text_to_text() -> None:
    model = backend()
    prompt_ids = model.tokenizer.encode("w1 w2 w3 w40 w41 w300")
    assert prompt_ids == [5, 6, 7, 44, 45, 304]
    events: list[TokenEvent] = []
    result = model.run_completion(prompt_ids, greedy(12), None, NEVER_CANCEL, events.append)
    assert result.finish_reason is FinishReason.LENGTH
    assert len(result.token_ids) == 12 and [e.token_id for e in events] == result.token_ids
    assert result.num_prompt_tokens == 6
    assert result.prefill_seconds > 0 and result.decode_seconds > 0
    text = model.tokenizer.decode(result.token_ids)
    assert text.split() == [model.tokenizer.id_to_token(t) for t in result.token_ids if t not in (1, 2)]
    # the same request again gives the same tokens (the cache was released and reused)
    again = model.run_completion(prompt_ids, greedy(12), None, NEVER_CANCEL, lambda e: None)
    assert again.token_ids == result.token_ids


def test_eos_from_the_tokenizer_stops_generation() -> None:
    model = backend()
    prompt_ids = [5, 6, 7, 44, 45, 304]
    free_run = model.run_completion(prompt_ids, greedy(8), None, NEVER_CANCEL, lambda e: None).token_ids
    config = greedy(8, stop_token_ids=frozenset({free_run[2]}))
    result = model.run_completion(prompt_ids, config, None, NEVER_CANCEL, lambda e: None)
    assert result.finish_reason is FinishReason.STOP
    assert result.token_ids == free_run[: free_run.index(free_run[2])]


def test_images_are_refused_by_model_name() -> None:
    image = RequestImage(data=b"\x89PNG\r\n\x1a\n", media_type="image/png")
    with pytest.raises(BackendError, match="tiny-llama"):
        backend().run_completion([5, 6], greedy(2), [image], NEVER_CANCEL, lambda e: None)


def test_bad_prompts_are_refused() -> None:
    model = backend(max_context=16)
    with pytest.raises(BackendError, match="17 tokens"):
        model.run_completion([5] * 17, greedy(2), None, NEVER_CANCEL, lambda e: None)
    with pytest.raises(BackendError, match="empty"):
        model.run_completion([], greedy(2), None, NEVER_CANCEL, lambda e: None)
    with pytest.raises(BackendError, match=r"\[0, 320\)"):
        model.run_completion([5, 320], greedy(2), None, NEVER_CANCEL, lambda e: None)
    # a prompt filling the context exactly is served, with no room left to generate
    result = model.run_completion([5] * 16, greedy(2), None, NEVER_CANCEL, lambda e: None)
    assert result.token_ids == [] and result.finish_reason is FinishReason.LENGTH


def test_concurrent_requests_serialize_and_each_gets_its_own_answer() -> None:
    model = backend()
    prompts = [[5, 6, 7, 44], [100, 200, 300, 9, 10], [42] * 7, [8, 9]]
    expected = [
        model.run_completion(p, greedy(10), None, NEVER_CANCEL, lambda e: None).token_ids for p in prompts
    ]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = model.run_completion(
                prompts[i], greedy(10), None, NEVER_CANCEL, lambda e: None
            ).token_ids
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [results[i] for i in range(len(prompts))] == expected


def test_numerics_defaults() -> None:
    import torch

    from turbospark.engine.cpu_kernels import cpu_kernels

    assert resolve_numerics("cpu", None, None) == (torch.float32, None)
    assert resolve_numerics("cpu", None, "none") == (torch.float32, None)
    # quantized activations: bf16 where the CPU has it natively, float32 where it is emulated
    assert resolve_numerics("cpu", None, "auto") == (cpu_kernels().activation_dtype, "auto")
    assert resolve_numerics("cpu", "float32", "auto") == (torch.float32, None)  # float weights asked for
    assert resolve_numerics("cpu", "bfloat16", "auto") == (torch.bfloat16, None)
    assert resolve_numerics("cpu", "float32", "int8") == (torch.float32, "int8")
    assert resolve_numerics("cuda", None, "auto") == (torch.bfloat16, None)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_numerics("cuda", None, "int4")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_numerics("cpu", "float8", None)


def test_kv_cache_dtype_defaults() -> None:
    import torch

    from turbospark.engine.backend import resolve_kv_dtype
    from turbospark.engine.cpu_kernels import native_kernels_for

    # float16 where the native decode attention reads it over float32 activations
    native_here = native_kernels_for(torch.empty(1, 1)) is not None
    assert resolve_kv_dtype("cpu", torch.float32, None) == (torch.float16 if native_here else torch.float32)
    assert resolve_kv_dtype("cpu", torch.bfloat16, "auto") == torch.bfloat16
    assert resolve_kv_dtype("cpu", torch.float32, "float32") == torch.float32
    assert resolve_kv_dtype("cpu", torch.bfloat16, "float16") == torch.float16
    assert resolve_kv_dtype("cuda", torch.bfloat16, "auto") == torch.bfloat16
    with pytest.raises(ValueError, match="model's dtype"):
        resolve_kv_dtype("cuda", torch.bfloat16, "float32")
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        resolve_kv_dtype("cpu", torch.float32, "int8")
