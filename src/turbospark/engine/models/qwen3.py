"""Qwen3 (model_type "qwen3"): Llama's shape plus RMSNorm on each q and k head before rotary,
and head_dim taken from the config (it need not be hidden_size / num_heads).

Attribute names equal the Hugging Face weight names, so a checkpoint loads without a mapping
table. After loading, `finalize` fuses q/k/v and gate/up into single matmuls and ties the
lm_head to the embeddings when the config says so; forward only uses the fused modules.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from turbospark.engine.attention import AttentionMetadata
from turbospark.engine.kv_cache import KVCache, LayerCache
from turbospark.engine.layers import (
    Embedding,
    Linear,
    PrepareLinear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    fuse_linears,
    silu_and_mul,
)


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 0  # 0: same as num_attention_heads
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    use_sliding_window: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in config.items() if k in known})
        # transformers >= 5 writes rope settings as one `rope_parameters` dict
        rope = config.get("rope_parameters")
        if isinstance(rope, dict):
            cfg.rope_theta = float(rope.get("rope_theta", cfg.rope_theta))
            if rope.get("rope_type", "default") != "default":
                cfg.rope_scaling = dict(rope)
        if not cfg.num_key_value_heads:
            cfg.num_key_value_heads = cfg.num_attention_heads
        if not cfg.head_dim:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        if cfg.use_sliding_window:
            raise ValueError("qwen3 with use_sliding_window is not supported")
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        return cfg


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj: nn.Module = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qkv_proj: nn.Module

    def finalize(self, prepare: PrepareLinear) -> None:
        self.qkv_proj = prepare(fuse_linears([self.q_proj, self.k_proj, self.v_proj]), "qkv_proj")
        self.o_proj = prepare(self.o_proj, "o_proj")
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: (num_tokens, hidden)
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q = apply_rotary(self.q_norm(qkv[:, : self.num_heads]), *rope)
        k = apply_rotary(self.k_norm(qkv[:, self.num_heads : self.num_heads + self.num_kv_heads]), *rope)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        out = kv.attend(q, k, v, meta, self.scale)  # (num_tokens, num_heads * head_dim)
        return self.o_proj(out)  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.intermediate_size = inter
        self.gate_proj = Linear(hidden, inter)
        self.up_proj = Linear(hidden, inter)
        self.down_proj: nn.Module = Linear(inter, hidden)
        self.gate_up_proj: nn.Module

    def finalize(self, prepare: PrepareLinear) -> None:
        self.gate_up_proj = prepare(fuse_linears([self.gate_proj, self.up_proj]), "gate_up_proj")
        self.down_proj = prepare(self.down_proj, "down_proj")
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.intermediate_size))  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: LayerCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state is x + residual (residual None: x alone, the first layer); returns
        the next layer's (x, residual). Each residual add is fused into the norm after it."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_norm(x, residual)
        x, residual = self.post_attention_layernorm.add_norm(self.self_attn(x, rope, kv, meta), residual)
        return self.mlp(x), residual


class Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions  # the rotary table's length: no position past it
        self.model = Model(config)
        self.lm_head: nn.Module = Linear(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(config, max_positions)

    def checkpoint_names(self) -> list[str]:
        """Weight names this model loads from a checkpoint."""
        names = [n for n, _ in self.named_parameters()]
        return [n for n in names if not (self.config.tie_word_embeddings and n == "lm_head.weight")]

    def finalize(self, prepare: PrepareLinear) -> None:
        """Ties the lm_head, fuses projections, and hands every linear to `prepare` (a cast or
        a quantizer), layer by layer so only one layer's float copies exist at a time."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.lm_head = prepare(self.lm_head, "lm_head")
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.finalize(prepare)
            layer.mlp.finalize(prepare)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) packed; returns logits (num_seqs, vocab) of each
        sequence's last token."""
        x = self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        rope = self.rotary(positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, kv_cache.layer(i), meta)
        last = meta.last_token_indices
        assert residual is not None
        h, _ = self.model.norm.add_norm(x[last], residual[last])  # (num_seqs, hidden)
        return self.lm_head(h).float()  # type: ignore[no-any-return]
