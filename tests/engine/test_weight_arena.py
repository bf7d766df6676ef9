"""Weights packed into one huge-page mapping (`engine/weight_arena.py`): the model computes
exactly what it did, every holder of a weight sees it moved, and the mapping gets 2 MiB pages
where the system offers them."""

from __future__ import annotations

import re

import pytest
import torch
from tiny_models import FAMILIES, checkpoint

from turbospark.engine import weight_arena
from turbospark.engine.models import build_model
from turbospark.engine.runner import ModelRunner, SequenceState


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    runner = ModelRunner(model, max_context=64)
    seq = SequenceState()
    out = [runner.forward([(seq, [5, 9, 13, 17, 21])])]
    for token in (30, 31, 32):
        out.append(runner.forward([(seq, [token])]))
    return torch.cat(out)


def huge_kib_over(start: int, end: int) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [start, end)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                lo, hi = int(span.group(1), 16), int(span.group(2), 16)
                inside = lo < end and hi > start
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.mark.parametrize(("family", "quant"), [("llama", "int4"), ("qwen2", "int8"), ("llama", None)])
def test_packed_model_computes_the_same_logits(
    family: str, quant: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES[family])
    monkeypatch.setenv(weight_arena.ENV_VAR, "0")
    plain = build_model(cfg, dict(tensors), "cpu", torch.float32, quant=quant)
    assert not hasattr(plain, "_weight_arena")
    monkeypatch.delenv(weight_arena.ENV_VAR)
    if not weight_arena.available():
        pytest.skip("no transparent huge pages on this system")
    packed = build_model(cfg, dict(tensors), "cpu", torch.float32, quant=quant)
    area = packed._weight_arena
    torch.testing.assert_close(logits_of(packed), logits_of(plain), atol=0, rtol=0)
    # every weight a step reads now lies in the one mapping (the native decoder included,
    # which is built after the move from the tensors' pointers)
    start = torch.frombuffer(area, dtype=torch.uint8).data_ptr()
    end = start + len(area)
    movable = [t for t in weight_arena._tensors(plain) if weight_arena._movable(t)]
    inside = [t for t in weight_arena._tensors(packed) if start <= t.data_ptr() < end]
    assert len(inside) == len(movable) > 0
    if cfg.get("tie_word_embeddings") and quant is None:
        assert packed.lm_head.weight.data_ptr() == packed.model.embed_tokens.weight.data_ptr()


def test_tied_tensors_move_together_and_views_stay() -> None:
    if not weight_arena.available():
        pytest.skip("no transparent huge pages on this system")
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    # another tensor object over the same whole storage: one copy, both pointed at it
    model[1].weight = torch.nn.Parameter(model[0].weight.detach().view(256, 256))
    base = torch.arange(64.0)
    model[0].register_buffer("window", base[8:16])  # a view into a larger storage: not moved
    alias = torch.nn.Module()
    alias.register_buffer("same", model[0].bias)  # one tensor object held by two modules
    model.append(alias)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    moved = weight_arena.pack_weights(model)
    assert moved == (256 * 256 + 256 + 256) * 4  # the shared storage counted once
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert model[1].weight.data_ptr() == model[0].weight.data_ptr()
    assert model[0].window.data_ptr() == base.data_ptr() + 8 * 4
    assert alias.same is model[0].bias


def test_mapping_gets_huge_pages_where_offered() -> None:
    if not weight_arena.available():
        pytest.skip("no transparent huge pages on this system")
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8)))  # 8 x 4 MiB
    assert weight_arena.pack_weights(model) >= 8 * 1024 * 1024 * 4
    start = model[0].weight.data_ptr()
    # the kernel may fall back to small pages for some of it under memory pressure, not all
    assert huge_kib_over(start, start + 32 * 2**20) >= 2048


def test_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weight_arena.ENV_VAR, "0")
    model = torch.nn.Linear(64, 64)
    ptr = model.weight.data_ptr()
    assert weight_arena.pack_weights(model) == 0
    assert model.weight.data_ptr() == ptr
