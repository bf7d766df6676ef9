"""Idefics3 / SmolVLM against transformers on the same weights, pixels and prompt (float32, CPU):
the image processor, the prompt's image tokens, the vision tower's output, the merged input
embeddings and the next-token logits, through the engine's own step path with a chunk boundary
inside an image's tokens; and the prefix cache keyed by the picture's content."""

from __future__ import annotations

import io
import itertools
import threading
from pathlib import Path

import pytest
import torch
from tests.engine import tiny_vlm

from turbospark.backend import BackendError, GenerationConfig, RequestImage
from turbospark.engine.backend import RealChatModel, load_backend
from turbospark.engine.runner import StepInputs
from turbospark.engine.vision import Idefics3ImageProcessor, ImagePrompt, decode_image, expand_prompt

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-smolvlm")
    tiny_vlm.save_folder(path)
    return path


@pytest.fixture(scope="module")
def reference(folder: Path):
    import transformers

    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def backend(folder: Path) -> RealChatModel:
    return load_backend(str(folder), quant=None, dtype="float32", progress=False, kv_cache_gb=0.05)


def _pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


@pytest.mark.parametrize(
    ("width", "height"), [(100, 70), (70, 100), (40, 30), (300, 64), (64, 64), (129, 257), (1, 1)]
)
def test_image_processor_matches_transformers(folder: Path, width: int, height: int) -> None:
    data = tiny_vlm.png(width, height, seed=width * 7 + height)
    ours = Idefics3ImageProcessor.from_folder(folder).process(decode_image(data))
    theirs = tiny_vlm.hf_processor(folder).image_processor(
        [_pil(data)], return_tensors="pt", return_row_col_info=True
    )
    assert (ours.rows, ours.cols) == (theirs["rows"][0][0], theirs["cols"][0][0])
    expected = theirs["pixel_values"][0]
    assert ours.pixel_values.shape == expected.shape
    torch.testing.assert_close(ours.pixel_values, expected, atol=1e-6, rtol=0)


def test_image_processor_without_splitting(tmp_path: Path) -> None:
    pre = {**tiny_vlm.PREPROCESSOR, "do_image_splitting": False}
    (tmp_path / "preprocessor_config.json").write_text(__import__("json").dumps(pre))
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    data = tiny_vlm.png(90, 50)
    ours = Idefics3ImageProcessor.from_folder(tmp_path).process(decode_image(data))
    theirs = Idefics3ImageProcessorPil(**{k: v for k, v in pre.items() if k != "image_processor_type"})(
        [_pil(data)], return_tensors="pt"
    )
    assert (ours.rows, ours.cols) == (0, 0)
    torch.testing.assert_close(ours.pixel_values, theirs["pixel_values"][0], atol=1e-6, rtol=0)


def _prompt(backend: RealChatModel, n_images: int, text: str = "What is in the picture?") -> str:
    from turbospark.chat_template import render_chat_template

    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return render_chat_template(
        backend.tokenizer.chat_template or "",
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
    )


def test_prompt_tokens_match_transformers_processor(folder: Path, backend: RealChatModel) -> None:
    images = [tiny_vlm.png(100, 70, seed=1), tiny_vlm.png(50, 40, seed=2)]
    text = _prompt(backend, 2)
    ids = backend.tokenizer.encode(text)
    spec = backend._vision
    assert spec is not None
    ours, prompt = expand_prompt(ids, [RequestImage(d, "image/png") for d in images], spec, backend.tokenizer)
    theirs = tiny_vlm.hf_processor(folder)(
        text=[text], images=[[_pil(d) for d in images]], return_tensors="pt"
    )
    assert ours == theirs["input_ids"][0].tolist()
    assert len(prompt.images) == 2
    frames = sum(img.pixel_values.shape[0] for img in prompt.images)
    torch.testing.assert_close(
        torch.cat([img.pixel_values for img in prompt.images]),
        theirs["pixel_values"][0][:frames],
        atol=1e-6,
        rtol=0,
    )


def _hf_inputs(folder: Path, backend: RealChatModel, images: list[bytes]):
    text = _prompt(backend, len(images))
    proc = tiny_vlm.hf_processor(folder)
    return proc(text=[text], images=[[_pil(d) for d in images]], return_tensors="pt")


def test_encoder_embeddings_and_logits_match_transformers(
    folder: Path, backend: RealChatModel, reference
) -> None:
    images = [tiny_vlm.png(100, 70, seed=3), tiny_vlm.png(60, 90, seed=4)]
    inputs = _hf_inputs(folder, backend, images)
    spec = backend._vision
    assert spec is not None
    ids, prompt = expand_prompt(
        backend.tokenizer.encode(_prompt(backend, 2)),
        [RequestImage(d, "image/png") for d in images],
        spec,
        backend.tokenizer,
    )
    assert ids == inputs["input_ids"][0].tolist()
    model = backend.runner.model
    with torch.no_grad():
        # the vision tower and connector: one embedding per <image> token
        pixels = torch.cat([img.pixel_values for img in prompt.images])
        ours = model.encode_images(pixels)  # type: ignore[attr-defined]
        feats = reference.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])
        theirs = torch.cat(list(feats.pooler_output))
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
        # the merged input embeddings
        ids_t = inputs["input_ids"]
        merged = reference.model.inputs_merger(ids_t, reference.model.get_input_embeddings()(ids_t), theirs)[
            0
        ]
        rows = torch.tensor([p for img in prompt.images for p in img.positions])
        x = model.model.embed_tokens(torch.tensor(ids))  # type: ignore[union-attr]
        x.index_copy_(0, rows, ours)
        torch.testing.assert_close(x, merged, atol=1e-5, rtol=1e-4)
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
        from turbospark.engine.vision import step_embeds

        step.embeds = step_embeds([prompt], [start], [end - start], model.encode_images, runner.device)  # type: ignore[attr-defined]
        logits = runner.run_step(step).logits[0]
    runner.block_manager.release(table)
    assert logits is not None
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def _greedy(backend: RealChatModel, images: list[bytes], n: int = 8):
    ids = backend.tokenizer.encode(_prompt(backend, len(images)))
    config = GenerationConfig(max_new_tokens=n, temperature=0.0)
    return backend.run_completion(
        ids, config, [RequestImage(d, "image/png") for d in images], threading.Event(), lambda _: None
    )


def test_greedy_tokens_match_transformers_generate(folder: Path, backend: RealChatModel, reference) -> None:
    images = [tiny_vlm.png(100, 70, seed=5)]
    inputs = _hf_inputs(folder, backend, images)
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None)
    expected = out[0, inputs["input_ids"].shape[1] :].tolist()
    result = _greedy(backend, images, 6)
    assert result.token_ids == expected[: len(result.token_ids)] and result.token_ids


def test_prefix_cache_hits_the_same_picture_and_misses_a_changed_one(backend: RealChatModel) -> None:
    picture, other = tiny_vlm.png(100, 70, seed=6), tiny_vlm.png(100, 70, seed=7)
    first = _greedy(backend, [picture], 2)
    again = _greedy(backend, [picture], 2)
    changed = _greedy(backend, [other], 2)
    ids = backend.tokenizer.encode(_prompt(backend, 1))
    image_at = ids.index(backend.tokenizer.token_to_id("<image>"))
    assert first.num_prompt_tokens == again.num_prompt_tokens == changed.num_prompt_tokens
    # the repeat shares every full block but the last token's; the changed picture only the
    # blocks before its first image token
    block = backend.runner.block_manager.block_size
    assert again.num_cached_tokens == (again.num_prompt_tokens - 1) // block * block
    assert changed.num_cached_tokens == image_at // block * block
    assert again.token_ids == first.token_ids


def test_two_images_in_one_prompt_and_errors_by_name(backend: RealChatModel) -> None:
    result = _greedy(backend, [tiny_vlm.png(100, 70, seed=8), tiny_vlm.png(30, 80, seed=9)], 3)
    assert len(result.token_ids) == 3
    with pytest.raises(BackendError, match="markers"):
        _greedy_mismatch = backend.tokenizer.encode(_prompt(backend, 1))
        backend.run_completion(
            _greedy_mismatch,
            GenerationConfig(max_new_tokens=1),
            [RequestImage(tiny_vlm.png(10, 10), "image/png")] * 2,
            threading.Event(),
            lambda _: None,
        )
    with pytest.raises(BackendError, match=r"'images\[0\]' could not be decoded"):
        _greedy(backend, [b"\x89PNG\r\n\x1a\n" + b"\0" * 40])


def test_vision_is_reported(backend: RealChatModel) -> None:
    info = backend.vision()
    assert info is not None and info.image_token == "<image>"
    assert isinstance(ImagePrompt().cache_ids([1, 2]), list)
