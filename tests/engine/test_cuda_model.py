"""The model on CUDA in bf16: logits against transformers, and CUDA-graph decode against eager.

Runs on a CUDA device (marker `gpu`). Tolerance for logits: bf16 weights and activations differ
from a float32 reference by rounding alone; turbospark's bf16 logits must lie within twice the
error of transformers' own bf16 logits on the same weights (plus 1e-3), both measured against
transformers in float32.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import FAMILIES, checkpoint

from turbospark.engine.attention import build_attention_metadata
from turbospark.engine.kv_cache import ManagedKVCache
from turbospark.engine.models import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK_SIZE = 16


def random_ids(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cuda_model(family: str, init_std: float = 0.02):
    cfg, tensors, ref = checkpoint(FAMILIES[family], init_std=init_std)
    return build_model(cfg, tensors, "cuda", torch.bfloat16), ref


def cuda_cache(model, num_blocks: int) -> ManagedKVCache:
    from turbospark.engine.cuda_attention import CudaAttention

    c = model.config
    return ManagedKVCache(
        c.num_hidden_layers,
        num_blocks,
        BLOCK_SIZE,
        c.num_key_value_heads,
        c.head_dim,
        torch.bfloat16,
        "cuda",
        attention=CudaAttention(),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_live_on_the_device_in_bf16(family: str) -> None:
    model, _ = cuda_model(family)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        assert p.device.type == "cuda" and p.dtype == torch.bfloat16, name


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_logits_match_transformers_within_bf16_rounding(family: str) -> None:
    model, ref = cuda_model(family)
    ids = random_ids(90, seed=1)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1]
        hf_bf16 = copy.deepcopy(ref).to(device="cuda", dtype=torch.bfloat16)
        hf_bf16.config._attn_implementation = "sdpa"
        hf = hf_bf16(torch.tensor([ids], device="cuda")).logits[0, -1].float().cpu()
    kv = cuda_cache(model, 16)
    table: list[int] = []
    assert kv.grow(table, len(ids))
    meta, positions = build_attention_metadata([table], [0], [len(ids)], BLOCK_SIZE, torch.device("cuda"))
    with torch.inference_mode():
        got = model(torch.tensor(ids, device="cuda"), positions, meta, kv)[0].cpu()
    hf_err = (hf - want).abs().max().item()
    our_err = (got - want).abs().max().item()
    assert our_err <= 2 * hf_err + 1e-3, (our_err, hf_err)


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_decode_step_logits_match_transformers_within_bf16_rounding(family: str) -> None:
    # the last token as a one-row decode step: the small-batch kernels (GEMV, norms and rotary
    # fused into the matmuls) rather than the prefill's library matmuls
    model, ref = cuda_model(family)
    ids = random_ids(90, seed=1)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1]
        hf_bf16 = copy.deepcopy(ref).to(device="cuda", dtype=torch.bfloat16)
        hf_bf16.config._attn_implementation = "sdpa"
        hf = hf_bf16(torch.tensor([ids], device="cuda")).logits[0, -1].float().cpu()
    kv = cuda_cache(model, 16)
    table: list[int] = []
    assert kv.grow(table, len(ids))
    device = torch.device("cuda")
    with torch.inference_mode():
        meta, positions = build_attention_metadata([table], [0], [len(ids) - 1], BLOCK_SIZE, device)
        model(torch.tensor(ids[:-1], device=device), positions, meta, kv)
        meta, positions = build_attention_metadata([table], [len(ids) - 1], [1], BLOCK_SIZE, device)
        got = model(torch.tensor(ids[-1:], device=device), positions, meta, kv)[0].cpu()
    hf_err = (hf - want).abs().max().item()
    our_err = (got - want).abs().max().item()
    assert our_err <= 2 * hf_err + 1e-3, (our_err, hf_err)


def greedy(
    model, kv, step, prompts: list[list[int]], num_steps: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefills every prompt in one eager step, then decodes them together with `step`."""
    device = torch.device("cuda")
    tables: list[list[int]] = []
    for p in prompts:
        table: list[int] = []
        assert kv.grow(table, len(p) + num_steps)
        tables.append(table)
    flat = torch.tensor([t for p in prompts for t in p], device=device)
    meta, positions = build_attention_metadata(
        tables, [0] * len(prompts), [len(p) for p in prompts], BLOCK_SIZE, device
    )
    with torch.inference_mode():
        logits = model(flat, positions, meta, kv)
    tokens = [[t] for t in logits.argmax(-1).tolist()]
    lens = [len(p) for p in prompts]
    all_logits = []
    for _ in range(num_steps - 1):
        meta, positions = build_attention_metadata(tables, lens, [1] * len(prompts), BLOCK_SIZE, device)
        ids = torch.tensor([t[-1] for t in tokens], device=device)
        logits = step(ids, positions, meta)
        all_logits.append(logits.clone())
        for i, t in enumerate(logits.argmax(-1).tolist()):
            tokens[i].append(t)
        lens = [n + 1 for n in lens]
    return tokens, all_logits


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
@pytest.mark.parametrize("num_seqs", [1, 3, 4, 7])  # 3 and 7 replay padded graphs (4, 8)
def test_graph_decode_gives_the_eager_text(family: str, num_seqs: int) -> None:
    from turbospark.engine.cuda_graphs import CudaGraphRunner

    model, _ = cuda_model(family, init_std=0.1)  # sharper distributions than the default init
    prompts = [random_ids(5 + 13 * i, seed=10 + i) for i in range(num_seqs)]
    num_steps = 40
    blocks = num_seqs * ((max(map(len, prompts)) + num_steps) // BLOCK_SIZE + 1)

    kv_eager = cuda_cache(model, blocks)
    with torch.inference_mode():
        eager_tokens, eager_logits = greedy(
            model, kv_eager, lambda i, p, m: model(i, p, m, kv_eager), prompts, num_steps
        )
    kv_graph = cuda_cache(model, blocks)
    graphs = CudaGraphRunner(model, kv_graph, max_blocks_per_seq=16, batch_sizes=(1, 2, 4, 8))
    graphs.capture()
    graph_tokens, graph_logits = greedy(model, kv_graph, graphs, prompts, num_steps)
    assert graph_tokens == eager_tokens
    assert len({t for seq in eager_tokens for t in seq}) > 3  # the text is not one repeated token
    for g, e in zip(graph_logits, eager_logits, strict=True):
        torch.testing.assert_close(g, e, atol=1e-2, rtol=0)


def test_steps_that_do_not_fit_a_graph_run_eagerly() -> None:
    from turbospark.engine.cuda_graphs import CudaGraphRunner

    model, _ = cuda_model("qwen2")
    kv = cuda_cache(model, 64)
    graphs = CudaGraphRunner(model, kv, max_blocks_per_seq=4, batch_sizes=(1, 2))
    graphs.capture()
    device = torch.device("cuda")
    tables: list[list[int]] = [[], [], []]
    for t in tables:
        assert kv.grow(t, 80)
    # a prefill, three decodes (more than the largest graph), a context wider than 4 blocks
    meta, _ = build_attention_metadata([tables[0]], [0], [9], BLOCK_SIZE, device)
    assert not graphs.can_replay(torch.zeros(9, device=device), meta)
    meta, _ = build_attention_metadata(tables, [5, 6, 7], [1, 1, 1], BLOCK_SIZE, device)
    assert not graphs.can_replay(torch.zeros(3, device=device), meta)
    meta, _ = build_attention_metadata(tables[:1], [70], [1], BLOCK_SIZE, device)
    assert not graphs.can_replay(torch.zeros(1, device=device), meta)
    meta, _ = build_attention_metadata(tables[:2], [5, 60], [1, 1], BLOCK_SIZE, device)
    assert graphs.can_replay(torch.zeros(2, device=device), meta)


@pytest.mark.parametrize("family", FAMILIES)
def test_piecewise_graphs_give_the_eager_logits_of_mixed_steps(family: str) -> None:
    """Steps of prefill chunks beside decodes replay piecewise (padded to 16, 32 or 64 tokens),
    a step of decodes alone the whole decode graph, a step over 64 tokens runs eagerly: every
    step's logits match an eager run's on its own cache, and the greedy tokens are the same."""
    from turbospark.engine.cuda_graphs import CudaGraphRunner

    model, _ = cuda_model(family, init_std=0.1)
    device = torch.device("cuda")
    kv_eager, kv_graph = cuda_cache(model, 96), cuda_cache(model, 96)
    graphs = CudaGraphRunner(
        model, kv_graph, max_blocks_per_seq=16, batch_sizes=(1, 2, 4), mixed_sizes=(16, 32, 64)
    )
    graphs.capture()
    assert graphs.piecewise is not None
    prompts = [random_ids(n, seed=30 + n) for n in (5, 40, 9, 23)]
    tables: list[list[int]] = [[], [], [], []]
    for t in tables:
        assert kv_eager.grow(t, 120)  # the graph cache uses the same block ids
    done = [0, 0, 0, 0]
    tokens: list[list[int]] = [list(p) for p in prompts]
    # (sequence, tokens fed) per step: a prefill of three (54 tokens: the 64 pieces), decodes
    # beside a new prompt's first chunk (19: 32) and its last (9: 16), then decodes alone (the
    # decode graph)
    steps = [
        [(0, 5), (1, 40), (2, 9)],
        [(0, 1), (2, 1), (3, 17)],
        [(0, 1), (1, 1), (2, 1), (3, 6)],
        [(0, 1), (1, 1), (2, 1), (3, 1)],
        [(0, 1), (1, 1), (2, 1), (3, 1)],
    ]
    replayed = []
    for step in steps:
        feed = []
        for i, n in step:
            feed.append(tokens[i][done[i] : done[i] + n])
        meta, positions = build_attention_metadata(
            [tables[i] for i, _ in step], [done[i] for i, _ in step], [n for _, n in step], BLOCK_SIZE, device
        )
        ids = torch.tensor([t for f in feed for t in f], device=device)
        with torch.inference_mode():
            want = model(ids, positions, meta, kv_eager).clone()
            replayed.append(graphs.piecewise.takes(ids) and not graphs.can_replay(ids, meta))
            got = graphs(ids, positions, meta).clone()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
        for (i, n), row in zip(step, want.argmax(-1).tolist(), strict=True):
            done[i] += n
            if done[i] == len(tokens[i]):
                tokens[i].append(row)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert replayed == [True, True, True, False, False]
    assert not graphs.piecewise.takes(torch.zeros(65, device=device))  # past 64 tokens: eager
