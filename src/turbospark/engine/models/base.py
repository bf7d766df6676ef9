"""The engine contract every decoder-only family shares, so a family file is its layer code.

A family module (`llama.py`, `qwen2.py`, ...) subclasses what differs and names its classes the
same way as the others: `ModelConfig` (a `BaseConfig` with the family's extra fields and checks),
`Attention`, `MLP`, `DecoderLayer` and `CausalLM`. What lives here, once:

- `BaseConfig.from_dict`: Hugging Face config.json -> dataclass (unknown keys ignored, the
  transformers >= 5 `rope_parameters` dict read, defaults for kv heads and head_dim filled in);
- `Attention`: fused q/k/v, rotary on q and k, the paged cache's `attend`, o_proj; a family
  with norms on q/k overrides `rotate_qk`;
- `MLP`: the gated SiLU MLP with gate/up fused;
- `CausalLM`: `checkpoint_names`, `finalize` (tie, fuse, quantize layer by layer) and the
  forward over the layers, which is where the engine's per-step speed is won or lost.

Kernels are not chosen here: every module runs its norms, rotary, SiLU * up and fusions
through its `ops` (`turbospark.engine.ops`), the object `build_model` picked for the model's
device. The layer code asks it whether a step takes a fusion (`takes_qkv_rotary`, ...) and
never what device a tensor is on.

Attribute names equal the Hugging Face weight names, so a checkpoint loads without a mapping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Self

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
    fuse_linears,
)
from turbospark.engine.ops import REFERENCE, Norm, Ops


@dataclass(slots=True)
class BaseConfig:
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
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Self:
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
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raises ValueError for a setting the model code does not implement."""
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}")


class Attention(nn.Module):
    ops: Ops = REFERENCE

    def __init__(self, config: BaseConfig, *, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj: nn.Module = Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.qkv_proj: nn.Module

    def finalize(self, prepare: PrepareLinear) -> None:
        self.qkv_proj = prepare(fuse_linears([self.q_proj, self.k_proj, self.v_proj]), "qkv_proj")
        self.o_proj = prepare(self.o_proj, "o_proj")
        del self.q_proj, self.k_proj, self.v_proj

    def rotate_qk(
        self, qk: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """qk: (num_tokens, num_heads + num_kv_heads, head_dim) -> rotated q, k."""
        # q and k rotate together: one set of elementwise ops instead of two
        qk = self.ops.rotary(qk, *rope)
        return qk[:, : self.num_heads], qk[:, self.num_heads :]

    def fused_qkv_weight(self, x: torch.Tensor) -> Linear | None:
        """The q/k/v projection when this step takes the fused kernel (projection, bias and
        rotary in one launch: `ops.takes_qkv_rotary`, on CUDA a decode batch of a few rows), for
        a float projection and no q/k norms."""
        proj = self.qkv_proj
        if (
            isinstance(proj, Linear)
            and type(self).rotate_qk is Attention.rotate_qk
            and self.ops.takes_qkv_rotary(x, proj.weight, self.head_dim)
        ):
            return proj
        return None

    def project(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: LayerCache,
        meta: AttentionMetadata,
        norm: Norm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(q, k, v, summed residual) of x (num_tokens, hidden), q and k rotated; `norm` (only
        when `fused_qkv_weight` is not None) runs the layer's input norm inside the kernel. On
        the fused path, where the kernel also writes k and v to their cache slots (a CUDA
        cache), k comes back None (`attend` then only reads the cache)."""
        num_tokens = x.shape[0]
        rotated = self.num_heads + self.num_kv_heads
        summed = None
        fused = self.fused_qkv_weight(x)
        if fused is not None:
            qkv, summed, stored = self.ops.qkv_rotary(
                x,
                fused.weight,
                fused.bias,
                rope,
                rotated,
                self.head_dim,
                norm,
                kv,
                meta.slot_mapping,
                self.num_heads,
            )
            q = qkv[:, : self.num_heads]
            k = None if stored else qkv[:, self.num_heads : rotated]
        else:
            assert norm is None
            qkv = self.qkv_proj(x).view(num_tokens, rotated + self.num_kv_heads, self.head_dim)
            q, k = self.rotate_qk(qkv[:, :rotated], rope)
        return q, k, qkv[:, rotated:], summed

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor,
        kv: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The step's attention (num_tokens, num_heads * head_dim), before o_proj; k None: k
        and v are already in the cache. The one part of a layer whose launches depend on the
        step's sequences, not only its token count (see `DecoderLayer`)."""
        if k is None:
            return kv.backend.attend(q, kv.k, kv.v, meta, self.scale)  # type: ignore[attr-defined,no-any-return]
        return kv.attend(q, k, v, meta, self.scale)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: LayerCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: (num_tokens, hidden)
        q, k, v, _ = self.project(x, rope, kv, meta)
        return self.o_proj(self.attend(q, k, v, kv, meta))  # type: ignore[no-any-return]


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    ops: Ops = REFERENCE

    def __init__(self, config: BaseConfig, *, bias: bool = False) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.intermediate_size = inter
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj: nn.Module = Linear(inter, hidden, bias=bias)
        self.gate_up_proj: nn.Module

    def finalize(self, prepare: PrepareLinear) -> None:
        self.gate_up_proj = prepare(fuse_linears([self.gate_proj, self.up_proj]), "gate_up_proj")
        self.down_proj = prepare(self.down_proj, "down_proj")
        del self.gate_proj, self.up_proj

    def fused_gate_up_weight(self, x: torch.Tensor) -> Linear | None:
        """The gate/up projection when this step takes the fused kernel (both projections and
        silu * up in one launch: `ops.takes_gate_up_silu`, on CUDA a decode batch of a few
        rows), for a float projection."""
        proj = self.gate_up_proj
        if isinstance(proj, Linear) and self.ops.takes_gate_up_silu(x, proj.weight):
            return proj
        return None

    def gated(self, x: torch.Tensor, norm: Norm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(silu(gate(x)) * up(x), summed residual); `norm` as in `Attention.project`."""
        fused = self.fused_gate_up_weight(x)
        if fused is not None:
            return self.ops.gate_up_silu(x, fused.weight, fused.bias, norm)
        assert norm is None
        # gate_up: (num_tokens, 2 * inter)
        return self.ops.silu_mul(self.gate_up_proj(x), self.intermediate_size), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(x)[0])  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then h + mlp(norm(h)), with the hidden state
    carried as (x, residual) so each residual add is fused into the norm after it."""

    ops: Ops = REFERENCE

    def __init__(self, config: BaseConfig, self_attn: Attention, mlp: MLP) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
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
        the next layer's (x, residual).

        Three parts: `before_attention` and `after_attention` depend only on the step's token
        count, the attention between them on its sequences too; piecewise CUDA graphs
        (`engine/cuda_graphs.py`) replay the first two and run the attention eagerly."""
        q, k, v, residual = self.before_attention(x, residual, rope, kv, meta)
        return self.after_attention(self.self_attn.attend(q, k, v, kv, meta), residual)

    def before_attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: LayerCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Residual add, input norm and the rotated q/k/v projection: (q, k, v, residual).

        Where the step takes the fused projection (on CUDA small decode batches) the norm runs
        inside it (`Norm`) if the ops say it fits (`fuses_norm`: the row is one tile), and k comes
        back None when that kernel stored k/v already."""
        attn = self.self_attn
        if (w := attn.fused_qkv_weight(x)) is not None and self.ops.fuses_norm(x.shape[1], w.weight):
            norm = Norm(self.input_layernorm.weight, self.input_layernorm.eps, residual)
            q, k, v, summed = attn.project(x, rope, kv, meta, norm)
            return q, k, v, summed if summed is not None else x
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_norm(x, residual)
        q, k, v, _ = attn.project(x, rope, kv, meta)
        return q, k, v, residual

    def after_attention(
        self, attended: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, residual add, post-attention norm and the MLP: the next layer's (x, residual)."""
        mlp = self.mlp
        x = self.self_attn.o_proj(attended)
        post = self.post_attention_layernorm
        if (w := mlp.fused_gate_up_weight(x)) is not None and self.ops.fuses_norm(x.shape[1], w.weight):
            act, summed = mlp.gated(x, Norm(post.weight, post.eps, residual))
            assert summed is not None
            return mlp.down_proj(act), summed
        x, residual = post.add_norm(x, residual)
        return mlp(x), residual


class Model(nn.Module):
    """The `model.` prefix of the checkpoint names: embeddings, layers, final norm."""

    def __init__(self, config: BaseConfig, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Embeddings, the family's layers, final norm and lm_head; a family passes its layer class."""

    ops: Ops = REFERENCE

    def __init__(self, config: Any, max_positions: int, layer_cls: Callable[[Any], DecoderLayer]) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions  # the rotary table's length: no position past it
        self.model = Model(config, [layer_cls(config) for _ in range(config.num_hidden_layers)])
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
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: (num_tokens,) packed; returns logits (num_seqs, vocab) float32
        of each sequence's last token, layer by layer. `embeds` (packed rows, their vectors):
        input embeddings used instead of the ids' for those rows (a vision model's image tokens).
        (Whole-step shortcuts, the CPU's one-call native decode and CUDA graph replay, are the
        runner's strategies.)

        Under a row role (`engine/row_kernels.py`: the runner runs a CPU step's decode and prompt
        rows apart, each under its role) the lm_head's rows run as decode rows (`ops.head_rows`)."""
        x = self.model.embed_tokens(input_ids)  # (num_tokens, hidden)
        if embeds is not None:
            x.index_copy_(0, embeds[0], embeds[1].to(x.dtype))
        rope = self.rotary(positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, kv_cache.layer(i), meta)
        assert residual is not None
        return self.logits(x, residual, meta.last_token_indices)

    def logits(self, x: torch.Tensor, residual: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """float32 logits of rows `last` (increasing) of the hidden state x + residual: the
        final norm and the lm_head, on those rows only."""
        if last.shape[0] != x.shape[0]:  # else one token per sequence (decodes): all are last
            x, residual = x[last], residual[last]
        h, _ = self.model.norm.add_norm(x, residual)  # (num_seqs, hidden)
        with self.ops.head_rows():  # the lm_head's rows: one per sampling sequence
            return self.lm_head(h).float()  # type: ignore[no-any-return]
