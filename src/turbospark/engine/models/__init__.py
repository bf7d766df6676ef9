"""Model families, one module per Hugging Face `model_type`, and `build_model`.

Adding a family is adding one file `<model_type>.py` here that defines `ModelConfig` (with
`from_dict`) and `CausalLM(config, max_positions)` with `checkpoint_names()`, `finalize(prepare)` and
`forward(input_ids, positions, meta, kv_cache) -> logits (num_seqs, vocab)`; `base` holds all of
that for the usual decoder, so a family file is its layer code. The registry is the set of
modules in this package (less `base`), so nothing else needs editing. Family code picks no
kernel and tests no tensor's device: `build_model` hands its modules the device's ops
(`turbospark.engine.ops`) once the model is built.

An encoder family (`bert`, for embeddings) defines `EncoderModel(config)` instead of `CausalLM`;
`build_encoder` builds it and `build_model` refuses it by name.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from turbospark.engine import tensor_parallel
from turbospark.engine.attention import AttentionMetadata
from turbospark.engine.kv_cache import KVCache
from turbospark.engine.layers import PrepareLinear, load_weights
from turbospark.engine.ops import ops_for, use_ops
from turbospark.engine.tensor_parallel import Shard

_NOT_FAMILIES = {"base"}  # shared code, not a model_type


class ArchConfig(Protocol):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int


class Model(Protocol):
    """What the runner drives. `config` is the family's `ModelConfig`."""

    @property
    def config(self) -> ArchConfig: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def max_positions(self) -> int: ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        argmax: list[torch.Tensor] | None = None,
    ) -> torch.Tensor: ...


def supported_model_types() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _NOT_FAMILIES
    )


def _family(model_type: str) -> Any:
    if model_type not in supported_model_types():
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(supported_model_types())})"
        )
    return importlib.import_module(f"{__name__}.{model_type}")


def is_encoder(model_type: str) -> bool:
    """True for an encoder-only family (embeddings, no causal LM), such as "bert"."""
    return model_type in supported_model_types() and hasattr(_family(model_type), "EncoderModel")


def build_model(
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    quant: str | None = None,
    max_positions: int | None = None,
    consume: bool = False,
    shard: Shard | None = None,
) -> Model:
    """Builds the family's model from an HF-style config and HF-named float weights.

    `dtype` is the compute (activation) dtype and the dtype float weights are kept in. `quant`
    is None (float weights), "int8" or "int4" (weight-only; see `turbospark.engine.quant`).
    `max_positions` bounds the rotary table (default: the config's max_position_embeddings).
    `consume`: `tensors` is a dict the caller gives up; each weight leaves it as it is loaded.
    `shard` builds one rank's share of a tensor-parallel model (`turbospark.engine.tensor_parallel`).
    """
    family = _family(str(config.get("model_type")))
    if not hasattr(family, "CausalLM"):
        raise ValueError(
            f"model_type {config.get('model_type')!r} is an encoder: it makes embeddings and cannot generate"
        )
    cfg = family.ModelConfig.from_dict(dict(config))
    device = torch.device(device)
    positions = max_positions or cfg.max_position_embeddings
    if shard is not None:
        tensors = tensor_parallel.ShardedTensors(tensors, cfg, shard)
        cfg = tensor_parallel.shard_config(cfg, shard.world_size)
    # The skeleton holds no memory (meta tensors): each weight is materialized once, straight on
    # `device` in its final dtype, by `load_weights`; no float32 copy of the model exists first.
    with torch.device("meta"):
        model = family.CausalLM(cfg, positions)
    if shard is not None:
        tensor_parallel.shard_skeleton(model, shard)
    # quantized linears are read from the checkpoint's own floats: no full-size cast copy first
    overrides = {}
    embed_name = next((n for n in model.checkpoint_names() if n.endswith("embed_tokens.weight")), "")
    if quant is not None and dtype == torch.float32 and tensors[embed_name].dtype == torch.bfloat16:
        # float32 activations over a bf16 checkpoint (quantized on an AVX2 CPU): the table stays
        # bf16 (half the bytes, no digit lost), its rows are widened as they are looked up
        overrides[embed_name] = torch.bfloat16
        model.model.embed_tokens.out_dtype = torch.float32
    names = model.checkpoint_names()
    load_weights(model, names, tensors, device, dtype, dtype if quant is None else None, overrides, consume)
    # the rotary tables are computed, not loaded: built for real (float32 on CPU, as on every
    # device, so CPU and CUDA rotate identically), then moved
    model.rotary = type(model.rotary)(cfg, positions).to(device=device, dtype=dtype)
    model.dtype = dtype
    prepare: PrepareLinear = lambda linear, role: linear  # noqa: E731
    if quant is not None:
        from turbospark.engine.quant import quantize_linear

        prepare = functools.partial(quantize_linear, mode=quant, dtype=dtype)
    model.finalize(prepare)
    if shard is not None:
        tensor_parallel.wrap_parallel(model, shard)
    # the kernels of `device`, picked once: the layers' linears and norms are final now
    use_ops(model, ops_for(device))
    model.eval()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"never loaded: {left}"
    if device.type == "cpu":
        from turbospark.engine.weight_arena import pack_weights

        pack_weights(model)  # huge pages under the weights a decode step streams through
    return model  # type: ignore[no-any-return]


def build_encoder(
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Any:
    """Builds an encoder family's `EncoderModel` from an HF-style config and HF-named weights.

    Weights saved from a task model (`BertForMaskedLM`, ...) carry a `<model_type>.` prefix on
    the encoder's names; it is dropped so those checkpoints load too.
    """
    model_type = str(config.get("model_type"))
    family = _family(model_type)
    if not hasattr(family, "EncoderModel"):
        raise ValueError(f"model_type {model_type!r} is a decoder, not an encoder")
    model = family.EncoderModel(family.ModelConfig.from_dict(dict(config)))
    names = model.checkpoint_names()
    prefix = f"{model_type}."
    if names and names[0] not in tensors and prefix + names[0] in tensors:
        tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    device = torch.device(device)
    load_weights(model, names, tensors, device, dtype, dtype)
    model.dtype = dtype
    model.finalize(lambda linear, role: linear)
    use_ops(model, ops_for(device))
    model.eval()
    return model
