"""A tiny random-weight Qwen2-VL (or Qwen2.5-VL) folder built with transformers, for the vision tests.

Qwen2-VL's shape, shrunk: a vision tower over 6-pixel patches of two frames (48 wide, 4 heads of
12, so the 2-D rotary has three frequencies per axis), 2 x 2 patches merged into one token, a
Qwen2 text model with GQA and M-RoPE (head_dim 16: mrope_section [2, 3, 3]); Qwen2-VL's chat
template and special tokens over the packaged SmolLM2 tokenizer; a preprocessor config whose
pixel budget (576 .. 5,760 pixels: 4 .. 40 image tokens) keeps prompts short. The Qwen2.5-VL
tower has four blocks, two of them window blocks over windows of 2 x 2 merged patches (24 pixels),
so most pictures end in partial windows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tests.engine import tiny_vlm

# Qwen2-VL's template, less videos: every image part is <|vision_start|><|image_pad|><|vision_end|>
QWEN2VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PREPROCESSOR = {
    "min_pixels": 12 * 12 * 4,
    "max_pixels": 12 * 12 * 40,
    "patch_size": 6,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
VISION = {
    "depth": 2,
    "embed_dim": 48,
    "hidden_size": 64,
    "hidden_act": "quick_gelu",
    "mlp_ratio": 2,
    "num_heads": 4,
    "in_channels": 3,
    "patch_size": 6,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}

VISION_2_5 = {
    "depth": 4,
    "hidden_size": 48,
    "intermediate_size": 64,
    "hidden_act": "silu",
    "num_heads": 4,
    "in_channels": 3,
    "patch_size": 6,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 24,
    "out_hidden_size": 64,
    "fullatt_block_indexes": [1, 3],
}


def tokenizer() -> Any:
    """The packaged SmolLM2 tokenizer (which has <|im_start|> and <|im_end|>) with Qwen2-VL's
    vision tokens added."""
    import tokenizers

    tok = tiny_vlm.tokenizer()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def save_folder(
    folder: Path, seed: int = 0, preprocessor: dict[str, Any] | None = None, family: str = "qwen2_vl"
) -> Any:
    """Writes the folder (config, safetensors, tokenizer, chat template, preprocessor config) of
    `family` ("qwen2_vl" or "qwen2_5_vl"); returns transformers' model (float32, eval, eager
    attention)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    text = {
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": None,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
    }
    two_five = family == "qwen2_5_vl"
    config_class = transformers.Qwen2_5_VLConfig if two_five else transformers.Qwen2VLConfig
    config = config_class(
        text_config=text,
        vision_config=VISION_2_5 if two_five else VISION,
        image_token_id=tok.token_to_id("<|image_pad|>"),
        video_token_id=tok.token_to_id("<|video_pad|>"),
        vision_start_token_id=tok.token_to_id("<|vision_start|>"),
        vision_end_token_id=tok.token_to_id("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model_class = (
        transformers.Qwen2_5_VLForConditionalGeneration
        if two_five
        else transformers.Qwen2VLForConditionalGeneration
    )
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # a wrong mapping must show
            if "norm" in name or "ln_q" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    end = tok.token_to_id("<|im_end|>")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": None, "eos_token": "<|im_end|>", "chat_template": QWEN2VL_CHAT_TEMPLATE})
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [end]}))
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor or PREPROCESSOR))
    return model


def hf_image_processor(folder: Path) -> Any:
    """transformers' own image processor for the folder (the PIL one, the slow path)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pre = json.loads((folder / "preprocessor_config.json").read_text())
    pre = {k: v for k, v in pre.items() if k not in ("image_processor_type", "processor_class")}
    return Qwen2VLImageProcessorPil(**pre)


def hf_inputs(folder: Path, text: str, images: list[bytes]) -> dict[str, torch.Tensor]:
    """What transformers' Qwen2VLProcessor hands the model for a rendered prompt and its pictures
    (that class needs torchvision for its video processor, so its text step is done here as it
    does it): each <|image_pad|> repeated t*h*w / merge**2 times, tokenized by transformers' own
    tokenizer; the image processor's pixel_values and image_grid_thw; mm_token_type_ids."""
    import io

    import transformers
    from PIL import Image

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    pictures = [Image.open(io.BytesIO(d)).convert("RGB") for d in images]
    out = dict(hf_image_processor(folder)(pictures, return_tensors="pt")) if images else {}
    merge = PREPROCESSOR["merge_size"]
    pad = "<|image_pad|>"
    parts = text.split(pad)
    assert len(parts) == len(images) + 1
    expanded = parts[0]
    for n, part in enumerate(parts[1:]):
        expanded += pad * (int(out["image_grid_thw"][n].prod()) // merge**2) + part
    ids = tok(expanded, return_tensors="pt")["input_ids"]
    out["input_ids"] = ids
    out["attention_mask"] = torch.ones_like(ids)
    out["mm_token_type_ids"] = (ids == tok.convert_tokens_to_ids(pad)).int()
    return out
