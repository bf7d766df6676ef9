"""Load a GGUF file (llama.cpp's format) as Hugging Face-named float tensors and an HF config.

Contract: `load_gguf(path, name=..., progress=...) -> LoadedCheckpoint`. The file is memory-mapped;
F32/F16/BF16 tensors are zero-copy views of it, quantized ones (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K with torch, any other type `gguf.quants` knows with numpy) are dequantized to
float32. Names are mapped to the Hugging Face ones (`blk.0.attn_q.weight` ->
`model.layers.0.self_attn.q_proj.weight`) and llama.cpp's row permutation of llama attention
q/k is undone, so the result loads into the same module tree as an HF checkpoint.

The header is parsed by `gguf_file` (not `gguf.GGUFReader`, which decodes whole vocabularies up
front). Constants and the reference dequantizers still come from the `gguf` package.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, Keys

from turbospark.engine.checkpoint import LoadedCheckpoint, ModelLoadError, sampling_from
from turbospark.engine.gguf_file import QUANT_SIZES, GGUFFile, TensorInfo
from turbospark.engine.gguf_tokenizer import load_gguf_tokenizer

# GGUF `general.architecture` -> (HF model_type, HF architectures entry, are attn_q/attn_k permuted).
# llama.cpp's converter permutes q/k rows of llama-family checkpoints (its RoPE rotates adjacent
# pairs, HF's rotates halves); qwen2/qwen3 are stored unpermuted because llama.cpp runs them in
# NeoX mode.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# --------------------------------------------------------------------------- dequantization
# Each takes (num_blocks, type_size) uint8 blocks and returns (num_blocks, block_size) float32.
# They follow ggml's reference `dequantize_row_*` (and gguf.quants' numpy port) operation for
# operation, so results are bit-identical to gguf.quants; the tests check that.


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    # (num_blocks, 1) float32 from a little-endian half at byte `start` of each block.
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    # (n, k) bytes -> (n, 2k): the low nibbles of all k bytes first, then the high nibbles.
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    return blocks[:, 2:].view(torch.int8).to(torch.float32) * d


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _nibbles(blocks[:, 4:]).to(torch.float32) + m


_BIT_SHIFTS_8 = torch.arange(8, dtype=torch.uint8).view(1, 1, 8)


def _high_bits_32(qh_bytes: torch.Tensor) -> torch.Tensor:
    # (n, 4) bytes of a little-endian uint32 -> (n, 32) bits; bit i (byte i // 8) is element i's.
    n = qh_bytes.shape[0]
    return ((qh_bytes.reshape(n, 4, 1) >> _BIT_SHIFTS_8) & 1).view(n, 32)


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = (_nibbles(blocks[:, 6:]) | (_high_bits_32(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:]) | (_high_bits_32(blocks[:, 4:8]) << 4)
    return d * q.to(torch.float32) + m


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # 12 bytes of packed 6-bit (scale, min) pairs for 8 sub-blocks -> two (n, 8) uint8.
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mins = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.to(torch.float32)).view(n, 8, 1)
    offset = (dmin * mins.to(torch.float32)).view(n, 8, 1)
    # 4 chunks of 32 bytes; each gives 2 sub-blocks of 32 (low nibbles, then high nibbles).
    qs = blocks[:, 16:].reshape(n, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).view(n, 8, 32).to(torch.float32)
    return (scale * q - offset).view(n, 256)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mins = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.to(torch.float32)).view(n, 8, 1)
    offset = (dmin * mins.to(torch.float32)).view(n, 8, 1)
    qs = blocks[:, 48:].reshape(n, 4, 32)
    low = torch.stack([qs & 0x0F, qs >> 4], dim=2).view(n, 8, 32)
    # bit i of qh[l] is the fifth bit of element l of sub-block i
    high = (blocks[:, 16:48].reshape(n, 1, 32) >> _BIT_SHIFTS_8.view(1, 8, 1)) & 1
    q = (low | (high << 4)).to(torch.float32)
    return (scale * q - offset).view(n, 256)


_SHIFTS_Q6 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 208)
    scale = (d * blocks[:, 192:208].view(torch.int8).to(torch.float32)).view(n, 16, 1)
    # two halves of 128 elements: 64 bytes of low nibbles each (4 runs of 32) ...
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).view(n, 8, 32)
    # ... and 32 bytes holding the top two bits of those 4 runs
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = ((qh >> _SHIFTS_Q6) & 0x03).view(n, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (scale * q.view(n, 16, 16).to(torch.float32)).view(n, 256)


_TORCH_DEQUANT: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q4_0: _dequant_q4_0,
    GGMLQuantizationType.Q4_1: _dequant_q4_1,
    GGMLQuantizationType.Q5_0: _dequant_q5_0,
    GGMLQuantizationType.Q5_1: _dequant_q5_1,
    GGMLQuantizationType.Q8_0: _dequant_q8_0,
    GGMLQuantizationType.Q4_K: _dequant_q4_k,
    GGMLQuantizationType.Q5_K: _dequant_q5_k,
    GGMLQuantizationType.Q6_K: _dequant_q6_k,
}
_PLAIN_DTYPES: dict[int, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
    GGMLQuantizationType.F64: torch.float64,
    GGMLQuantizationType.I8: torch.int8,
    GGMLQuantizationType.I16: torch.int16,
    GGMLQuantizationType.I32: torch.int32,
    GGMLQuantizationType.I64: torch.int64,
}
# Elements per dequantization step: bounds the temporaries while keeping the number of torch ops
# (each a parallel region, costly when another process holds a core) small.
_ELEMENTS_PER_CHUNK = 1 << 20


def dequantize(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`raw` uint8 bytes of one tensor -> a tensor of `shape`.

    Quantized types come back as `dtype` (default float32), computed in float32 chunk by chunk so
    a bf16 result never holds the whole float32 tensor; plain types are views of `raw` unless a
    different `dtype` is asked for.
    """
    plain = _PLAIN_DTYPES.get(ggml_type)
    if plain is not None:
        view = raw.view(plain).view(shape)
        return view if dtype is None or not plain.is_floating_point else view.to(dtype)
    block_size, type_size = QUANT_SIZES[ggml_type]
    blocks = raw.view(-1, type_size)  # (num_blocks, type_size)
    fn = _TORCH_DEQUANT.get(ggml_type)
    if fn is None:
        return _dequantize_numpy(blocks, ggml_type).view(shape).to(dtype or torch.float32)
    out = torch.empty(blocks.shape[0], block_size, dtype=dtype or torch.float32)
    step = max(1, _ELEMENTS_PER_CHUNK // block_size)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = fn(blocks[start : start + step])
    return out.view(shape)


def _dequantize_numpy(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    # The rarer types (Q2_K, Q3_K, IQ*, ...): gguf.quants' numpy reference, slower but complete.
    from gguf import quants

    try:
        values = quants.dequantize(blocks.numpy().reshape(-1), GGMLQuantizationType(ggml_type))
    except NotImplementedError as e:
        raise ModelLoadError(f"no dequantizer for {GGMLQuantizationType(ggml_type).name}") from e
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


# --------------------------------------------------------------------------- HF mapping


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None if it has none (e.g. `rope_freqs`)."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] in ("weight", "bias"):
        module = _LAYER_TENSOR_NAMES.get(parts[2])
        if module is not None:
            return f"model.layers.{parts[1]}.{module}.{parts[3]}"
    return None


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation (interleaved RoPE pairs -> HF's rotate-half halves).

    The converter did, per head, rows [r0..r(d/2-1) | r(d/2)..r(d-1)] -> [r0 r(d/2) r1 r(d/2+1) ...];
    this reads the interleaved pairs back into two halves. Works for weights and biases.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    # (heads, head_dim/2, 2, ...) -> (heads, 2, head_dim/2, ...)
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def _meta_int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    value = meta.get(key, default)
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        # Some files store per-layer values (e.g. variable head counts); we only support uniform ones.
        if value.size == 0 or (value != value.flat[0]).any():
            raise ValueError(f"{key} varies per layer ({value.tolist()})")
        value = value.flat[0]
    return int(value)


def build_config(gguf: GGUFFile) -> dict[str, Any]:
    """A Hugging Face config.json-style dict from the file's metadata and tensor shapes."""
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{gguf.path}: no general.architecture in the GGUF metadata")
    if arch == "clip":
        raise ModelLoadError(
            f"{gguf.path}: a llama.cpp mmproj file (a vision tower and projector), not a model: give the "
            "text model's GGUF as the model and this file as --mmproj"
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelLoadError(f"{gguf.path}: unsupported architecture {arch!r} (supported: {supported})")
    model_type, hf_class, _ = SUPPORTED_ARCHITECTURES[arch]
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{gguf.path}: no token_embd.weight tensor")
    try:
        hidden_size = _meta_int(meta, f"{arch}.embedding_length")
        num_layers = _meta_int(meta, f"{arch}.block_count")
        num_heads = _meta_int(meta, f"{arch}.attention.head_count")
        intermediate = _meta_int(meta, f"{arch}.feed_forward_length")
        if hidden_size is None or num_layers is None or num_heads is None or intermediate is None:
            raise ValueError("missing one of embedding_length, block_count, head_count, feed_forward_length")
        num_kv_heads = _meta_int(meta, f"{arch}.attention.head_count_kv", num_heads)
        head_dim = _meta_int(meta, f"{arch}.attention.key_length", hidden_size // num_heads)
        rope_dim = _meta_int(meta, f"{arch}.rope.dimension_count", head_dim)
    except ValueError as e:
        raise ModelLoadError(f"{gguf.path}: bad metadata: {e}") from e
    assert head_dim is not None and num_kv_heads is not None
    default_theta = 1_000_000.0 if arch in ("qwen2", "qwen3") else 10_000.0
    has_bias = "blk.0.attn_q.bias" in gguf.tensors
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": embed.dims[1],
        "hidden_size": hidden_size,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", default_theta)),
        "rope_scaling": _rope_scaling(gguf, arch, head_dim),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": has_bias,
        "mlp_bias": False,
        "torch_dtype": _dominant_dtype(gguf),
        "bos_token_id": _meta_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta_int(meta, "tokenizer.ggml.eos_token_id"),
    }
    if rope_dim is not None and rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim
    if arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    return config


def _rope_scaling(gguf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any] | None:
    meta = gguf.metadata
    rope_type = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_freqs.weight" in gguf.tensors:
        return _llama3_rope_scaling(gguf, arch, head_dim)
    if rope_type in (None, "none") or factor in (None, 0.0, 1.0):
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(factor)}
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    if rope_type == "yarn":
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{key}" in meta:
                scaling[hf_key] = float(meta[f"{arch}.rope.scaling.{key}"])
    return scaling


def _llama3_rope_scaling(gguf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any]:
    """Recover Llama 3.1-style rope_scaling from the `rope_freqs` factors llama.cpp stores.

    The converter computes per-frequency factors from (factor, low_freq_factor, high_freq_factor,
    original context); we find the published parameter set that reproduces them exactly.
    """
    info = gguf.tensors["rope_freqs.weight"]
    stored = dequantize(gguf.raw(info), info.ggml_type, info.shape).to(torch.float64)
    theta = float(gguf.metadata.get(f"{arch}.rope.freq_base", 10_000.0))
    factor = float(stored.max())
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    for original in (8192, 4096, 16384, 2048, 32768):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            smooth = (original / wavelen - low) / (high - low)
            expected = torch.where(
                wavelen < original / high,
                torch.ones_like(wavelen),
                torch.where(
                    wavelen > original / low,
                    torch.full_like(wavelen, factor),
                    1 / ((1 - smooth) / factor + smooth),
                ),
            )
            if expected.shape == stored.shape and torch.allclose(expected, stored, rtol=1e-4, atol=1e-4):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": original,
                }
    raise ModelLoadError(f"{gguf.path}: rope_freqs.weight does not match any known llama3 rope scaling")


def _dominant_dtype(gguf: GGUFFile) -> str:
    # The dtype most of the returned weights have: quantized tensors come back as float32.
    names = {GGMLQuantizationType.F16: "float16", GGMLQuantizationType.BF16: "bfloat16"}
    counts: dict[str, int] = {}
    for info in gguf.tensors.values():
        if len(info.dims) < 2:
            continue  # norms are F32 in every file
        dtype = names.get(GGMLQuantizationType(info.ggml_type), "float32")
        counts[dtype] = counts.get(dtype, 0) + math.prod(info.dims)
    return max(counts, key=lambda k: counts[k]) if counts else "float32"


def iter_hf_tensors(
    gguf: GGUFFile,
    config: Mapping[str, Any],
    on_tensor: Callable[[TensorInfo], None] | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the file, dequantized and un-permuted."""
    arch = gguf.metadata["general.architecture"]
    is_permuted = SUPPORTED_ARCHITECTURES[arch][2]
    for info in gguf.tensors.values():
        hf_name = hf_tensor_name(info.name)
        if hf_name is None:
            if info.name == "rope_freqs.weight":
                if on_tensor is not None:
                    on_tensor(info)
                continue  # folded into config["rope_scaling"]
            raise ModelLoadError(f"{gguf.path}: unexpected tensor {info.name!r} for architecture {arch!r}")
        try:
            tensor = dequantize(gguf.raw(info), info.ggml_type, info.shape, dtype)
        except ModelLoadError as e:
            raise ModelLoadError(f"{gguf.path}: tensor {info.name!r}: {e}") from e
        if is_permuted and info.name.endswith((".attn_q.weight", ".attn_q.bias")):
            tensor = unpermute_rows(tensor, config["num_attention_heads"])
        elif is_permuted and info.name.endswith((".attn_k.weight", ".attn_k.bias")):
            tensor = unpermute_rows(tensor, config["num_key_value_heads"])
        if on_tensor is not None:
            on_tensor(info)
        yield hf_name, tensor


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Run the calling thread's torch ops on one core, then restore its setting.

    Every parallel torch op ends at a barrier for all its workers; with another process on one
    of two cores, a descheduled worker stalls each of the thousands of small dequantization ops
    (SmolLM2: 7.6 s with 2 threads against 1.3 s with 1, on a busy 2-core machine; 0.4 s against
    0.7 s when idle). Threads already running keep their own setting.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# llama.cpp's model-embedded sampler settings (its converter writes them from generation_config.json)
GGUF_SAMPLING = {
    "temperature": Keys.General.SAMPLING_TEMP,
    "top_p": Keys.General.SAMPLING_TOP_P,
    "top_k": Keys.General.SAMPLING_TOP_K,
    "min_p": Keys.General.SAMPLING_MIN_P,
    "repetition_penalty": Keys.General.SAMPLING_PENALTY_REPEAT,
}


def load_gguf(
    path: Path, *, name: str | None = None, progress: bool = True, dtype: torch.dtype | None = None
) -> LoadedCheckpoint:
    """Load a GGUF file: config, HF-named float tensors, tokenizer and tokenizer config.

    `dtype` None keeps F32/F16/BF16 tensors as stored and dequantizes the rest to float32;
    a dtype (e.g. torch.bfloat16) makes every floating tensor that dtype.
    """
    from tqdm import tqdm

    gguf = GGUFFile(path)
    config = build_config(gguf)
    tokenizer, tokenizer_config = load_gguf_tokenizer(gguf)
    tokenizer_config.setdefault("model_max_length", config["max_position_embeddings"])
    total = sum(info.nbytes for info in gguf.tensors.values())
    tensors: dict[str, torch.Tensor] = {}
    with (
        _one_intra_op_thread(),
        tqdm(
            total=total,
            desc=f"loading {path.name}",
            unit="B",
            unit_scale=True,
            disable=not progress,
            leave=False,
            dynamic_ncols=True,
        ) as bar,
    ):
        for hf_name, tensor in iter_hf_tensors(gguf, config, lambda info: bar.update(info.nbytes), dtype):
            tensors[hf_name] = tensor
    _check_complete(gguf, config, tensors)
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return LoadedCheckpoint(
        name=name or path.stem,
        source=str(path),
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        tokenizer_config=tokenizer_config,
        sampling=sampling_from(gguf.metadata, GGUF_SAMPLING, "GGUF general.sampling"),
    )


def _check_complete(gguf: GGUFFile, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    # A file cut by a converter bug or a bad merge shows up as a missing layer, not a crash later.
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        required += [prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
        required += [f"{prefix}self_attn.{p}_proj.weight" for p in "qkvo"]
        required += [f"{prefix}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    missing = [n for n in required if n not in tensors]
    if missing:
        raise ModelLoadError(
            f"{gguf.path}: missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
