"""Load a Hugging Face checkpoint folder: config.json, *.safetensors, tokenizer.json and friends.

Contract: `load_hf_folder(folder, name=..., progress=...) -> LoadedCheckpoint`. Weights stay in
their stored dtype and are zero-copy views of a private (copy-on-write) memory map of each
safetensors file, so loading costs no reads until a tensor is touched. The config is returned as
config.json has it, with the few keys the model code relies on filled in (rope_theta and
rope_scaling from transformers 5's `rope_parameters`, head_dim, num_key_value_heads,
tie_word_embeddings, torch_dtype). The chat template comes from tokenizer_config.json,
chat_template.jinja or chat_template.json, whichever the folder has. The sampler settings the
model's authors recommend come from generation_config.json (temperature, top_p, top_k, min_p,
repetition_penalty; `do_sample` is not read, as vLLM does not read it either).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from turbospark.backend import SamplingDefaults
from turbospark.engine.checkpoint import LoadedCheckpoint, ModelLoadError, sampling_from
from turbospark.engine.gguf_tokenizer import END_OF_GENERATION_TEXTS

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, as views of a private memory map of it."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ModelLoadError(f"{path}: not a safetensors file (only {size} bytes)")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read: {e.strerror or e}") from e
    (header_len,) = struct.unpack_from("<Q", buf, 0)
    if header_len > min(size - 8, _MAX_HEADER_BYTES):
        raise ModelLoadError(f"{path}: truncated or not a safetensors file (header of {header_len} bytes)")
    try:
        header = json.loads(buf[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors header ({e})") from e
    data_start = 8 + header_len
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or begin > end:
            raise ModelLoadError(
                f"{path}: tensor {name!r} has inconsistent offsets {begin}..{end} for {shape}"
            )
        if data_start + end > size:
            needed = data_start + end
            raise ModelLoadError(
                f"{path}: truncated: tensor {name!r} needs bytes up to {needed}, the file has {size}"
            )
        if begin == end:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
        tensors[name] = flat.view(dtype).view(shape)
    return tensors


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({e})") from e
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: lists missing shards: {', '.join(missing)}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt*")]
        hint = f" ({', '.join(other)} are not supported: only safetensors)" if other else ""
        raise ModelLoadError(f"{folder}: no *.safetensors weights{hint}")
    return files


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value


def normalize_config(
    config: dict[str, Any], tensors: Mapping[str, torch.Tensor], source: Path
) -> dict[str, Any]:
    """Fill in the keys the contract promises, whatever transformers version wrote config.json."""
    config = dict(config)
    if "model_type" not in config:
        raise ModelLoadError(f"{source}: config.json has no model_type")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ModelLoadError(f"{source}: quantized checkpoints ({method}) are not supported; use a GGUF file")
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in config:
        # transformers 5 folds rope_theta and rope_scaling into one dict
        config["rope_theta"] = params.get("rope_theta", 10_000.0)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if "rope_scaling" not in config:
            config["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    config.setdefault("rope_scaling", None)
    if "torch_dtype" not in config and "dtype" in config:
        config["torch_dtype"] = config["dtype"]
    if "num_attention_heads" in config and "hidden_size" in config:
        config.setdefault("num_key_value_heads", config["num_attention_heads"])
        if config.get("head_dim") is None:
            config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if "tie_word_embeddings" not in config:
        config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    return config


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        value = _read_json(folder / "chat_template.json").get("chat_template")
        return value if isinstance(value, str) else None
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def load_tokenizer_files(folder: Path, config: Mapping[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer, tokenizer_config with chat_template and eos_token_ids) from an HF folder."""
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ModelLoadError(
            f"{folder}: no tokenizer.json (slow sentencepiece/vocab-file tokenizers are not supported)"
        )
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # tokenizers raises a bare Exception
        raise ModelLoadError(f"{tokenizer_path}: cannot load ({e})") from e
    tokenizer_config: dict[str, Any] = {}
    if (folder / "tokenizer_config.json").is_file():
        tokenizer_config = _read_json(folder / "tokenizer_config.json")
    special_map = (
        _read_json(folder / "special_tokens_map.json")
        if (folder / "special_tokens_map.json").is_file()
        else {}
    )
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        text = _token_text(tokenizer_config.get(key)) or _token_text(special_map.get(key))
        tokenizer_config[key] = text
    tokenizer_config.pop("added_tokens_decoder", None)  # the tokenizer itself carries these
    tokenizer_config["chat_template"] = _chat_template(folder, tokenizer_config)

    eos_ids: list[int] = []
    if (folder / "generation_config.json").is_file():
        eos_ids += _as_id_list(_read_json(folder / "generation_config.json").get("eos_token_id"))
    eos_ids += _as_id_list(config.get("eos_token_id"))
    if tokenizer_config["eos_token"] is not None:
        eos_id = tokenizer.token_to_id(tokenizer_config["eos_token"])
        if eos_id is not None:
            eos_ids.insert(0, eos_id)
    for token_id, added in sorted(tokenizer.get_added_tokens_decoder().items()):
        if added.special and added.content in END_OF_GENERATION_TEXTS:
            eos_ids.append(token_id)
    tokenizer_config["eos_token_ids"] = list(dict.fromkeys(eos_ids))
    return tokenizer, tokenizer_config


# generation_config.json's names for SamplingDefaults' fields (they are the same)
GENERATION_CONFIG_SAMPLING = {n: n for n in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}


def generation_sampling(folder: Path) -> SamplingDefaults:
    """The sampler settings a folder's generation_config.json recommends (none without one)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return SamplingDefaults()
    return sampling_from(_read_json(path), GENERATION_CONFIG_SAMPLING, "generation_config.json")


def load_hf_folder(
    folder: Path, *, name: str | None = None, progress: bool = True, dtype: torch.dtype | None = None
) -> LoadedCheckpoint:
    """Load a Hugging Face checkpoint folder (see the module docstring).

    `dtype` None keeps the stored dtypes (zero-copy); a dtype converts every floating tensor
    that is not already of it (a copy).
    """
    from tqdm import tqdm

    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: not a folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    raw_config = _read_json(config_path)
    tensors: dict[str, torch.Tensor] = {}
    files = _weight_files(folder)
    for path in tqdm(
        files, desc=f"mapping {folder.name}", unit="file", disable=not progress or len(files) < 2
    ):
        tensors.update(read_safetensors(path))
    config = normalize_config(raw_config, tensors, config_path)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tokenizer, tokenizer_config = load_tokenizer_files(folder, config)
    if "max_position_embeddings" in config:
        tokenizer_config.setdefault("model_max_length", config["max_position_embeddings"])
    return LoadedCheckpoint(
        name=name or folder.name,
        source=str(folder),
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        tokenizer_config=tokenizer_config,
        sampling=generation_sampling(folder),
    )
