"""Tensor parallelism for the shared decoder: which slice of each weight a rank holds, and the
collectives that make the shards compute the whole model's forward.

Megatron's split, applied to `models/base.py` from outside it:

- q/k/v and gate/up are column-parallel: rank r holds its share of the attention heads (and of
  the kv heads, so its KV cache holds only those) and of the MLP's intermediate columns;
- o_proj and down_proj are row-parallel: each rank multiplies its share of the inputs and one
  all-reduce per projection (two per layer) sums the partial outputs; a bias is added once
  (rank 0 holds it, the others hold zeros);
- the embedding and the lm_head are vocab-parallel: each rank holds a contiguous run of
  `ceil(vocab / world)` rows (the last run padded with zero rows); an embedding lookup zeroes
  the ids outside its run and all-reduces, the lm_head's logit shards are all-gathered.

A rank's model is built from a shard config (`shard_config`: heads, kv heads and intermediate
size per rank; the vocabulary whole) and the sliced checkpoint (`ShardedTensors`), so it is
materialized at its shard's size and quantizes as any model does; `shard_skeleton` and
`wrap_parallel` are the two hooks `build_model` calls around loading. With one rank nothing of
this runs and the model is the single-process one, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from turbospark.engine.layers import Embedding, Linear


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's place in a tensor-parallel group; `group` is the process group its
    collectives run on (None: the default group)."""

    rank: int
    world_size: int
    group: Any = None


def check_tensor_parallel(config: Mapping[str, Any], world_size: int) -> None:
    """Raises ValueError, naming the numbers, when `config` cannot be split over `world_size`."""
    if world_size < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, not {world_size}")
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    inter = int(config["intermediate_size"])
    uneven = [
        f"{what} ({n})"
        for what, n in (("attention heads", heads), ("kv heads", kv_heads), ("intermediate size", inter))
        if n % world_size
    ]
    if uneven:
        raise ValueError(
            f"tensor parallelism over {world_size} ranks needs the attention heads, kv heads and MLP "
            f"intermediate size to divide by {world_size}; this model's {', '.join(uneven)} do not"
        )


def vocab_shard_size(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size)


def shard_config(config: Any, world_size: int) -> Any:
    """The config a rank's model is built from: its share of heads, kv heads and intermediate
    columns; head_dim and the vocabulary stay whole (the vocab split is done by the modules)."""
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        head_dim=config.head_dim,
    )


# checkpoint-name suffix -> (how it is split, the per-rank size unit it is split in)
_COLUMN = {
    "self_attn.q_proj": "heads",
    "self_attn.k_proj": "kv_heads",
    "self_attn.v_proj": "kv_heads",
    "mlp.gate_proj": "inter",
    "mlp.up_proj": "inter",
}
_ROW = {"self_attn.o_proj": "heads", "mlp.down_proj": "inter"}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


class ShardedTensors(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors as one rank sees them: each weight sliced on access and copied
    out of the whole tensor (a view would keep the whole alive), so no rank holds another's
    share. `pop` drops a whole tensor from the underlying dict (`load_weights(consume=True)`)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], config: Any, shard: Shard) -> None:
        self.tensors = tensors
        self.shard = shard
        n = shard.world_size
        self.width = {
            "heads": config.num_attention_heads // n * config.head_dim,
            "kv_heads": config.num_key_value_heads // n * config.head_dim,
            "inter": config.intermediate_size // n,
        }
        self.vocab_size = config.vocab_size
        self.vocab_rows = vocab_shard_size(config.vocab_size, n)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        r = self.shard.rank
        if name in _VOCAB:
            start = r * self.vocab_rows
            rows = t[start : start + self.vocab_rows]
            if rows.shape[0] < self.vocab_rows:  # the last run, padded: those rows are never read
                pad = t.new_zeros(self.vocab_rows - rows.shape[0], *t.shape[1:])
                return torch.cat([rows, pad])
            return rows.clone()
        owner, _, leaf = name.rpartition(".")
        for suffix, unit in _COLUMN.items():
            if owner.endswith(suffix):
                w = self.width[unit]
                return t[r * w : (r + 1) * w].clone()  # weight rows or bias entries
        for suffix, unit in _ROW.items():
            if owner.endswith(suffix):
                if leaf == "bias":  # added once over the group: after the all-reduce it is whole
                    return t if r == 0 else torch.zeros_like(t)
                w = self.width[unit]
                return t[:, r * w : (r + 1) * w].contiguous()
        return t  # norms: every rank holds them whole

    def pop(self, name: str) -> torch.Tensor:
        return self.tensors.pop(name)  # type: ignore[attr-defined,no-any-return]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    dist.all_reduce(x, group=shard.group)
    return x


class VocabParallelEmbedding(Embedding):
    """This rank's run of embedding rows; ids outside it look up zeros, summed over the group."""

    def __init__(self, vocab_size: int, embedding_dim: int, shard: Shard) -> None:
        rows = vocab_shard_size(vocab_size, shard.world_size)
        super().__init__(rows, embedding_dim)
        self.shard = shard
        self.start = shard.rank * rows
        self.num_rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (num_tokens, hidden)
        if self.out_dtype is not None:
            x = x.to(self.out_dtype)
        # exact: every id is inside exactly one rank's run, the others add zeros
        return all_reduce(x.masked_fill(outside[:, None], 0), self.shard)


class RowParallel(nn.Module):
    """A row-parallel projection (o_proj, down_proj): this rank's partial product, summed over
    the group. `inner` is the (possibly quantized) linear over this rank's input columns."""

    def __init__(self, inner: nn.Module, shard: Shard) -> None:
        super().__init__()
        self.inner = inner
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.inner(x), self.shard)


class GatheredLMHead(nn.Module):
    """The vocab-parallel lm_head: every rank's logit columns, gathered and cut to the vocab."""

    def __init__(self, inner: nn.Module, vocab_size: int, shard: Shard) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.shard = shard

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        part = self.inner(h).contiguous()  # (num_seqs, vocab_rows)
        parts = [torch.empty_like(part) for _ in range(self.shard.world_size)]
        dist.all_gather(parts, part, group=self.shard.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def shard_skeleton(model: Any, shard: Shard) -> None:
    """Gives a model skeleton (built from `shard_config`, on the meta device) its vocab-parallel
    embedding and lm_head, before the sliced weights are loaded into it."""
    cfg = model.config
    with torch.device("meta"):
        model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard)
        model.lm_head = Linear(cfg.hidden_size, vocab_shard_size(cfg.vocab_size, shard.world_size))


def wrap_parallel(model: Any, shard: Shard) -> None:
    """After `finalize` (fusion, quantization): the all-reduces after o_proj and down_proj and
    the gather after the lm_head."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, shard)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, shard)
    model.lm_head = GatheredLMHead(model.lm_head, model.config.vocab_size, shard)
