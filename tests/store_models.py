"""Tiny random-weight chat models written to disk, for tests that load models by name.

`write_tiny_hf` saves a two-layer Llama with transformers' own `save_pretrained` (safetensors)
and the tokenizer of the packaged SmolLM2 GGUF (converted once per process), so the folder
loads like any Hugging Face checkpoint in well under a second.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.cache
def _hf_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    from turbospark.engine.gguf_file import GGUFFile
    from turbospark.engine.gguf_tokenizer import load_gguf_tokenizer
    from turbospark.engine.loader import default_model_path

    tokenizer, _ = load_gguf_tokenizer(GGUFFile(default_model_path()))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )


def write_tiny_hf(folder: Path, seed: int = 0, max_positions: int = 2048) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, safe_serialization=True)
    GenerationConfig(eos_token_id=[2], bos_token_id=1).save_pretrained(folder)
    _hf_tokenizer().save_pretrained(folder)
    return folder
