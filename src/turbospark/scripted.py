"""The scripted backend: replays fixed replies through the real decode loop and sampler.

It exists so tests can prove envelopes, templating and stream framing byte for byte with no
weights. Its tokenizer is a real byte-level BPE (one token per byte, plus ChatML, `<think>` and
`<tool_call>` tokens), so multi-byte characters arrive split across tokens exactly as they do
from a real model. Each call replays the next reply of its script, whatever the prompt: the
logits put the reply's token far ahead of two runner-ups (which logprobs then show), so any
sampling settings reproduce the reply.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from functools import lru_cache

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers

from turbospark.backend import (
    BackendDefaults,
    BackendError,
    CancelFlag,
    CompletionResult,
    GenerationConfig,
    ProgressCallback,
    RequestImage,
)
from turbospark.chat_template import CHATML_TEMPLATE
from turbospark.decode import run_decode_loop
from turbospark.tokenizer import Tokenizer

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
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
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


class _ReplayProducer:
    """Logits that make `script` the only likely continuation, one step per token."""

    def __init__(self, script: list[int], vocab_size: int) -> None:
        self.script = script
        self.vocab_size = vocab_size
        self.position = 0

    def _logits(self) -> torch.Tensor:
        logits = torch.full((self.vocab_size,), -100.0)
        token = self.script[min(self.position, len(self.script) - 1)]
        logits[(token + 1) % self.vocab_size] = -30.0
        logits[(token + 2) % self.vocab_size] = -31.0
        logits[token] = 0.0
        return logits

    def prefill(self, prompt_ids: Sequence[int], cancel: CancelFlag) -> torch.Tensor | None:
        return None if cancel.is_set() else self._logits()

    def step(self, token_id: int) -> torch.Tensor:
        self.position += 1
        return self._logits()


class ScriptedChatModel(BackendDefaults):
    def __init__(
        self,
        replies: Sequence[str] = (DEMO_REPLY,),
        *,
        model_id: str = "scripted",
        max_context: int = 4096,
        tokenizer: Tokenizer | None = None,
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
        self.prompts: list[list[int]] = []  # every prompt seen, for tests to inspect

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
        script = [*self._tokenizer.encode(reply), self._end_id]
        config.stop_token_ids = config.stop_token_ids | {self._end_id}
        producer = _ReplayProducer(script, self.vocab_size)
        return run_decode_loop(producer, prompt_ids, config, self._max_context, cancel, on_progress)
