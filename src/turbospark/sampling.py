"""Next-token selection: pure functions over one sequence's logits.

`sample` applies, in order: logit bias, repetition / presence / frequency penalties, the
sequence's logits processors (grammar masks, thinking budget), then greedy or temperature +
top-k + top-p + min-p sampling. Randomness comes only from the `torch.Generator` passed in, so a
request seeded the same way samples the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from turbospark.backend import GenerationConfig, TokenEvent


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def apply_penalties(
    logits: torch.Tensor, config: GenerationConfig, context_ids: Sequence[int], generated_ids: Sequence[int]
) -> torch.Tensor:
    """Returns logits with bias and penalties applied. `logits` is (vocab,) float32."""
    if config.logit_bias:
        ids = torch.tensor(list(config.logit_bias.keys()), dtype=torch.long)
        vals = torch.tensor(list(config.logit_bias.values()), dtype=logits.dtype)
        logits.index_add_(0, ids, vals)
    if config.repetition_penalty != 1.0 and context_ids:
        ids = torch.tensor(sorted(set(context_ids)), dtype=torch.long)
        picked = logits.index_select(0, ids)
        picked = torch.where(
            picked > 0, picked / config.repetition_penalty, picked * config.repetition_penalty
        )
        logits.index_copy_(0, ids, picked)
    if (config.presence_penalty or config.frequency_penalty) and generated_ids:
        ids_t = torch.tensor(list(generated_ids), dtype=torch.long)
        counts = torch.bincount(ids_t, minlength=logits.shape[0])[: logits.shape[0]].to(logits.dtype)
        logits -= config.frequency_penalty * counts
        logits -= config.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks. Returns scaled logits (vocab,)."""
    logits = logits / max(config.temperature, 1e-5)
    if config.top_k and config.top_k > 0 and config.top_k < logits.shape[0]:
        kth = torch.topk(logits, config.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < config.min_p * probs.max(), float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token once the mass before it already reaches top_p; always keep the first
        drop = (cum - torch.softmax(sorted_logits, dim=-1)) >= config.top_p
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    config: GenerationConfig,
    generator: torch.Generator,
    context_ids: Sequence[int],
    generated_ids: Sequence[int],
) -> TokenEvent:
    """Picks the next token from one sequence's raw logits (vocab,).

    `context_ids` is prompt + generated (for the repetition penalty); `generated_ids` is the
    generated tail alone (for presence / frequency penalties and processors).
    """
    logits = logits.detach().to(torch.float32).clone()
    apply_penalties(logits, config, context_ids, generated_ids)
    for proc in config.processors:
        proc(generated_ids, logits)
    if config.is_greedy:
        token_id = int(torch.argmax(logits))
    else:
        filtered = filter_logits(logits, config)
        probs = torch.softmax(filtered, dim=-1)
        token_id = int(torch.multinomial(probs, 1, generator=generator))
    event = TokenEvent(token_id=token_id)
    if config.num_top_logprobs is not None:
        logprobs = torch.log_softmax(logits, dim=-1)
        event.logprob = float(logprobs[token_id])
        if config.num_top_logprobs > 0:
            top = torch.topk(logprobs, min(config.num_top_logprobs, logprobs.shape[0]))
            event.top_logprobs = [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]
    return event
