"""A tiny random-weight Idefics3 / SmolVLM folder built with transformers, for the vision tests.

SmolVLM's shape, shrunk: a SigLIP tower (patch 8 on 64-pixel tiles: 64 patches), pixel shuffle
by 2 (16 embeddings per tile), a Llama text model with GQA, SmolVLM's chat template and its
special tokens over the packaged SmolLM2 tokenizer (the real BPE, so "\\n\\n" merges as in
SmolVLM's own), and a preprocessor config that splits images into 64-pixel tiles after
resizing the longest edge to 128.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import torch

SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SPECIALS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
]
PREPROCESSOR = {
    "image_processor_type": "Idefics3ImageProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "size": {"longest_edge": 128},
    "max_image_size": {"longest_edge": 64},
    "do_image_splitting": True,
    "resample": 1,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_pad": True,
}
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 64,
    "patch_size": 8,
    "layer_norm_eps": 1e-6,
}
SEQ_LEN = 16  # (64 / 8) ** 2 / 2 ** 2


def tokenizer() -> Any:
    """The packaged SmolLM2 tokenizer with SmolVLM's special tokens added. A machine without the
    model package (a GPU host the tests are copied to) names that tokenizer saved as JSON
    (`tok.to_str()` of this function's `tok`) in TURBOSPARK_TEST_TOKENIZER instead."""
    import tokenizers

    from turbospark.engine.gguf_loader import GGUFFile
    from turbospark.engine.gguf_tokenizer import load_gguf_tokenizer
    from turbospark.engine.loader import default_model_path

    saved = os.environ.get("TURBOSPARK_TEST_TOKENIZER")
    tok = (
        tokenizers.Tokenizer.from_file(saved)
        if saved
        else load_gguf_tokenizer(GGUFFile(default_model_path()))[0]
    )
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def save_folder(folder: Path, seed: int = 0, preprocessor: dict[str, Any] | None = None) -> Any:
    """Writes the folder (config, safetensors, tokenizer, chat template, preprocessor config);
    returns transformers' model (float32, eval)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizer()
    vocab = tok.get_vocab_size()
    text = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    config = transformers.Idefics3Config(
        text_config=text,
        vision_config=VISION,
        scale_factor=2,
        image_token_id=tok.token_to_id("<image>"),
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # a wrong mapping must show
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    eou = tok.token_to_id("<end_of_utterance>")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": None, "eos_token": "<end_of_utterance>", "chat_template": SMOLVLM_CHAT_TEMPLATE}
        )
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eou]}))
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor or PREPROCESSOR))
    return model


def hf_processor(folder: Path) -> Any:
    """transformers' own processor for the folder (the PIL image processor, as the slow one)."""
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    pre = json.loads((folder / "preprocessor_config.json").read_text())
    pre = {k: v for k, v in pre.items() if k != "image_processor_type"}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    return transformers.Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(**pre), tokenizer=tok, image_seq_len=SEQ_LEN
    )


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A random-noise RGB picture as PNG bytes (smooth gradients plus noise, so resizing matters)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) % 256], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    arr = ((base + noise) % 256).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()
