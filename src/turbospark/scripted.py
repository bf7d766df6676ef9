"""The scripted backend: replays fixed replies through the real engine, scheduler and sampler.

It exists so tests can prove envelopes, templating and stream framing byte for byte with no
weights. Its "model" is a fake step runner under the same `Engine` the PyTorch backend uses
(FIFO admission, batching, the block manager and prefix cache, the rate cap, cancellation), so
the suite drives the real scheduler. Its tokenizer is a real byte-level BPE (one token per
byte, plus ChatML, `<think>` and `<tool_call>` tokens), so multi-byte characters arrive split
across tokens exactly as they do from a real model. Each call replays the next reply of its
script, whatever the prompt: the logits put the reply's token far ahead of two runner-ups
(which logprobs then show), so any sampling settings reproduce the reply.

The demo's context (128k tokens) holds Claude Code's first request, which renders to ~77k
tokens with the byte tokenizer; its KV cache is bookkeeping only (no tensors), so a large one
costs nothing.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers

from turbospark.backend import (
    BackendError,
    CancelFlag,
    ChatModelDefaults,
    CompletionResult,
    GenerationConfig,
    ProgressCallback,
    RequestImage,
)
from turbospark.chat_template import CHATML_TEMPLATE
from turbospark.engine.engine import Engine, StepOutput
from turbospark.engine.kv_cache import BlockManager
from turbospark.engine.scheduler import Scheduler, SchedulerConfig
from turbospark.ratecontrol import RateControl
from turbospark.tokenizer import Tokenizer

if TYPE_CHECKING:
    from turbospark.engine.scheduler import ScheduledBatch

DEMO_MAX_CONTEXT = 131072
MAX_KEPT_PROMPTS = 256
BLOCK_SIZE = 16

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

DEMO_REPLY = (
    "Hello! This is turbospark's scripted demo model. It replays this reply whatever you send, "
    "so clients and tests can be checked without model weights."
)


def _byte_alphabet() -> list[str]:
    """The printable stand-in character for each byte, as GPT-2's byte-level BPE maps them."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars: dict[int, str] = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@lru_cache(maxsize=1)
def byte_tokenizer() -> Tokenizer:
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    # No word cache: with no merges there is nothing to save, and with no regex split each
    # stretch of text between special tokens is one "word", so the BPE's default cache (10,000
    # words, ~32 bytes per byte of each) would keep ~30 MB of a server's past prompts.
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], cache_capacity=0))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    hf.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    config = {
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>",
        "bos_token": None,
        "eos_token_ids": [hf.token_to_id("<|endoftext|>")],
    }
    return Tokenizer(hf, config)


@dataclass(slots=True)
class Replay:
    """A sequence's `runner_state`: the reply's token ids, and what feeding a prompt token
    costs (seconds; 0 for the demo), so tests can stand in for a long prefill."""

    script: list[int]
    seconds_per_prompt_token: float = 0.0


class ReplayRunner:
    """A fake model under the engine: each sequence's logits make its script's next token the
    only likely one (position = tokens generated so far)."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def execute(self, batch: ScheduledBatch, *, want_ids: bool = False) -> StepOutput:
        cost = 0.0
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            fed_prompt = min(n, max(0, seq.num_prompt_tokens - seq.num_computed_tokens))
            cost += fed_prompt * seq.runner_state.seconds_per_prompt_token
        if cost > 0:
            time.sleep(cost)
        rows = [seq for seq, wants in zip(batch.seqs, batch.samples, strict=True) if wants]
        logits = torch.full((len(rows), self._vocab_size), -100.0)
        for i, seq in enumerate(rows):
            script = seq.runner_state.script
            token = script[min(seq.num_generated, len(script) - 1)]
            logits[i, (token + 1) % self._vocab_size] = -30.0
            logits[i, (token + 2) % self._vocab_size] = -31.0
            logits[i, token] = 0.0
        return StepOutput(logits)


class ScriptedChatModel(ChatModelDefaults):
    def __init__(
        self,
        replies: Sequence[str] = (DEMO_REPLY,),
        *,
        model_id: str = "scripted",
        max_context: int = DEMO_MAX_CONTEXT,
        tokenizer: Tokenizer | None = None,
        scheduler: SchedulerConfig | None = None,
        rate: RateControl | None = None,
    ) -> None:
        if not replies:
            raise ValueError("a scripted backend needs at least one reply")
        self.model_id = model_id
        self._tokenizer = tokenizer or byte_tokenizer()
        self._max_context = max_context
        self.replies = list(replies)
        self._turns = itertools.count()
        self._lock = threading.Lock()
        eos = self._tokenizer.token_to_id("<|im_end|>")
        assert eos is not None
        self._end_id = eos
        # the latest prompts seen, for tests to inspect; bounded, so a long-running demo server
        # does not grow by every prompt it ever served
        self.prompts: list[list[int]] = []
        num_blocks = -(-max_context // BLOCK_SIZE) * 2
        self.engine = Engine(
            ReplayRunner(self._tokenizer.vocab_size),
            Scheduler(scheduler or SchedulerConfig(), BlockManager(num_blocks, BLOCK_SIZE)),
            max_context=max_context,
            rate=rate,
            name=model_id,
        )

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.vocab_size

    @property
    def max_context(self) -> int:
        return self._max_context

    def run_completion(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        images: Sequence[RequestImage] | None,
        cancel: CancelFlag,
        on_progress: ProgressCallback,
    ) -> CompletionResult:
        if images:
            raise BackendError(
                f"model {self.model_id!r} cannot read images: the scripted backend has no vision tower"
            )
        with self._lock:
            reply = self.replies[next(self._turns) % len(self.replies)]
            self.prompts.append(list(prompt_ids))
            del self.prompts[:-MAX_KEPT_PROMPTS]
        script = [*self._tokenizer.encode(reply), self._end_id]
        config.stop_token_ids = config.stop_token_ids | {self._end_id}
        replay = Replay(script, self.seconds_per_prompt_token(len(prompt_ids)))
        return self.engine.run(prompt_ids, config, cancel, on_progress, runner_state=replay)

    def seconds_per_prompt_token(self, num_prompt_tokens: int) -> float:
        """What feeding one prompt token costs; 0: a prefill is instant (tests override)."""
        return 0.0
