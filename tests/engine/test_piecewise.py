"""Piecewise graphs' split of a forward, on CPU: the pieces run in replay order over the static
buffers give the eager forward's logits for steps of prefill chunks beside decodes, padded to
the next size. A CUDA graph replays exactly the kernels its capture ran, so here each "graph"
replays its piece by running it again (the model, cache and attention are the real ones); the
capture itself is held by the gpu tests (tests/engine/test_cuda_model.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tiny_models import FAMILIES, checkpoint

from turbospark.engine.attention import build_attention_metadata
from turbospark.engine.cuda_graphs import PiecewiseGraphs, piecewise_sizes
from turbospark.engine.kv_cache import ManagedKVCache
from turbospark.engine.models import build_model
from turbospark.engine.models.base import CausalLM

BLOCK_SIZE = 16


class Rerun:
    """Stands in for a captured graph: replay runs the piece again."""

    def __init__(self, piece: Callable[[], None]) -> None:
        self.piece = piece

    def replay(self) -> None:
        self.piece()


class RerunPieces(PiecewiseGraphs):
    def capture(self, pool: object = None) -> None:
        for n in self.sizes:
            self._graphs[n] = [
                Rerun(lambda i=i, n=n: self._piece(i, n))  # type: ignore[misc]
                for i in range(len(self.layers) + 1)
            ]


def test_sizes_cover_the_step_budget() -> None:
    assert piecewise_sizes(256)[-1] == 256 and piecewise_sizes(200)[-1] == 224
    assert piecewise_sizes(16) == (16,) and piecewise_sizes(4096)[-1] == 512


@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_in_replay_order_give_the_eager_logits(family: str) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES[family], init_std=0.1)
    model = build_model(cfg, tensors, "cpu", torch.float32)
    assert isinstance(model, CausalLM)
    c = model.config

    def cache() -> ManagedKVCache:
        return ManagedKVCache(
            c.num_hidden_layers, 96, BLOCK_SIZE, c.num_key_value_heads, c.head_dim, torch.float32, "cpu"
        )

    kv_eager, kv_pieces = cache(), cache()
    pieces = RerunPieces(model, kv_pieces, (16, 32, 64))
    pieces.capture()
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 40, 9, 23)]
    tables: list[list[int]] = [[], [], [], []]
    for t in tables:
        assert kv_eager.grow(t, 120)  # the second cache uses the same block ids
    done = [0, 0, 0, 0]
    # (sequence, tokens fed): 54 tokens (size 64), 19 (32), 9 (16): a new prompt's chunks
    # beside decodes; the padding rows differ from step to step
    for step in ([(0, 5), (1, 40), (2, 9)], [(0, 1), (2, 1), (3, 17)], [(0, 1), (1, 1), (2, 1), (3, 6)]):
        ids = torch.tensor([t for i, n in step for t in tokens[i][done[i] : done[i] + n]])
        assert pieces.takes(ids)

        args = (
            [tables[i] for i, _ in step],
            [done[i] for i, _ in step],
            [n for _, n in step],
            BLOCK_SIZE,
            torch.device("cpu"),
        )
        with torch.inference_mode():
            meta, positions = build_attention_metadata(*args)
            want = model(ids, positions, meta, kv_eager)
            meta, positions = build_attention_metadata(*args)  # fresh: a backend fills its scratch
            got = pieces(ids, positions, meta)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for (i, n), token in zip(step, want.argmax(-1).tolist(), strict=True):
            done[i] += n
            if done[i] == len(tokens[i]):
                tokens[i].append(token)
    assert not pieces.takes(torch.zeros(65, dtype=torch.long))
