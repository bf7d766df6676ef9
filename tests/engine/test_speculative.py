"""Speculative decoding: greedy output identical to plain decoding through the batched engine
(every proposer, batching, prefix caching, preemption), rollback that frees exactly the rejected
blocks and registers only accepted tokens in the prefix cache, and rejection sampling whose
output is distributed as the target's."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from test_engine import prompts, run_all
from tiny_models import FAMILIES, checkpoint

from turbospark.backend import NEVER_CANCEL, GenerationConfig
from turbospark.engine import row_kernels
from turbospark.engine.engine import Engine, StepOutput
from turbospark.engine.kv_cache import BlockManager
from turbospark.engine.models import build_model
from turbospark.engine.runner import ModelRunner
from turbospark.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from turbospark.engine.sequence import Sequence
from turbospark.engine.speculative import (
    NgramIndex,
    ResponseIndex,
    SpeculativeConfig,
    Speculator,
    accept_greedy,
    parse_speculative,
    rejection_step,
    sample_step,
)
from turbospark.sampling import DistinctIds, candidates, make_generator


# ---- pure parts -------------------------------------------------------------------------------
def test_ngram_index_finds_the_most_recent_earlier_occurrence_of_the_longest_suffix() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    index = NgramIndex(2, 4)
    index.extend(tokens, len(tokens) - 1)
    # suffix [2, 3]: its latest earlier occurrence ends at 6 (followed by 7), not at 2
    assert index.find(tokens) == 6
    tokens += [7]
    index.extend(tokens, len(tokens) - 1)
    assert index.find(tokens) == 7  # [2, 3, 7] at 5..7 (the longer match wins)
    assert index.find([4, 4]) is None


def test_the_response_index_proposes_from_earlier_responses_and_stays_bounded() -> None:
    index = ResponseIndex(2, 4, max_tokens=50)
    index.add([10, 11, 12, 13, 14, 15])
    assert index.propose([99, 11, 12], 3) == [13, 14, 15]
    for i in range(20):
        index.add([100 + i] * 10)
    assert index.num_tokens <= 50
    assert index.propose([99, 11, 12], 3) == []  # its response was dropped


def test_accept_greedy_keeps_drafts_while_they_equal_the_argmax() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5], [4, 1]) == [4]
    assert accept_greedy([], [3]) == [3]


def test_parse_speculative_refuses_unknown_names() -> None:
    assert parse_speculative("off") is None
    assert parse_speculative("ngram", 3) == SpeculativeConfig(method="ngram", num_tokens=3)
    assert parse_speculative("draft:qwen2.5-coder:0.5b", 4) == SpeculativeConfig(
        method="draft", draft_model="qwen2.5-coder:0.5b", num_tokens=4
    )
    with pytest.raises(ValueError, match="name the draft model"):
        parse_speculative("draft:")
    with pytest.raises(ValueError, match="draft model goes with"):
        SpeculativeConfig(method="ngram", draft_model="x")
    with pytest.raises(ValueError, match="expected one of"):
        parse_speculative("eagle")


@pytest.mark.parametrize(("draft", "dense_q"), [(0, False), (5, False), (None, True)])
def test_rejection_step_output_is_distributed_as_the_target(draft: int | None, dense_q: bool) -> None:
    """Whatever the draft (likely, unlikely, impossible) of a draftless proposer (a point mass q
    at the draft), and for a proposer with a distribution q (a draft model, its draft drawn
    from q), the token is distributed as p."""
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.1, 0.0])
    q = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.1, 0.3]) if dense_q else None
    gen = make_generator(1234 + (draft or 0))
    proposals = (
        torch.multinomial(q, 20_000, replacement=True, generator=make_generator(9)) if q is not None else None
    )
    draws = 20_000
    counts = torch.zeros(6)
    for i in range(draws):
        x = int(proposals[i]) if proposals is not None else draft
        assert x is not None
        _, token = rejection_step(p, x, gen, q)
        counts[token] += 1
    freq = counts / draws
    # 4 standard deviations of a frequency near 0.5 over 20,000 draws is 0.014
    assert float((freq - p).abs().max()) < 0.014, (freq, p)
    assert counts[5] == 0


@dataclass
class _Row:
    """A sampling row as the engine's Sequence presents it."""

    config: GenerationConfig
    generator: torch.Generator
    token_ids: list[int]
    num_prompt_tokens: int = 2
    distinct_ids: DistinctIds = field(default_factory=DistinctIds)

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def test_sampled_verification_keeps_the_target_distribution_over_two_positions() -> None:
    """A one-draft verification through `sample_step`, with top-k and a repetition penalty:
    the first token is distributed as the first position's sampler, and the second token (when
    the draft was kept) as the second position's sampler with the draft in its context."""
    torch.manual_seed(0)
    vocab = 8
    logits = torch.randn(2, vocab) * 1.5
    config = GenerationConfig(max_new_tokens=2, temperature=0.8, top_k=6, repetition_penalty=1.3)
    context = [1, 2]
    draft = int(torch.argsort(logits[0], descending=True)[1])  # a plausible, not the likeliest, guess

    def target(row: int, ctx: list[int]) -> torch.Tensor:
        from turbospark.sampling import apply_penalties

        x = apply_penalties(logits[row].clone(), config, ctx, ctx[2:])
        ids, probs = candidates(x, config)
        p = torch.zeros(vocab)
        p[ids] = probs
        return p

    p0, p1 = target(0, context), target(1, [*context, draft])
    gen = make_generator(7)
    draws = 8_000
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(draws):
        row = _Row(config, gen, list(context))
        (got,) = sample_step(logits, [row], [[draft]])
        assert isinstance(got, list)
        first[got[0].token_id] += 1
        if got[0].token_id == draft:
            assert len(got) == 2
            second[got[1].token_id] += 1
        else:
            assert len(got) == 1
    assert float((first / draws - p0).abs().max()) < 4 * 0.5 / draws**0.5
    kept = float(second.sum())
    assert kept > 800
    assert float((second / kept - p1).abs().max()) < 4 * 0.5 / kept**0.5


# ---- through the engine -------------------------------------------------------------------------
def repetitive_prompts(seed: int, num: int, vocab: int = 250) -> list[list[int]]:
    """Prompts that repeat a phrase (n-gram hits from the first decoded token), half of them
    sharing a 40-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(num):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        body = phrase * rng.randint(2, 4) + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 5))]
        out.append(shared + body if i % 2 else body)
    return out


def spec_engine(model, speculator: Speculator, *, num_blocks: int, **sched) -> Engine:
    sched.setdefault("max_prefill_tokens", sched.get("max_batched_tokens", 256))
    runner = ModelRunner(model, max_context=128, num_blocks=num_blocks, block_size=4)
    scheduler = Scheduler(SchedulerConfig(**sched), runner.block_manager)
    return Engine(runner, scheduler, max_context=128, name="spec", speculator=speculator)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_speculation_equals_plain_decoding_with_batching_and_prefix_caching(
    family: str, method: str
) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES[family], seed=1, init_std=1.0)
    model = build_model(cfg, tensors)
    requests = repetitive_prompts(seed=2, num=8) + prompts(seed=3, num=4)
    configs = [GenerationConfig(max_new_tokens=20 + i, temperature=0.0) for i in range(len(requests))]
    reference = ModelRunner(model, max_context=128, block_size=4)
    want = [
        reference.generate(p, c, NEVER_CANCEL, lambda _: None).token_ids
        for p, c in zip(requests, configs, strict=True)
    ]
    speculator = Speculator(SpeculativeConfig(method=method, num_tokens=4, max_batch=16))
    # a tight cache: some sequences are preempted and recomputed mid-speculation
    engine = spec_engine(model, speculator, num_blocks=64, max_active=8, max_batched_tokens=24)
    got = run_all(engine, requests, configs)
    if method == "suffix":  # the second round proposes from the first round's responses too
        got = run_all(engine, requests, configs)
    assert got == want
    # random weights rarely repeat their prompt, so n-gram drafts are mostly rejected (the
    # oracle test below covers long accepted runs); the second round's suffix drafts, from the
    # first round's identical responses, are accepted
    if method == "suffix":
        assert speculator.num_verifications > 0 and speculator.num_accepted > 0
    scheduler = engine.scheduler
    assert scheduler.num_prefix_hit_tokens > 0
    scheduler.check()
    assert scheduler.blocks.num_used_blocks == 0


class OracleProposer:
    """Proposes the true greedy continuation, cut at a random length and, half the time,
    corrupted at a random place: random accept lengths, including none."""

    name = "oracle"

    def __init__(self, want: dict[tuple[int, ...], list[int]], seed: int) -> None:
        self.want = want
        self.rng = random.Random(seed)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        truth = self.want[tuple(seq.token_ids[: seq.num_prompt_tokens])][seq.num_generated :]
        draft = truth[: self.rng.randint(0, k)]
        if draft and self.rng.random() < 0.5:
            draft[self.rng.randrange(len(draft))] = self.rng.randrange(320)
        return draft

    def finished(self, seq: Sequence) -> None:
        pass

    def retain(self, live: object) -> None:
        pass


class CheckingRunner(ModelRunner):
    """Checks, before every forward, that each scheduled sequence holds exactly the blocks its
    computed tokens and this step's tokens need (rejected drafts' blocks went back), that every
    prefix-cache key in its table names its own accepted tokens, and the scheduler's invariants."""

    engine: Engine

    def execute(self, batch: ScheduledBatch, *, want_ids: bool = False) -> StepOutput:
        with self.engine._lock:
            blocks = self.engine.scheduler.blocks
            self.engine.scheduler.check()
            for seq, n in zip(batch.seqs, batch.num_new, strict=True):
                assert len(seq.block_table) == blocks.num_blocks_for(seq.num_computed_tokens + n)
                key = None
                bs = blocks.block_size
                for i, b in enumerate(seq.block_table[: seq.num_computed_tokens // bs]):
                    key = BlockManager.chain_key(key, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
                    registered = blocks._key_of.get(b)
                    assert registered is None or registered == key, "a block is cached under other tokens"
                assert seq.num_hashed_blocks <= seq.num_computed_tokens // bs
        return super().execute(batch, want_ids=want_ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rollback_under_random_accept_lengths_frees_exactly_the_rejected_blocks(seed: int) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES["qwen2"], seed=5, init_std=1.0)
    model = build_model(cfg, tensors)
    requests = prompts(seed=10 + seed, num=8)
    configs = [GenerationConfig(max_new_tokens=25, temperature=0.0) for _ in requests]
    reference = ModelRunner(model, max_context=128, block_size=4)
    want = [
        reference.generate(p, c, NEVER_CANCEL, lambda _: None).token_ids
        for p, c in zip(requests, configs, strict=True)
    ]
    speculator = Speculator(SpeculativeConfig(num_tokens=6, max_batch=16))
    speculator.proposer = OracleProposer({tuple(p): w for p, w in zip(requests, want, strict=True)}, seed)
    runner = CheckingRunner(model, max_context=128, num_blocks=56, block_size=4)
    scheduler = Scheduler(
        SchedulerConfig(max_active=8, max_batched_tokens=32, max_prefill_tokens=32), runner.block_manager
    )
    engine = Engine(runner, scheduler, max_context=128, name="oracle", speculator=speculator)
    runner.engine = engine
    got = run_all(engine, requests, configs)
    assert got == want
    assert 0 < speculator.num_accepted < speculator.num_proposed
    scheduler.check()
    assert scheduler.blocks.num_used_blocks == 0


def test_speculation_keeps_penalties_logprobs_and_stop_tokens() -> None:
    """A repetition penalty, logprobs and a stop token, with drafts of random accept lengths:
    the same tokens and logprobs as without speculation."""
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=1, init_std=1.0)
    model = build_model(cfg, tensors)
    requests = prompts(seed=4, num=4)
    plain_engine = spec_engine(model, None, num_blocks=256)  # type: ignore[arg-type]
    spec = Speculator(SpeculativeConfig(num_tokens=4, max_batch=16))
    oracle = OracleProposer({}, seed=3)
    spec.proposer = oracle
    fast_engine = spec_engine(model, spec, num_blocks=256)
    for penalty in (1.0, 1.2):
        config = GenerationConfig(
            max_new_tokens=24, temperature=0.0, repetition_penalty=penalty, num_top_logprobs=2
        )
        for prompt in requests:
            events: dict[str, list] = {"plain": [], "spec": []}
            plain_engine.run(prompt, config, NEVER_CANCEL, events["plain"].append)
            oracle.want[tuple(prompt)] = [e.token_id for e in events["plain"]]
            fast_engine.run(prompt, config, NEVER_CANCEL, events["spec"].append)
            assert [e.token_id for e in events["spec"]] == [e.token_id for e in events["plain"]]
            for a, b in zip(events["spec"], events["plain"], strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        # a stop token inside an accepted run ends the sequence there
        first = oracle.want[tuple(requests[-1])]
        stop = first[len(first) // 2]
        stop_config = GenerationConfig(
            max_new_tokens=24, temperature=0.0, repetition_penalty=penalty, stop_token_ids=frozenset({stop})
        )
        a = plain_engine.run(requests[-1], stop_config, NEVER_CANCEL, lambda _: None)
        b = fast_engine.run(requests[-1], stop_config, NEVER_CANCEL, lambda _: None)
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert spec.num_accepted > 0


@pytest.mark.skipif(not row_kernels.reproducible(), reason="run with $TURBOSPARK_FAST_NONDETERMINISTIC")
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_greedy_speculation_on_the_quantized_cpu_path_gives_plain_decodings_tokens(quant: str) -> None:
    """Quantized as the server quantizes (fp16 KV as on an AVX2 CPU, the native kernels where
    they build): a verification's rows run as the decode rows plain decoding feeds one step at a
    time (`runner.verify_rows_as_decodes`), so random accept lengths, drafts corrupted anywhere,
    batching and a verification that starts on the prompt's last token all give the tokens of
    plain decoding exactly, not merely close logits."""
    cfg, tensors, _ = checkpoint(FAMILIES["qwen2"], seed=5, init_std=0.3)
    model = build_model(cfg, tensors, "cpu", torch.float32, quant=quant)
    requests = prompts(seed=12, num=8)
    configs = [GenerationConfig(max_new_tokens=25, temperature=0.0) for _ in requests]

    def engine(speculator: Speculator | None) -> Engine:
        runner = ModelRunner(model, max_context=128, num_blocks=128, block_size=4, kv_dtype=torch.float16)
        config = SchedulerConfig(max_active=8, max_batched_tokens=32, max_prefill_tokens=32)
        return Engine(
            runner, Scheduler(config, runner.block_manager), max_context=128, name="q", speculator=speculator
        )

    want = [
        engine(None).run(p, c, NEVER_CANCEL, lambda _: None).token_ids
        for p, c in zip(requests, configs, strict=True)
    ]
    speculator = Speculator(SpeculativeConfig(num_tokens=6, max_batch=16))
    speculator.proposer = OracleProposer({tuple(p): w for p, w in zip(requests, want, strict=True)}, seed=3)
    assert run_all(engine(speculator), requests, configs) == want
    assert 0 < speculator.num_accepted < speculator.num_proposed


class AlwaysProposer:
    name = "always"

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return [7] * k

    def finished(self, seq: Sequence) -> None:
        pass

    def retain(self, live: object) -> None:
        pass


def test_seeded_sampled_requests_never_speculate_unseeded_and_greedy_ones_do() -> None:
    """A seed must give the same tokens whatever shares the steps; a verification draws its
    random numbers differently from plain decoding, and whether a step speculates depends on the
    batch, so a seeded sampled request is never given drafts."""
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=1, init_std=1.0)
    model = build_model(cfg, tensors)
    requests = repetitive_prompts(seed=4, num=2)
    for config, speculates in (
        (GenerationConfig(max_new_tokens=30, temperature=0.8, seed=11), False),
        (GenerationConfig(max_new_tokens=30, temperature=0.8), True),
        (GenerationConfig(max_new_tokens=30, temperature=0.0, seed=11), True),
    ):
        speculator = Speculator(SpeculativeConfig(method="ngram", num_tokens=4))
        speculator.proposer = AlwaysProposer()  # drafts wherever the engine asks for them
        engine = spec_engine(model, speculator, num_blocks=128, max_active=4, max_batched_tokens=64)
        run_all(engine, requests, [config] * len(requests))
        assert (speculator.num_proposed > 0) is speculates, config


def test_a_row_bound_shares_the_spare_rows_among_decoding_sequences() -> None:
    """`max_rows` (on the CPU, the rows of one native pass): the decoding sequences and their
    drafts never exceed it; unbounded, each sequence gets its k."""

    def drafts(max_rows: int | None, num: int) -> list[int]:
        speculator = Speculator(SpeculativeConfig(num_tokens=5, max_batch=8, max_rows=max_rows))
        speculator.proposer = AlwaysProposer()
        seqs = []
        for i in range(num):
            config = GenerationConfig(max_new_tokens=50)
            seq = Sequence(i, [3, 4, 5, 6], 3, config, 50, NEVER_CANCEL, torch.Generator())
            seq.num_computed_tokens = 3  # one token to feed: decoding
            seqs.append(seq)
        speculator.propose(seqs, max_context=128)
        return [len(s.draft_ids) for s in seqs]

    assert drafts(None, 3) == [5, 5, 5]
    assert drafts(8, 1) == [5]
    assert drafts(8, 2) == [5, 1]
    assert drafts(8, 4) == [4, 0, 0, 0]
    assert drafts(8, 8) == [0] * 8
