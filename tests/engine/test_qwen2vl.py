"""Qwen2-VL against transformers on the same weights, pixels and prompt (float32, CPU): the image
processor, the prompt's image tokens, the vision tower's output, the M-RoPE positions and the
next-token logits through the engine's own step path (a chunk boundary inside an image's tokens),
greedy generation through the engine (decode positions shifted as transformers' rope_deltas),
chunked prefill, and the prefix cache keyed by the picture's content."""

from __future__ import annotations

import io
import itertools
import threading
from pathlib import Path

import pytest
import torch
from tests.engine import tiny_qwen2vl, tiny_vlm

from turbospark.backend import BackendError, GenerationConfig, RequestImage
from turbospark.engine.backend import RealChatModel, load_backend
from turbospark.engine.runner import StepInputs
from turbospark.engine.scheduler import SchedulerConfig
from turbospark.engine.vision import (
    ImagePrompt,
    Qwen2VLImageProcessor,
    decode_image,
    expand_prompt,
    smart_resize,
    step_embeds,
)

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2vl")
    tiny_qwen2vl.save_folder(path)
    return path


@pytest.fixture(scope="module")
def reference(folder: Path):
    import transformers

    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def backend(folder: Path) -> RealChatModel:
    return load_backend(str(folder), quant=None, dtype="float32", progress=False, kv_cache_gb=0.05)


def _pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


# non-square both ways, tiny (below min_pixels), square, elongated, and over max_pixels
SIZES = [(100, 70), (70, 100), (1, 1), (24, 24), (37, 250), (300, 200), (640, 480)]


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_image_processor_matches_transformers(folder: Path, width: int, height: int) -> None:
    data = tiny_vlm.png(width, height, seed=width * 7 + height)
    ours = Qwen2VLImageProcessor.from_folder(folder).process(decode_image(data))
    theirs = tiny_qwen2vl.hf_image_processor(folder)([_pil(data)], return_tensors="pt")
    assert ours.grid == tuple(theirs["image_grid_thw"][0].tolist())
    assert ours.pixel_values.shape == theirs["pixel_values"].shape
    torch.testing.assert_close(ours.pixel_values, theirs["pixel_values"], atol=1e-6, rtol=0)


def test_smart_resize_bounds_and_refusal() -> None:
    pre = tiny_qwen2vl.PREPROCESSOR
    lo, hi = pre["min_pixels"], pre["max_pixels"]
    h, w = smart_resize(2000, 3000, 12, lo, hi)
    assert h % 12 == w % 12 == 0 and h * w <= hi
    h, w = smart_resize(3, 5, 12, lo, hi)
    assert h * w >= lo
    with pytest.raises(BackendError, match="aspect ratio"):
        smart_resize(1, 500, 12, lo, hi)


def test_processor_reads_size_dict_and_legacy_keys() -> None:
    new = Qwen2VLImageProcessor.from_config({"size": {"shortest_edge": 100, "longest_edge": 9000}})
    assert (new.min_pixels, new.max_pixels) == (100, 9000)
    old = Qwen2VLImageProcessor.from_config(
        {"min_pixels": 200, "max_pixels": 800, "size": {"shortest_edge": 1, "longest_edge": 2}}
    )
    assert (old.min_pixels, old.max_pixels) == (200, 800)


def _prompt(backend: RealChatModel, n_images: int, text: str = "What is in the picture?") -> str:
    from turbospark.chat_template import render_chat_template

    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return render_chat_template(
        backend.tokenizer.chat_template or "",
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
    )


def _expand(backend: RealChatModel, images: list[bytes], text: str | None = None):
    spec = backend._vision
    assert spec is not None
    ids = backend.tokenizer.encode(text if text is not None else _prompt(backend, len(images)))
    return expand_prompt(ids, [RequestImage(d, "image/png") for d in images], spec, backend.tokenizer)


def test_prompt_tokens_match_transformers_processor(folder: Path, backend: RealChatModel) -> None:
    images = [tiny_vlm.png(100, 70, seed=1), tiny_vlm.png(50, 40, seed=2)]
    text = _prompt(backend, 2)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    ours, prompt = _expand(backend, images)
    theirs = tiny_qwen2vl.hf_inputs(folder, text, images)
    assert ours == theirs["input_ids"][0].tolist()
    assert prompt.mrope and len(prompt.images) == 2
    torch.testing.assert_close(
        torch.cat([img.pixel_values for img in prompt.images]), theirs["pixel_values"], atol=1e-6, rtol=0
    )


def test_rope_positions_match_transformers_rope_index(
    folder: Path, backend: RealChatModel, reference
) -> None:
    images = [tiny_vlm.png(100, 70, seed=3), tiny_vlm.png(30, 80, seed=4)]
    text = _prompt(backend, 1, "Compare") + "<|vision_start|><|image_pad|><|vision_end|> and this."
    ids, prompt = _expand(backend, images, text)
    inputs = tiny_qwen2vl.hf_inputs(folder, text, images)
    assert ids == inputs["input_ids"][0].tolist()
    expected, delta = reference.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    n = len(ids)
    assert prompt.rope_positions(0, n).tolist() == expected[:, 0].tolist()
    # any window, and generated positions continue at index + delta
    assert prompt.rope_positions(17, 60).tolist() == expected[:, 0, 17:60].tolist()
    after = prompt.rope_positions(n, n + 3)
    assert after.tolist() == [[p + int(delta) for p in range(n, n + 3)]] * 3


def test_vision_tower_embeddings_and_logits_match_transformers(
    folder: Path, backend: RealChatModel, reference
) -> None:
    images = [tiny_vlm.png(100, 70, seed=5), tiny_vlm.png(60, 90, seed=6)]
    text = _prompt(backend, 2)
    inputs = tiny_qwen2vl.hf_inputs(folder, text, images)
    ids, prompt = _expand(backend, images)
    assert ids == inputs["input_ids"][0].tolist()
    model = backend.runner.model
    with torch.no_grad():
        pixels = torch.cat([img.pixel_values for img in prompt.images])
        grids = torch.tensor([img.grid for img in prompt.images])
        ours = model.encode_images(pixels, grids)  # type: ignore[attr-defined]
        theirs = reference.model.visual(
            inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]
        ).pooler_output
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
        expected = reference(**inputs).logits[0, -1]

    # the engine's step path, in three chunks, the first boundary inside the first image's tokens
    runner = backend.runner
    table: list[int] = []
    assert runner.block_manager.grow(table, len(ids))
    first = prompt.images[0].positions
    cuts = [0, first[len(first) // 2] + 1, prompt.images[1].positions[5], len(ids)]
    logits = None
    for start, end in itertools.pairwise(cuts):
        step = StepInputs(ids[start:end], [table], [start], [end - start], [0])
        step.embeds = step_embeds([prompt], [start], [end - start], model.encode_images, runner.device)  # type: ignore[attr-defined]
        logits = runner.run_step(step).logits[0]
    runner.block_manager.release(table)
    assert logits is not None
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def _greedy(
    backend: RealChatModel,
    images: list[bytes],
    n: int = 8,
    text: str | None = None,
    logprobs: list | None = None,
):
    """Greedy tokens through the engine; `logprobs` collects each chosen token's log-probability."""
    ids = backend.tokenizer.encode(text if text is not None else _prompt(backend, len(images)))
    config = GenerationConfig(max_new_tokens=n, temperature=0.0, num_top_logprobs=0)
    events: list = [] if logprobs is None else logprobs
    return backend.run_completion(
        ids,
        config,
        [RequestImage(d, "image/png") for d in images],
        threading.Event(),
        lambda e: events.append(e.logprob),
    )


def _hf_generate(
    folder: Path, reference, text: str, images: list[bytes], n: int
) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's log-probability."""
    inputs = tiny_qwen2vl.hf_inputs(folder, text, images)
    with torch.no_grad():
        out = reference.generate(
            **inputs,
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def test_greedy_tokens_match_transformers_generate(folder: Path, backend: RealChatModel, reference) -> None:
    """Every decode step's log-probability too: a generated token's M-RoPE position is its index
    plus the prompt's delta (transformers' rope_deltas); unshifted ones change the logits."""
    images = [tiny_vlm.png(100, 70, seed=7), tiny_vlm.png(50, 90, seed=12)]
    expected, expected_logprobs = _hf_generate(folder, reference, _prompt(backend, 2), images, 8)
    logprobs: list[float] = []
    result = _greedy(backend, images, 8, logprobs=logprobs)
    assert len(result.token_ids) == 8, "the tiny model ended its turn early: pick another seed"
    assert result.token_ids == expected
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-4, rtol=1e-4)


def test_text_only_prompt_matches_transformers_generate(
    folder: Path, backend: RealChatModel, reference
) -> None:
    text = _prompt(backend, 0, "Say something.")
    expected, expected_logprobs = _hf_generate(folder, reference, text, [], 6)
    logprobs: list[float] = []
    result = _greedy(backend, [], 6, text, logprobs)
    assert result.token_ids == expected
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_gives_the_same_tokens(folder: Path, backend: RealChatModel) -> None:
    images = [tiny_vlm.png(100, 70, seed=7), tiny_vlm.png(40, 90, seed=8)]
    whole_logprobs: list[float] = []
    whole = _greedy(backend, images, 6, logprobs=whole_logprobs)
    chunked_backend = load_backend(
        str(folder),
        quant=None,
        dtype="float32",
        progress=False,
        kv_cache_gb=0.05,
        scheduler=SchedulerConfig(max_batched_tokens=7, max_prefill_tokens=7),
    )
    try:
        chunked_logprobs: list[float] = []
        chunked = _greedy(chunked_backend, images, 6, logprobs=chunked_logprobs)
    finally:
        chunked_backend.close()
    assert chunked.token_ids == whole.token_ids and whole.token_ids
    torch.testing.assert_close(
        torch.tensor(chunked_logprobs), torch.tensor(whole_logprobs), atol=1e-5, rtol=1e-5
    )


def test_prefix_cache_hits_the_same_picture_and_misses_a_changed_one(backend: RealChatModel) -> None:
    picture, other = tiny_vlm.png(100, 70, seed=9), tiny_vlm.png(100, 70, seed=10)
    first = _greedy(backend, [picture], 3)
    again = _greedy(backend, [picture], 3)
    changed = _greedy(backend, [other], 3)
    ids = backend.tokenizer.encode(_prompt(backend, 1))
    image_at = ids.index(backend.tokenizer.token_to_id("<|image_pad|>"))
    assert first.num_prompt_tokens == again.num_prompt_tokens == changed.num_prompt_tokens
    block = backend.runner.block_manager.block_size
    assert again.num_cached_tokens == (again.num_prompt_tokens - 1) // block * block
    assert changed.num_cached_tokens == image_at // block * block
    assert again.token_ids == first.token_ids


def test_second_turn_with_the_same_picture_hits_the_cache(
    folder: Path, backend: RealChatModel, reference
) -> None:
    from turbospark.chat_template import render_chat_template

    picture = tiny_vlm.png(80, 80, seed=11)
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    first_text = render_chat_template(backend.tokenizer.chat_template or "", turn, add_generation_prompt=True)
    first = _greedy(backend, [picture], 4, first_text)
    reply = backend.tokenizer.decode(first.token_ids)
    turns = [
        *turn,
        {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        {"role": "user", "content": [{"type": "text", "text": "And its colours?"}]},
    ]
    text = render_chat_template(backend.tokenizer.chat_template or "", turns, add_generation_prompt=True)
    second = _greedy(backend, [picture], 4, text)
    block = backend.runner.block_manager.block_size
    # every full block of the first turn's prompt comes from the cache
    assert second.num_cached_tokens >= (first.num_prompt_tokens - 1) // block * block
    assert second.token_ids == _hf_generate(folder, reference, text, [picture], 4)[0]


def test_errors_by_name(backend: RealChatModel) -> None:
    with pytest.raises(BackendError, match="markers"):
        backend.run_completion(
            backend.tokenizer.encode(_prompt(backend, 1)),
            GenerationConfig(max_new_tokens=1),
            [RequestImage(tiny_vlm.png(10, 10), "image/png")] * 2,
            threading.Event(),
            lambda _: None,
        )
    with pytest.raises(BackendError, match=r"'images\[0\]' could not be decoded"):
        _greedy(backend, [b"\x89PNG\r\n\x1a\n" + b"\0" * 40])
    with pytest.raises(BackendError, match="aspect ratio"):
        _greedy(backend, [tiny_vlm.png(402, 2)])


def test_vision_is_reported(backend: RealChatModel) -> None:
    info = backend.vision()
    assert info is not None and info.image_token == "<|image_pad|>"
    assert info.max_pixels == tiny_qwen2vl.PREPROCESSOR["max_pixels"]
    assert backend.details().family == "qwen2_vl"
    assert ImagePrompt(mrope=True).rope_positions(3, 5).tolist() == [[3, 4]] * 3


def test_ngram_speculation_gives_plain_decoding_tokens(folder: Path, backend: RealChatModel) -> None:
    """Verification steps of a sequence with images feed several positions past the prompt: each
    is shifted as a plain decode step's would be."""
    from turbospark.engine.speculative import SpeculativeConfig

    images = [tiny_vlm.png(100, 70, seed=13)]
    plain_logprobs: list[float] = []
    plain = _greedy(backend, images, 24, logprobs=plain_logprobs)
    speculating = load_backend(
        str(folder),
        quant=None,
        dtype="float32",
        progress=False,
        kv_cache_gb=0.05,
        speculative=SpeculativeConfig(method="ngram", num_tokens=4, min_n=1),
    )
    try:
        logprobs: list[float] = []
        result = _greedy(speculating, images, 24, logprobs=logprobs)
        speculator = speculating.engine.speculator
        assert speculator is not None and speculator.num_proposed > 0
    finally:
        speculating.close()
    assert result.token_ids == plain.token_ids
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(plain_logprobs), atol=1e-4, rtol=1e-4)


def test_quantized_text_model_reads_images(folder: Path) -> None:
    """The serving default on a CPU: int8 text weights, the vision tower in float."""
    quantized = load_backend(str(folder), quant="int8", progress=False, kv_cache_gb=0.05)
    try:
        model = quantized.runner.model
        assert model.visual.merger.mlp[0].weight.is_floating_point()  # type: ignore[attr-defined]
        result = _greedy(quantized, [tiny_vlm.png(100, 70, seed=14)], 4)
        assert len(result.token_ids) == 4
        text = _greedy(quantized, [], 4, _prompt(quantized, 0, "Hello"))
        assert len(text.token_ids) == 4
    finally:
        quantized.close()


# The published Qwen2-VL-2B-Instruct config.json: flat text settings, M-RoPE as rope_scaling
PUBLISHED_CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "image_token_id": 151655,
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 1536,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
}


def test_published_flat_config_and_nested_config_read_alike(folder: Path) -> None:
    import json

    from turbospark.engine.models import qwen2_vl

    flat = qwen2_vl.ModelConfig.from_dict(PUBLISHED_CONFIG)
    assert (flat.hidden_size, flat.num_hidden_layers, flat.head_dim) == (1536, 28, 128)
    assert flat.mrope_section == (16, 24, 24) and flat.rope_scaling is None and flat.rope_theta == 1e6
    assert flat.tie_word_embeddings and flat.image_token_id == 151655
    assert (flat.vision.depth, flat.vision.embed_dim, flat.vision.hidden_act) == (32, 1280, "quick_gelu")
    # transformers >= 5 writes text_config and rope_parameters: the same settings
    nested = json.loads((folder / "config.json").read_text())
    text = nested["text_config"]
    as_flat = {**{k: v for k, v in text.items() if k != "rope_parameters"}, **nested}
    del as_flat["text_config"]
    rope = text["rope_parameters"]
    as_flat["rope_theta"] = rope["rope_theta"]
    as_flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    as_flat["model_type"] = "qwen2_vl"
    assert qwen2_vl.ModelConfig.from_dict(as_flat) == qwen2_vl.ModelConfig.from_dict(nested)
    with pytest.raises(ValueError, match="mrope_section"):
        qwen2_vl.ModelConfig.from_dict(
            {**PUBLISHED_CONFIG, "rope_scaling": {"type": "mrope", "mrope_section": [1, 2]}}
        )


def test_batched_sequences_with_and_without_images_match_their_solo_runs(backend: RealChatModel) -> None:
    """One step's rows from several sequences: each gets its own 3-D positions (a text-only one
    its plain index), whether its neighbours have images or not."""
    requests = [
        ([tiny_vlm.png(100, 70, seed=15)], None),
        ([], _prompt(backend, 0, "Tell me a story.")),
        ([tiny_vlm.png(40, 90, seed=16), tiny_vlm.png(70, 70, seed=17)], None),
    ]
    solo = []
    for images, text in requests:
        logprobs: list[float] = []
        solo.append((_greedy(backend, images, 8, text, logprobs).token_ids, logprobs))
    together: list = [None] * len(requests)

    def run(i: int) -> None:
        images, text = requests[i]
        logprobs: list[float] = []
        together[i] = (_greedy(backend, images, 8, text, logprobs).token_ids, logprobs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (tokens, logprobs), (solo_tokens, solo_logprobs) in zip(together, solo, strict=True):
        assert tokens == solo_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(solo_logprobs), atol=1e-4, rtol=1e-4)
