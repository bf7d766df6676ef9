"""The sampler against hand-written probability vectors."""

from __future__ import annotations

import math

import pytest
import torch

from turbospark.backend import GenerationConfig
from turbospark.sampling import (
    DistinctIds,
    apply_penalties,
    filter_logits,
    make_generator,
    sample,
    truncate_rows,
)

PROBS = [0.5, 0.3, 0.15, 0.05]


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def kept(logits: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(logits.tolist()) if v != float("-inf")]


def cfg(**kwargs) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=1, **kwargs)


def test_greedy_takes_the_argmax() -> None:
    logits = logits_of([0.1, 0.2, 0.6, 0.1])
    gen = make_generator(0)
    assert sample(logits, cfg(temperature=0.0), gen, [], []).token_id == 2
    assert cfg(temperature=0.7, top_k=1).is_greedy
    assert sample(logits, cfg(temperature=0.7, top_k=1), gen, [], []).token_id == 2


@pytest.mark.parametrize(("top_k", "expected"), [(1, [0]), (2, [0, 1]), (3, [0, 1, 2]), (0, [0, 1, 2, 3])])
def test_top_k_mask(top_k: int, expected: list[int]) -> None:
    assert kept(filter_logits(logits_of(PROBS), cfg(top_k=top_k))) == expected


@pytest.mark.parametrize(
    ("top_p", "expected"),
    # a token is kept while the mass of the tokens before it is still below top_p
    [(0.4, [0]), (0.5, [0]), (0.51, [0, 1]), (0.8, [0, 1]), (0.81, [0, 1, 2]), (0.99, [0, 1, 2, 3])],
)
def test_top_p_mask(top_p: float, expected: list[int]) -> None:
    assert kept(filter_logits(logits_of(PROBS), cfg(top_p=top_p))) == expected


def test_top_p_mask_with_shuffled_vocab() -> None:
    shuffled = [0.05, 0.3, 0.5, 0.15]
    assert kept(filter_logits(logits_of(shuffled), cfg(top_p=0.8))) == [1, 2]


@pytest.mark.parametrize(
    ("min_p", "expected"), [(0.05, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.5, [0, 1]), (0.9, [0])]
)
def test_min_p_mask(min_p: float, expected: list[int]) -> None:
    # keeps tokens whose probability is at least min_p times the top probability (0.5)
    assert kept(filter_logits(logits_of(PROBS), cfg(min_p=min_p))) == expected


def test_temperature_reshapes_the_distribution() -> None:
    probs = torch.tensor(PROBS)
    got = torch.softmax(filter_logits(probs.log(), cfg(temperature=0.5)), dim=-1)
    expected = probs**2 / (probs**2).sum()
    torch.testing.assert_close(got, expected)


def test_logit_bias_and_penalties() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0])
    out = apply_penalties(logits.clone(), cfg(logit_bias={3: 5.0, 0: -1.0}), [], [])
    assert out.tolist() == [1.0, -1.0, 0.5, 5.0]
    # repetition penalty: positive logits of seen ids divided, negative ones multiplied
    out = apply_penalties(logits.clone(), cfg(repetition_penalty=2.0), [0, 1, 1], [])
    assert out.tolist() == [1.0, -2.0, 0.5, 0.0]
    # presence subtracts once per seen id, frequency once per occurrence (generated ids only)
    out = apply_penalties(
        logits.clone(), cfg(presence_penalty=0.5, frequency_penalty=0.25), [2, 2], [2, 2, 3]
    )
    assert out.tolist() == [2.0, -1.0, 0.5 - 0.5 - 0.5, 0.0 - 0.5 - 0.25]


def test_distinct_ids_follow_a_growing_context() -> None:
    distinct = DistinctIds()
    context = [5, 3, 5, 9]
    assert distinct.of(context).tolist() == [5, 3, 9]
    context += [3, 1]  # a decode step or two: only the new ids are looked at
    assert distinct.of(context).tolist() == [5, 3, 9, 1]
    assert distinct.of([7, 7]).tolist() == [7]  # a list that did not grow: counted afresh
    # the penalty reads the same set whether the caller keeps the ids or not
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0, 1.0, 3.0, -2.0, 0.25, 1.5, -0.5])
    context = [1, 4, 4, 8, 9]
    kept = DistinctIds()
    for end in range(1, len(context) + 1):
        with_state = apply_penalties(logits.clone(), cfg(repetition_penalty=1.3), context[:end], [], kept)
        without = apply_penalties(logits.clone(), cfg(repetition_penalty=1.3), context[:end], [])
        assert torch.equal(with_state, without)


def test_penalties_apply_before_greedy() -> None:
    logits = logits_of([0.6, 0.4, 0.0001, 0.0001])
    assert sample(logits, cfg(temperature=0.0, logit_bias={1: 10.0}), make_generator(0), [], []).token_id == 1


def test_processors_see_generated_ids_and_mask() -> None:
    seen = []

    def ban_first(generated_ids, logits: torch.Tensor) -> None:
        seen.append(list(generated_ids))
        logits[0] = float("-inf")

    event = sample(
        logits_of(PROBS), cfg(temperature=0.0, processors=[ban_first]), make_generator(0), [9, 4], [4]
    )
    assert event.token_id == 1
    assert seen == [[4]]


def test_same_seed_same_tokens_and_the_right_distribution() -> None:
    config = cfg(temperature=1.0)
    logits = logits_of(PROBS)
    draws = [
        sample(logits, config, gen, [], []).token_id for gen in [make_generator(42)] for _ in range(4000)
    ]
    again = [
        sample(logits, config, gen, [], []).token_id for gen in [make_generator(42)] for _ in range(4000)
    ]
    assert draws == again
    other = [
        sample(logits, config, gen, [], []).token_id for gen in [make_generator(43)] for _ in range(4000)
    ]
    assert draws != other
    freqs = [draws.count(i) / len(draws) for i in range(4)]
    # 4000 draws: the standard error of each frequency is at most 0.008
    assert all(abs(f - p) < 0.03 for f, p in zip(freqs, PROBS, strict=True)), freqs


def test_top_k_sampling_never_draws_masked_tokens() -> None:
    config = cfg(temperature=1.5, top_k=2)
    gen = make_generator(1)
    assert {sample(logits_of(PROBS), config, gen, [], []).token_id for _ in range(500)} == {0, 1}


def test_logprobs_of_the_chosen_token_and_the_top() -> None:
    event = sample(logits_of(PROBS), cfg(temperature=0.0, num_top_logprobs=2), make_generator(0), [], [])
    assert event.token_id == 0
    assert event.logprob == pytest.approx(math.log(0.5), abs=1e-6)
    assert event.top_logprobs is not None
    assert [t for t, _ in event.top_logprobs] == [0, 1]
    assert event.top_logprobs[1][1] == pytest.approx(math.log(0.3), abs=1e-6)
    assert sample(logits_of(PROBS), cfg(temperature=0.0), make_generator(0), [], []).logprob is None


def test_sample_leaves_the_callers_logits_alone() -> None:
    logits = logits_of(PROBS)
    before = logits.clone()
    sample(
        logits,
        cfg(temperature=0.0, logit_bias={3: 100.0}, repetition_penalty=1.5),
        make_generator(0),
        [0],
        [0],
    )
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.7},
        {"top_k": 40},
        {"top_p": 0.9},
        {"top_p": 0.3, "temperature": 1.3},
        {"min_p": 0.05},
        {"top_k": 100, "top_p": 0.95, "min_p": 0.01},
        {"top_k": 5, "min_p": 0.3},
        {"top_p": 0.97},  # with flat logits the nucleus outgrows every head: the full-sort path
    ],
)
def test_candidates_keep_what_filter_logits_keeps(kwargs: dict) -> None:
    from turbospark.sampling import candidates

    gen = torch.Generator().manual_seed(0)
    for scale in (0.5, 3.0, 10.0):  # flat to peaked distributions
        logits = torch.randn(5000, generator=gen) * scale
        config = cfg(**kwargs)
        reference = torch.softmax(filter_logits(logits, config), dim=-1)
        ids, probs = candidates(logits, config)
        assert sorted(ids.tolist()) == kept(filter_logits(logits, config))
        torch.testing.assert_close(probs, reference[ids], atol=1e-6, rtol=1e-4)


def test_sampling_within_top_p_matches_the_renormalized_head() -> None:
    # p = [0.5, 0.3, 0.15, 0.05] with top_p 0.8 keeps {0, 1} at 0.625 / 0.375
    config = cfg(temperature=1.0, top_p=0.8)
    gen = make_generator(5)
    draws = [sample(logits_of(PROBS), config, gen, [], []).token_id for _ in range(4000)]
    assert set(draws) == {0, 1}
    assert abs(draws.count(0) / 4000 - 0.625) < 0.03


def test_sample_runs_on_one_thread_and_restores_the_count() -> None:
    """The vocabulary-wide work runs with one intra-op thread (see `sample`); the caller's
    thread count is back afterwards, and the draws are those of a one-thread caller."""
    logits = torch.randn(50_000, generator=torch.Generator().manual_seed(3))
    seen: list[int] = []

    def spy(generated_ids, row) -> None:
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    try:
        draws = {}
        for num_threads in (2, 1):
            torch.set_num_threads(num_threads)
            gen = make_generator(11)
            config = cfg(temperature=0.8, top_p=0.95, processors=[spy])
            draws[num_threads] = [sample(logits, config, gen, [], []).token_id for _ in range(20)]
            assert torch.get_num_threads() == num_threads
        assert draws[2] == draws[1]
        assert set(seen) == {1}
    finally:
        torch.set_num_threads(before)


def test_truncate_rows_keeps_what_filter_logits_keeps_row_by_row() -> None:
    """The batched truncation (the GPU sampler's) against the one-row statement, on rows that
    each mix the filters differently, including rows with none and one with no top-k (the
    whole vocabulary sorted)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 500
    configs = [
        cfg(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
        cfg(temperature=1.0, top_k=5),
        cfg(temperature=1.3, top_p=0.5),
        cfg(temperature=0.9, min_p=0.2),
        cfg(temperature=1.0),
        cfg(temperature=0.5, top_k=300, top_p=0.9),
    ]
    logits = torch.randn(len(configs), vocab, generator=gen) * 3
    for subset in (configs, configs[:2], [configs[1], configs[4]]):
        rows = logits[: len(subset)]
        values, ids = truncate_rows(rows, subset)
        for r, c in enumerate(subset):
            want = filter_logits(rows[r], c)
            got = torch.full((vocab,), float("-inf"))
            got[ids[r]] = values[r]
            assert kept(got) == kept(want), c
            finite = want != float("-inf")
            assert torch.allclose(got[finite], want[finite])
