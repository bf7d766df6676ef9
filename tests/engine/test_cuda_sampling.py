"""The batched GPU sampler (`sampling._sample_on_device`, `cuda_ops.sample_truncated`) against
the one-row statement of the filters (`filter_logits`) and the unfused GPU path
(`truncate_rows` + `cuda_ops.sample_rows`). Runs on a CUDA device (marker `gpu`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from turbospark.backend import GenerationConfig
from turbospark.engine import cuda_ops
from turbospark.sampling import DistinctIds, filter_logits, make_generator, sample_batch, truncate_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")
NEG_INF = float("-inf")


def cfg(**kw: object) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=16, **kw)  # type: ignore[arg-type]


CONFIGS = [
    cfg(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),  # the built-in defaults at t 0.7
    cfg(temperature=1.0, top_k=5),
    cfg(temperature=1.3, top_k=40, top_p=0.5),
    cfg(temperature=0.9, top_k=20, min_p=0.2),
    cfg(temperature=0.5, top_k=300, top_p=0.9),
    cfg(temperature=2.0, top_k=1000, min_p=0.01, top_p=0.99),
]


@dataclass
class Row:
    config: GenerationConfig
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    num_prompt_tokens: int = 3
    distinct_ids: DistinctIds = field(default_factory=DistinctIds)

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def kept_ids(logits: torch.Tensor, config: GenerationConfig) -> set[int]:
    filtered = filter_logits(logits.float().cpu(), config)
    return set(torch.nonzero(filtered != NEG_INF)[:, 0].tolist())


def test_truncated_kernel_filters_as_truncate_rows_and_draws_as_sample_rows() -> None:
    rows, vocab = 64, 32_000
    configs = [CONFIGS[r % len(CONFIGS)] for r in range(rows)]
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE)
    seeds = torch.randint(0, 2**31 - 1, (rows,), generator=gen)
    width = max(c.top_k for c in configs)
    values, ids = torch.topk(logits, width, dim=-1)
    pairs = zip(configs, seeds.tolist(), strict=True)
    table = [(c.temperature, c.top_k, c.min_p, c.top_p, s) for c, s in pairs]
    params = torch.tensor(table, dtype=torch.float64).to(DEVICE)
    tokens = cuda_ops.sample_truncated(values, ids, params)
    want_values, want_ids = truncate_rows(logits, configs)
    assert torch.equal(want_ids, ids)
    finite = want_values != NEG_INF
    assert torch.equal(finite, values != NEG_INF)  # the same candidates kept in every row
    assert torch.allclose(values[finite], want_values[finite])
    at = cuda_ops.sample_rows(want_values, torch.ones(rows, device=DEVICE), seeds.to(DEVICE)).long()
    assert torch.equal(ids.gather(1, at[:, None])[:, 0], tokens)  # the same seed, the same draw
    for r in range(0, rows, 7):
        assert kept_ids(logits[r], configs[r]) == set(ids[r][finite[r]].tolist())


def test_truncated_kernel_follows_the_filtered_distribution() -> None:
    # probabilities 0.4, 0.3, 0.2, 0.1 among 5,000 tokens; top-k 3 leaves 4/9, 3/9, 2/9
    rows, vocab = 4000, 5_000
    logits = torch.full((rows, vocab), NEG_INF)
    logits[:, 10:14] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    logits = logits.to(DEVICE)
    values, ids = torch.topk(logits, 3, dim=-1)
    seeds = torch.arange(rows, dtype=torch.float64) * 7919 + 13
    params = torch.zeros(rows, 5, dtype=torch.float64)
    params[:, 0], params[:, 1], params[:, 3], params[:, 4] = 1.0, 3, 1.0, seeds
    tokens = cuda_ops.sample_truncated(values, ids, params.to(DEVICE))
    freq = torch.bincount(tokens.cpu() - 10, minlength=4).double() / rows
    assert freq[3] == 0.0
    want = torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0], dtype=torch.float64)
    assert (freq - want).abs().max().item() < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_batch_on_cuda_keeps_to_the_filters_and_its_seeds(dtype: torch.dtype) -> None:
    """Every route of the batched sampler in one batch: top-k rows (the fused kernel), a row
    with top-p alone (sorted whole), a plain row, a greedy row; each token is among what
    `filter_logits` keeps, and the same seeds give the same tokens."""
    vocab = 40_000
    configs = [*CONFIGS, cfg(temperature=0.8, top_p=0.9), cfg(temperature=0.8), cfg(temperature=0.0)]
    configs = configs * 4
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(len(configs), vocab, generator=gen) * 4).to(DEVICE, dtype)

    def run() -> list[int]:
        rows = [Row(c, make_generator(100 + i)) for i, c in enumerate(configs)]
        events = sample_batch(logits, rows)
        return [e.token_id for e in events]  # type: ignore[union-attr]

    first = run()
    assert run() == first
    for r, (c, token) in enumerate(zip(configs, first, strict=True)):
        if c.is_greedy:
            assert token == int(logits[r].float().argmax())
        else:
            assert token in kept_ids(logits[r], c), (r, c)
    if dtype == torch.bfloat16:  # the same values as float32 give the same tokens
        wide = logits.float()
        rows = [Row(c, make_generator(100 + i)) for i, c in enumerate(configs)]
        assert [e.token_id for e in sample_batch(wide, rows)] == first  # type: ignore[union-attr]
