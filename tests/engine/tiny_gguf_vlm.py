"""A tiny SmolVLM as llama.cpp ships it: a text GGUF plus an `mmproj` GGUF, written from the
Hugging Face folder `tiny_vlm.save_folder` makes, with the names, layout and metadata of
llama.cpp's converter (convert_hf_to_gguf.py: its Llama text model, with q/k rows permuted for
llama.cpp's RoPE, and its SmolVLM mmproj, renamed only).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from tests.engine import tiny_vlm

from turbospark.engine.gguf_file import GGUFFile
from turbospark.engine.gguf_tokenizer import TOKEN_CONTROL
from turbospark.engine.loader import default_model_path

F32, F16 = GGMLQuantizationType.F32, GGMLQuantizationType.F16


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What the converter does to a llama q/k projection's rows (halves -> interleaved pairs)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_TEXT_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_text_gguf(folder: Path, path: Path) -> None:
    """The folder's text model as a llama GGUF (float32), with SmolVLM's vocabulary (SmolLM2's
    plus its special tokens, marked CONTROL as the converter marks special added tokens) and
    its chat template."""
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    base = GGUFFile(default_model_path())
    tokens = base.strings("tokenizer.ggml.tokens")
    merges = base.strings("tokenizer.ggml.merges")
    assert tokens is not None and merges is not None
    types = [int(t) for t in base.metadata["tokenizer.ggml.token_type"]]
    tokens = [*tokens, *tiny_vlm.SPECIALS]
    types += [TOKEN_CONTROL] * len(tiny_vlm.SPECIALS)
    assert len(tokens) == text["vocab_size"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]

    writer = GGUFWriter(str(path), arch="llama")
    writer.add_name("SmolVLM tiny")
    writer.add_block_count(text["num_hidden_layers"])
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base((text.get("rope_parameters") or text)["rope_theta"])
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_rope_dimension_count(text["hidden_size"] // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(int(base.metadata["tokenizer.ggml.bos_token_id"]))
    writer.add_eos_token_id(tokens.index("<end_of_utterance>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(tiny_vlm.SMOLVLM_CHAT_TEMPLATE)

    for name, tensor in hf_tensors(folder).items():
        values = tensor.float().numpy()
        if name == "lm_head.weight":
            gguf_name = "output.weight"
        elif name == "model.text_model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.text_model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name.startswith("model.text_model.layers."):
            layer, _, rest = name.removeprefix("model.text_model.layers.").partition(".")
            module, _, kind = rest.rpartition(".")
            gguf_name = f"blk.{layer}.{_TEXT_LAYER[module]}.{kind}"
            if module == "self_attn.q_proj":
                values = llama_cpp_permute(values, heads)
            elif module == "self_attn.k_proj":
                values = llama_cpp_permute(values, kv_heads)
        else:
            continue  # the vision tower and connector go to the mmproj
        writer.add_tensor(gguf_name, np.ascontiguousarray(values))
    _finish(writer)


_VISION_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}
_VISION_GLOBAL = {
    "model.vision_model.embeddings.patch_embedding": "v.patch_embd",
    "model.vision_model.embeddings.position_embedding": "v.position_embd",
    "model.vision_model.post_layernorm": "v.post_ln",
    "model.connector.modality_projection.proj": "mm.model.fc",
}


def mmproj_name(hf_name: str) -> str | None:
    module, _, kind = hf_name.rpartition(".")
    if module in _VISION_GLOBAL:
        return f"{_VISION_GLOBAL[module]}.{kind}"
    prefix = "model.vision_model.encoder.layers."
    if module.startswith(prefix):
        layer, _, rest = module.removeprefix(prefix).partition(".")
        return f"v.blk.{layer}.{_VISION_LAYER[rest]}.{kind}"
    return None


def write_mmproj(
    folder: Path,
    path: Path,
    *,
    weight_type: GGMLQuantizationType = F32,
    projector_type: str = "idefics3",
    metadata: Mapping[str, Any] | None = None,
    edit: Callable[[str, np.ndarray], np.ndarray | None] | None = None,
) -> None:
    """The folder's vision tower and connector as llama.cpp's SmolVLM mmproj. `weight_type`:
    what 2-D+ weights are stored as (the converter's default is F16; the patch and position
    embeddings stay F32, as it forces; norms and biases are F32). `metadata`: keys to override
    (None drops one); `edit(gguf_name, values)`: a changed tensor, or None to leave it out."""
    config = json.loads((folder / "config.json").read_text())
    vision, text = config["vision_config"], config["text_config"]
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    keys: dict[str, Any] = {
        "general.type": ("str", "mmproj"),
        "clip.has_vision_encoder": ("bool", True),
        "clip.projector_type": ("str", projector_type),
        "clip.vision.projection_dim": ("u32", text["hidden_size"]),
        "clip.vision.image_size": ("u32", vision["image_size"]),
        "clip.vision.patch_size": ("u32", vision["patch_size"]),
        "clip.vision.embedding_length": ("u32", vision["hidden_size"]),
        "clip.vision.feed_forward_length": ("u32", vision["intermediate_size"]),
        "clip.vision.block_count": ("u32", vision["num_hidden_layers"]),
        "clip.vision.attention.head_count": ("u32", vision["num_attention_heads"]),
        "clip.vision.image_mean": ("f32s", pre["image_mean"]),
        "clip.vision.image_std": ("f32s", pre["image_std"]),
        "clip.vision.attention.layer_norm_epsilon": ("f32", vision.get("layer_norm_eps", 1e-6)),
        "clip.vision.projector.scale_factor": ("u32", config.get("scale_factor", 2)),
        "clip.use_gelu": ("bool", True),
        "clip.vision.preproc_image_size": ("u32", pre["size"]["longest_edge"]),
    }
    writer = GGUFWriter(str(path), arch="clip")
    for key, value in (metadata or {}).items():
        if value is None:
            keys.pop(key, None)
        else:
            keys[key] = value
    for key, (kind, value) in keys.items():
        if kind == "str":
            writer.add_string(key, value)
        elif kind == "bool":
            writer.add_bool(key, value)
        elif kind == "u32":
            writer.add_uint32(key, value)
        elif kind == "f32":
            writer.add_float32(key, value)
        else:
            writer.add_array(key, [float(v) for v in value])
    for name, tensor in hf_tensors(folder).items():
        gguf_name = mmproj_name(name)
        if gguf_name is None:
            continue
        values: np.ndarray | None = tensor.float().numpy()
        if edit is not None:
            assert values is not None
            values = edit(gguf_name, values)
            if values is None:
                continue
        forced_f32 = gguf_name.startswith(("v.patch_embd", "v.position_embd"))
        if values.ndim >= 2 and weight_type == F16 and not forced_f32:
            writer.add_tensor(gguf_name, values.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(values, dtype=np.float32))
    _finish(writer)


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_pair(folder: Path, out: Path, **mmproj: Any) -> tuple[Path, Path]:
    """`out`/SmolVLM-tiny-F32.gguf and `out`/mmproj-SmolVLM-tiny-F32.gguf (llama.cpp's naming)."""
    out.mkdir(parents=True, exist_ok=True)
    text, proj = out / "SmolVLM-tiny-F32.gguf", out / "mmproj-SmolVLM-tiny-F32.gguf"
    write_text_gguf(folder, text)
    write_mmproj(folder, proj, **mmproj)
    return text, proj
