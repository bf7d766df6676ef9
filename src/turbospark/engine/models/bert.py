"""BERT (model_type "bert"): an encoder for embeddings (all-MiniLM, BGE, E5 and other BERT-shaped
sentence encoders). It has no causal LM: `build_encoder` builds it, `build_model` refuses it.

Attribute names equal the Hugging Face `BertModel` weight names (`embeddings.word_embeddings`,
`encoder.layer.N.attention.self.query`, ...), so a checkpoint loads without a mapping table;
the pooler head is not used (sentence encoders pool the token states themselves). After
loading, `finalize` fuses query/key/value into one matmul.

The forward is packed like the decoders': the tokens of every sequence in a batch lie on one
flat axis, so the linears and the MLP do no work for padding. Only attention needs sequences
side by side; there the packed q/k/v are scattered into a zero-padded (batch, longest) layout
with a key mask, and the result is gathered back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from turbospark.engine.layers import Embedding, Linear, PrepareLinear, fuse_linears


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
}


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_embedding_type: str = "absolute"
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in config.items() if k in known})
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        if cfg.position_embedding_type != "absolute":
            raise ValueError(f"unsupported position_embedding_type {cfg.position_embedding_type!r}")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        return cfg


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Embeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # one segment per input: every token has token type 0
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(h + self.token_type_embeddings.weight[0])  # type: ignore[no-any-return]


class SelfAttention(nn.Module):
    """`attention.self`: the q/k/v projections (fused into `qkv` by `finalize`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.query = Linear(hidden, hidden, bias=True)
        self.key = Linear(hidden, hidden, bias=True)
        self.value = Linear(hidden, hidden, bias=True)
        self.qkv: nn.Module

    def finalize(self, prepare: PrepareLinear) -> None:
        self.qkv = prepare(fuse_linears([self.query, self.key, self.value]), "qkv_proj")
        del self.query, self.key, self.value


class DenseNorm(nn.Module):
    """`attention.output` and `output`: dense, then LayerNorm over it plus the residual."""

    def __init__(self, in_features: int, config: ModelConfig) -> None:
        super().__init__()
        self.dense: nn.Module = Linear(in_features, config.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)  # type: ignore[no-any-return]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self = SelfAttention(config)
        self.output = DenseNorm(config.hidden_size, config)


class Intermediate(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense: nn.Module = Linear(config.hidden_size, config.intermediate_size, bias=True)


@dataclass(slots=True)
class Batch:
    """A packed batch: `rows` maps each packed token to its row in the padded (seqs * longest)
    layout attention uses; `seq_of_token` names each token's sequence."""

    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    lengths: torch.Tensor  # (num_seqs,)
    seq_of_token: torch.Tensor  # (num_tokens,)
    rows: torch.Tensor  # (num_tokens,)
    key_mask: torch.Tensor | None  # (num_seqs, 1, 1, longest) bool; None when no sequence is padded
    longest: int

    @property
    def num_seqs(self) -> int:
        return int(self.lengths.shape[0])

    @classmethod
    def pack(cls, sequences: Sequence[Sequence[int]], device: torch.device) -> Batch:
        lengths = [len(s) for s in sequences]
        if not lengths or min(lengths) == 0:
            raise ValueError("every sequence needs at least one token")
        longest = max(lengths)
        flat = [t for s in sequences for t in s]
        positions = torch.cat([torch.arange(n) for n in lengths])
        seq_of_token = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        rows = seq_of_token * longest + positions
        key_mask = None
        if min(lengths) != longest:
            key_mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
            key_mask = key_mask.to(device)
        return cls(
            input_ids=torch.tensor(flat, dtype=torch.long, device=device),
            positions=positions.to(device),
            lengths=torch.tensor(lengths, device=device),
            seq_of_token=seq_of_token.to(device),
            rows=rows.to(device),
            key_mask=key_mask,
            longest=longest,
        )


class Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.attention = Attention(config)
        self.intermediate = Intermediate(config)
        self.output = DenseNorm(config.intermediate_size, config)
        self.act = _ACTIVATIONS[config.hidden_act]

    def finalize(self, prepare: PrepareLinear) -> None:
        self.attention.self.finalize(prepare)
        self.attention.output.dense = prepare(self.attention.output.dense, "o_proj")
        self.intermediate.dense = prepare(self.intermediate.dense, "up_proj")
        self.output.dense = prepare(self.output.dense, "down_proj")

    def attend(self, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        hidden = h.shape[1]
        qkv = self.attention.self.qkv(h)  # (num_tokens, 3 * hidden)
        if batch.key_mask is None:
            # no padding: the packed rows already are the (seqs, longest) layout
            padded = qkv
        else:
            padded = qkv.new_zeros(batch.num_seqs * batch.longest, 3 * hidden)
            padded.index_copy_(0, batch.rows, qkv)
        # (seqs, longest, 3, heads, head_dim) -> 3 x (seqs, heads, longest, head_dim)
        q, k, v = padded.view(batch.num_seqs, batch.longest, 3, self.num_heads, self.head_dim).permute(
            2, 0, 3, 1, 4
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.key_mask)
        out = out.transpose(1, 2).reshape(batch.num_seqs * batch.longest, hidden)
        return out if batch.key_mask is None else out.index_select(0, batch.rows)

    def forward(self, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        h = self.attention.output(self.attend(h, batch), h)
        return self.output(self.act(self.intermediate.dense(h)), h)  # type: ignore[no-any-return]


class Encoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Layer(config) for _ in range(config.num_hidden_layers)])


class EncoderModel(nn.Module):
    """BertModel without its pooler: token ids in, last hidden states out (packed)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.dtype = torch.float32

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    def checkpoint_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters()]

    def finalize(self, prepare: PrepareLinear) -> None:
        for layer in self.encoder.layer:
            assert isinstance(layer, Layer)
            layer.finalize(prepare)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Hidden states (num_tokens, hidden) of every token of a packed batch."""
        h = self.embeddings(batch.input_ids, batch.positions).to(self.dtype)
        for layer in self.encoder.layer:
            h = layer(h, batch)
        return h  # type: ignore[no-any-return]
