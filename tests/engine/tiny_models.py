"""Tiny random-weight checkpoints for the engine tests, shaped like real configs.

Each family keeps the features of its real config that matter to the model code (GQA, tied
embeddings, llama3 rope scaling, q/k/v biases, q/k norms, a head_dim that is not
hidden_size / num_heads) at a size that runs in milliseconds.
"""

from __future__ import annotations

from typing import Any

import torch

# SmolLM2-135M's shape, shrunk: GQA 4:2, tied embeddings
LLAMA = {
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
# Llama 3.2's shape, shrunk: llama3 rope scaling (tiny original context so the bands matter)
LLAMA3 = {
    **LLAMA,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
}
# Qwen2.5's shape, shrunk: q/k/v biases, tied embeddings, large rope_theta
QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}
# Qwen3's shape, shrunk: q/k norms, head_dim 32 with hidden 64 and 4 heads (not 64 / 4)
QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

FAMILIES = {"llama": LLAMA, "llama3": LLAMA3, "qwen2": QWEN2, "qwen3": QWEN3}


def reference_model(config: dict[str, Any], seed: int = 0, init_std: float = 0.02) -> Any:
    """The transformers implementation with random weights, fp32, eval mode."""
    import transformers

    kind = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[config["model_type"]]
    hf_config = getattr(transformers, f"{kind}Config")(**config, initializer_range=init_std)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, f"{kind}ForCausalLM")(hf_config).eval()
    with torch.no_grad():
        # norms start at 1 and biases at 0; randomize them so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def checkpoint(
    config: dict[str, Any], seed: int = 0, init_std: float = 0.02
) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
    """(config, tensors, reference) the way the loader hands them over: HF names, float."""
    ref = reference_model(config, seed, init_std)
    tensors = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return dict(config), tensors, ref


# A word-level tokenizer over the tiny models' 320 ids (4 specials, then w0 .. w315) and a chat
# template that joins the messages' texts, so a served tiny model reads and writes words.
WORD_VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3} | {f"w{i}": i + 4 for i in range(316)}
WORD_CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }} {% endfor %}"


def save_folder(folder: Any, config: dict[str, Any], seed: int = 0, init_std: float = 0.02) -> Any:
    """Writes a Hugging Face folder (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json) of a tiny random-weight model; returns the reference model."""
    import json
    from pathlib import Path

    import tokenizers
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg, tensors, ref = checkpoint(config, seed, init_std)
    if cfg.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # saved once, as transformers does
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(WORD_VOCAB, unk_token="<unk>"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    hf.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    hf.save(str(folder / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": WORD_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return ref
