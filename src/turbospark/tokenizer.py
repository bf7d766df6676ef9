"""Tokenizer wrapper, incremental detokenizing and stop strings.

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` plus its tokenizer_config (chat
template, bos/eos). `IncrementalDecoder` turns a growing list of ids into text deltas without
ever emitting half a UTF-8 character. `StopMatcher` finds stop strings in that text even when
they span token boundaries, holding back only the tail that could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers


def _token_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):  # {"content": "<|im_end|>", ...} in older configs
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


class Tokenizer:
    def __init__(self, hf: tokenizers.Tokenizer, config: Mapping[str, Any] | None = None) -> None:
        self.hf = hf
        self.config: dict[str, Any] = dict(config or {})
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = self._pick_template(self.config.get("chat_template"))
        self.bos_token: str | None = _token_text(self.config.get("bos_token"))
        self.eos_token: str | None = _token_text(self.config.get("eos_token"))
        self.bos_token_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids = {int(i) for i in self.config.get("eos_token_ids", [])}
        if self.eos_token is not None and (eos_id := self.token_to_id(self.eos_token)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.add_bos_token: bool = bool(self.config.get("add_bos_token", False))
        self.special_ids: frozenset[int] = frozenset(
            tid for tid, tok in hf.get_added_tokens_decoder().items() if tok.special
        )

    @staticmethod
    def _pick_template(value: Any) -> str | None:
        if isinstance(value, str):
            return value
        if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            by_name = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
            chosen = by_name.get("default") or next(iter(by_name.values()), None)
            return chosen if isinstance(chosen, str) else None
        return None

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self.hf.encode(text, add_special_tokens=False).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_bytes_text(self, token_id: int) -> str:
        """One token's own text (for logprobs), special tokens included."""
        return self.decode([token_id], skip_special_tokens=False)


class IncrementalDecoder:
    """Turns token ids into text deltas, holding back bytes of an unfinished UTF-8 character.

    Decodes a short window (from `prefix_offset`) rather than the whole sequence, so each token
    costs O(1) however long the output is; the window restarts whenever text is emitted.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if full.endswith("\ufffd"):
            return ""  # an unfinished character: wait for its remaining bytes
        delta = full[len(prefix) :] if full.startswith(prefix) else full
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta

    def flush(self) -> str:
        """Whatever is held back at the end of generation (a truncated character as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        self.read_offset = len(self.ids)
        return full[len(prefix) :] if full.startswith(prefix) else full


class StopMatcher:
    """Finds the earliest stop string in streamed text.

    `push` returns (text safe to emit now, matched stop string or None). Text that could be the
    start of a stop string is held until it either completes the stop string or cannot.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        if self.matched is not None:
            return "", self.matched
        buf = self.pending + text
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = buf.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            self.matched = best[1]
            self.pending = ""
            return buf[: best[0]], best[1]
        hold = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:size]):
                    hold = max(hold, size)
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
