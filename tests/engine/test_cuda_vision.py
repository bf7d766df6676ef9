"""Vision models on CUDA (marker `gpu`): a prompt with two pictures through the engine's step path
in bfloat16 (the vision tower, the injected image embeddings and, for Qwen2-VL, the M-RoPE
positions) against transformers' float32 forward on the same weights, held to the bf16 rule the
text models keep (no further from float32 than twice transformers' own bf16 forward, plus 1e-3);
and a greedy reply generated on the device."""

from __future__ import annotations

import copy
import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.engine import tiny_qwen2vl, tiny_vlm

from turbospark.backend import GenerationConfig, RequestImage
from turbospark.engine.backend import RealChatModel, load_backend
from turbospark.engine.runner import StepInputs
from turbospark.engine.vision import expand_prompt, step_embeds

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("PIL")

IMAGES = [tiny_vlm.png(100, 70, seed=3), tiny_vlm.png(60, 90, seed=4)]


def _prompt(backend: RealChatModel, n_images: int) -> str:
    from turbospark.chat_template import render_chat_template

    content = [{"type": "image"}] * n_images + [{"type": "text", "text": "What is in the picture?"}]
    return render_chat_template(
        backend.tokenizer.chat_template or "",
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
    )


def _pil(data: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


def _family(name: str, folder: Path) -> Any:
    """Writes the tiny checkpoint of `name` to `folder`; transformers' float32 model of it."""
    import transformers

    if name == "idefics3":
        tiny_vlm.save_folder(folder)
        ref = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    else:
        tiny_qwen2vl.save_folder(folder)
        ref = transformers.Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    return ref.eval()


@pytest.mark.parametrize("family", ["idefics3", "qwen2_vl"])
def test_vision_prompt_logits_on_cuda_keep_the_bf16_rule(family: str, tmp_path: Path) -> None:
    ref = _family(family, tmp_path)
    backend = load_backend(str(tmp_path), quant=None, dtype="bfloat16", device="cuda", progress=False)
    text = _prompt(backend, len(IMAGES))
    if family == "idefics3":
        inputs = tiny_vlm.hf_processor(tmp_path)(
            text=[text], images=[[_pil(d) for d in IMAGES]], return_tensors="pt"
        )
    else:
        inputs = tiny_qwen2vl.hf_inputs(tmp_path, text, IMAGES)
    spec = backend._vision
    assert spec is not None
    requested = [RequestImage(d, "image/png") for d in IMAGES]
    ids, prompt = expand_prompt(backend.tokenizer.encode(text), requested, spec, backend.tokenizer)
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        ref.config._attn_implementation = "eager"
        want = ref(**inputs).logits[0, -1]
        half = copy.deepcopy(ref).to(device="cuda", dtype=torch.bfloat16)
        on_device = {k: v.to("cuda") for k, v in inputs.items()}
        on_device["pixel_values"] = on_device["pixel_values"].to(torch.bfloat16)
        hf = half(**on_device).logits[0, -1].float().cpu()
    runner = backend.runner
    table: list[int] = []
    assert runner.block_manager.grow(table, len(ids))
    step = StepInputs(ids, [table], [0], [len(ids)], [0])
    encode = runner.model.encode_images  # type: ignore[attr-defined]
    step.embeds = step_embeds([prompt], [0], [len(ids)], encode, runner.device)
    got = runner.run_step(step).logits[0].float().cpu()
    runner.block_manager.release(table)
    hf_err = (hf - want).abs().max().item()
    our_err = (got - want).abs().max().item()
    assert our_err <= 2 * hf_err + 1e-3, (our_err, hf_err)

    events: list[Any] = []
    result = backend.run_completion(
        backend.tokenizer.encode(text),
        GenerationConfig(max_new_tokens=8, temperature=0.0),
        requested,
        threading.Event(),
        events.append,
    )
    assert len(result.token_ids) >= 1 and [e.token_id for e in events] == result.token_ids
    backend.close()
