"""Hugging Face checkpoint folders: by path and by id from a local HF cache, and their failures.

Tiny random-weight models are saved with transformers' save_pretrained (safetensors) together
with a tokenizer converted from the embedded SmolLM2 GGUF.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from turbospark.engine.gguf_file import GGUFFile
from turbospark.engine.gguf_tokenizer import load_gguf_tokenizer
from turbospark.engine.hf_loader import read_safetensors
from turbospark.engine.loader import (
    ModelLoadError,
    ModelNotFound,
    default_model_path,
    load_checkpoint,
    resolve_model_spec,
)

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path_factory.getbasetemp() / "turbospark-cache"))


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    tokenizer, _ = load_gguf_tokenizer(GGUFFile(default_model_path()))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
    )


def save_tiny(folder: Path, hf_tokenizer, model_type: str = "llama", dtype=torch.float32, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(eos_token_id=[2, 0], bos_token_id=1).save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return model


def test_tiny_llama_folder_round_trip(tmp_path, hf_tokenizer):
    folder = tmp_path / "tiny-llama"
    model = save_tiny(folder, hf_tokenizer)
    ckpt = load_checkpoint(str(folder), progress=False)
    assert ckpt.name == "tiny-llama" and ckpt.source == str(folder)
    reference = model.state_dict()
    assert set(ckpt.tensors) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(ckpt.tensors[name], tensor), name
    config = ckpt.config
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (64, 2, 2)
    assert config["head_dim"] == 16
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32"
    tc = ckpt.tokenizer_config
    assert tc["chat_template"] == CHAT_TEMPLATE
    assert tc["eos_token"] == "<|im_end|>" and tc["bos_token"] == "<|im_start|>"
    assert tc["eos_token_ids"] == [2, 0]
    text = "Hello <|im_start|>world 123 😀"
    assert ckpt.tokenizer.encode(text).ids == hf_tokenizer.encode(text)


def test_bf16_qwen2_folder_keeps_dtype_and_biases(tmp_path, hf_tokenizer):
    folder = tmp_path / "tiny-qwen2"
    model = save_tiny(folder, hf_tokenizer, model_type="qwen2", dtype=torch.bfloat16)
    ckpt = load_checkpoint(str(folder), progress=False)
    q_bias = ckpt.tensors["model.layers.0.self_attn.q_proj.bias"]
    assert q_bias.dtype == torch.bfloat16
    assert torch.equal(q_bias, model.state_dict()["model.layers.0.self_attn.q_proj.bias"])
    assert ckpt.config["model_type"] == "qwen2"
    assert ckpt.config["torch_dtype"] == "bfloat16"


def test_safetensors_are_memory_mapped_views(tmp_path, hf_tokenizer):
    folder = tmp_path / "tiny"
    save_tiny(folder, hf_tokenizer)
    tensors = read_safetensors(folder / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    # views of one map: each tensor sits at its file offset from one base address, no copies
    raw = (folder / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    bases = {t.data_ptr() - header[name]["data_offsets"][0] for name, t in tensors.items()}
    assert len(bases) == 1
    embed.add_(1.0)  # copy-on-write: the file itself is untouched
    assert not torch.equal(read_safetensors(folder / "model.safetensors")["model.embed_tokens.weight"], embed)


def test_sharded_checkpoint_and_config_json_path(tmp_path, hf_tokenizer):
    folder = tmp_path / "sharded"
    model = save_tiny(tmp_path / "whole", hf_tokenizer)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="1MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tmp_path / "whole" / name, folder / name)
    assert (folder / "model.safetensors.index.json").is_file()
    assert resolve_model_spec(str(folder / "config.json")) == ("hf", folder)
    ckpt = load_checkpoint(str(folder), progress=False)
    assert set(ckpt.tensors) == set(model.state_dict())


def test_hf_id_from_local_cache(tmp_path, hf_tokenizer, monkeypatch):
    hub = tmp_path / "hub"
    repo = hub / "models--TestOrg--Tiny-Chat"
    snapshot = repo / "snapshots" / "abc123"
    save_tiny(snapshot, hf_tokenizer)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert resolve_model_spec("TestOrg/Tiny-Chat") == ("hf", snapshot)
    ckpt = load_checkpoint("TestOrg/Tiny-Chat", progress=False)
    assert ckpt.name == "Tiny-Chat"
    assert ckpt.source == str(snapshot)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub is the same cache
    assert resolve_model_spec("TestOrg/Tiny-Chat") == ("hf", snapshot)
    with pytest.raises(ModelNotFound, match=r"TestOrg/Other.*Hugging Face cache"):
        resolve_model_spec("TestOrg/Other")


def test_chat_template_from_jinja_file(tmp_path, hf_tokenizer):
    folder = tmp_path / "tiny"
    save_tiny(folder, hf_tokenizer)
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.pop("chat_template", None)
    config_path.write_text(json.dumps(tokenizer_config))
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert (
        load_checkpoint(str(folder), progress=False).tokenizer_config["chat_template"]
        == "{{ messages[0].content }}"
    )


def test_folder_without_config_json(tmp_path, hf_tokenizer):
    folder = tmp_path / "no-config"
    save_tiny(folder, hf_tokenizer)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no-config: not a model folder \(no config.json"):
        load_checkpoint(str(folder), progress=False)


def test_folder_without_safetensors(tmp_path, hf_tokenizer):
    folder = tmp_path / "no-weights"
    save_tiny(folder, hf_tokenizer)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x00")
    with pytest.raises(ModelLoadError, match=r"no-weights: no \*\.safetensors weights \(pytorch_model\.bin"):
        load_checkpoint(str(folder), progress=False)


def test_truncated_safetensors(tmp_path, hf_tokenizer):
    folder = tmp_path / "cut"
    save_tiny(folder, hf_tokenizer)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated: tensor"):
        load_checkpoint(str(folder), progress=False)
    weights.write_bytes(data[:20])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated or not a safetensors file"):
        load_checkpoint(str(folder), progress=False)


def test_folder_without_tokenizer_json(tmp_path, hf_tokenizer):
    folder = tmp_path / "no-tokenizer"
    save_tiny(folder, hf_tokenizer)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no-tokenizer: no tokenizer\.json"):
        load_checkpoint(str(folder), progress=False)


def test_quantized_checkpoint_is_refused(tmp_path, hf_tokenizer):
    folder = tmp_path / "awq"
    save_tiny(folder, hf_tokenizer)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config\.json: quantized checkpoints \(awq\)"):
        load_checkpoint(str(folder), progress=False)


def test_dtype_option_converts_floating_tensors(tmp_path, hf_tokenizer):
    folder = tmp_path / "tiny"
    model = save_tiny(folder, hf_tokenizer)
    ckpt = load_checkpoint(str(folder), progress=False, dtype=torch.bfloat16)
    assert ckpt.config["torch_dtype"] == "bfloat16"
    for name, tensor in model.state_dict().items():
        assert torch.equal(ckpt.tensors[name], tensor.to(torch.bfloat16)), name
