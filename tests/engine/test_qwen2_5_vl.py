"""Qwen2.5-VL against transformers on the same weights, pixels and prompt (float32, CPU): the
window order, the vision tower (window and full-attention blocks, RMSNorm, gated MLP), the prompt
logits through the engine's step path with a chunk boundary inside an image, greedy generation
with every step's logprob, and the prefix cache. What it shares with Qwen2-VL (the image
processor, M-RoPE positions, batching, the APIs) is tested in test_qwen2vl.py."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest
import torch
from tests.engine import tiny_qwen2vl, tiny_vlm

from turbospark.backend import GenerationConfig, RequestImage
from turbospark.engine.backend import RealChatModel, load_backend
from turbospark.engine.models import qwen2_5_vl
from turbospark.engine.runner import StepInputs
from turbospark.engine.vision import expand_prompt, step_embeds

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2_5_vl")
    tiny_qwen2vl.save_folder(path, family="qwen2_5_vl")
    return path


@pytest.fixture(scope="module")
def reference(folder: Path):
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def backend(folder: Path) -> RealChatModel:
    return load_backend(str(folder), quant=None, dtype="float32", progress=False, kv_cache_gb=0.05)


def _prompt(backend: RealChatModel, n_images: int, text: str = "What is in the picture?") -> str:
    from turbospark.chat_template import render_chat_template

    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return render_chat_template(
        backend.tokenizer.chat_template or "",
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
    )


@pytest.mark.parametrize("grid", [(1, 10, 14), (1, 8, 8), (2, 6, 10), (1, 2, 2)])
def test_window_order_matches_transformers(grid: tuple[int, int, int]) -> None:
    from transformers.vision_utils import get_vision_window_index

    grids = [grid, (1, 4, 6)]
    order, lengths = qwen2_5_vl.windows(grids, merge=2, side=2)
    index, cu = get_vision_window_index(
        torch.tensor(grids), spatial_merge_size=2, window_size=24, patch_size=6
    )
    assert order.tolist() == index.tolist()
    assert list(itertools.accumulate(n * 4 for n in lengths)) == cu.tolist()[1:]


def test_vision_tower_and_logits_match_transformers(folder: Path, backend: RealChatModel, reference) -> None:
    images = [tiny_vlm.png(100, 70, seed=1), tiny_vlm.png(60, 90, seed=2)]
    text = _prompt(backend, 2)
    inputs = tiny_qwen2vl.hf_inputs(folder, text, images)
    spec = backend._vision
    assert spec is not None
    ids, prompt = expand_prompt(
        backend.tokenizer.encode(text),
        [RequestImage(d, "image/png") for d in images],
        spec,
        backend.tokenizer,
    )
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


def _greedy(backend: RealChatModel, images: list[bytes], n: int, logprobs: list[float]):
    ids = backend.tokenizer.encode(_prompt(backend, len(images)))
    config = GenerationConfig(max_new_tokens=n, temperature=0.0, num_top_logprobs=0)
    return backend.run_completion(
        ids,
        config,
        [RequestImage(d, "image/png") for d in images],
        threading.Event(),
        lambda e: logprobs.append(e.logprob),
    )


def test_greedy_tokens_and_logprobs_match_transformers_generate(
    folder: Path, backend: RealChatModel, reference
) -> None:
    images = [tiny_vlm.png(100, 70, seed=3), tiny_vlm.png(50, 90, seed=4)]
    inputs = tiny_qwen2vl.hf_inputs(folder, _prompt(backend, 2), images)
    with torch.no_grad():
        out = reference.generate(
            **inputs,
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    expected = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    expected_logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, expected, strict=True)
    ]
    logprobs: list[float] = []
    result = _greedy(backend, images, 8, logprobs)
    assert len(result.token_ids) == 8, "the tiny model ended its turn early: pick another seed"
    assert result.token_ids == expected
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-4, rtol=1e-4)


def test_prefix_cache_hits_the_same_picture(backend: RealChatModel) -> None:
    picture = tiny_vlm.png(100, 70, seed=5)
    first = _greedy(backend, [picture], 3, [])
    again = _greedy(backend, [picture], 3, [])
    block = backend.runner.block_manager.block_size
    assert again.num_cached_tokens == (again.num_prompt_tokens - 1) // block * block
    assert again.token_ids == first.token_ids
    info = backend.vision()
    assert info is not None and info.image_token == "<|image_pad|>"
    assert backend.details().family == "qwen2_5_vl"
