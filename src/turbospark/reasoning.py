"""Splits generated text into reasoning and answer as it streams, and bounds the reasoning.

Templates with thinking wrap reasoning in `<think>...</think>`; some open the block in the
generation prompt, so the model starts inside it (`start_in_reasoning`). The contract is that
reasoning never reaches the answer: a think block anywhere in the output (not only at its
start) is reasoning, an unclosed one runs to the end of the output as reasoning, and a stray
`</think>` is dropped. Text that could be the start of a tag is held back until it is known not
to be one, so no tag fragment reaches either channel. The result does not depend on how the
text was split into pieces: streaming and non-streaming give the same two channels.

Whitespace: newlines right after `<think>` and whitespace right after `</think>` are dropped
(templates put them there), and so is whitespace before a `<think>` that opens the output.

`ThinkingBudget` is the logits processor that enforces a reasoning budget in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from turbospark.events import ReasoningDelta, TextDelta

Piece = ReasoningDelta | TextDelta


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ReasoningSplitter:
    def __init__(
        self, start_in_reasoning: bool = False, open_tag: str = "<think>", close_tag: str = "</think>"
    ):
        self.in_reasoning = start_in_reasoning
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.pending = ""  # a possible tag prefix (and, in reasoning, whitespace before it)
        self.lead_ws = ""  # whitespace that opened the output: dropped if a think block follows
        self.at_start = not start_in_reasoning  # no answer text has come out yet
        self.strip_answer = False  # drop whitespace until the answer's first visible character
        self.strip_reasoning = start_in_reasoning  # drop newlines that open a think block

    @property
    def tags(self) -> tuple[str, str]:
        return self.open_tag, self.close_tag

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        buf = self.pending + text
        self.pending = ""
        while buf:
            if self.in_reasoning:
                at = buf.find(self.close_tag)
                if at >= 0:
                    self._reasoning(out, buf[:at].rstrip())
                    buf = buf[at + len(self.close_tag) :]
                    self.in_reasoning, self.strip_answer = False, True
                    continue
                hold = _partial_suffix(buf, self.close_tag)
                body = buf[: len(buf) - hold]
                kept = body.rstrip()  # trailing whitespace may turn out to precede </think>
                self._reasoning(out, kept)
                self.pending = body[len(kept) :] + buf[len(buf) - hold :]
                break
            opened, closed = buf.find(self.open_tag), buf.find(self.close_tag)
            if opened >= 0 and (closed < 0 or opened < closed):
                self._answer(out, buf[:opened], before_think=True)
                buf = buf[opened + len(self.open_tag) :]
                self.in_reasoning, self.strip_reasoning = True, True
                continue
            if closed >= 0:  # a stray close tag: never part of the answer
                self._answer(out, buf[:closed])
                buf = buf[closed + len(self.close_tag) :]
                self.strip_answer = True
                continue
            hold = max(_partial_suffix(buf, self.open_tag), _partial_suffix(buf, self.close_tag))
            self._answer(out, buf[: len(buf) - hold])
            self.pending = buf[len(buf) - hold :]
            break
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        rest, self.pending = self.pending, ""
        if self.in_reasoning:
            self._reasoning(out, rest.rstrip())
        else:
            self._answer(out, rest)
            if self.lead_ws:
                out.append(TextDelta(self.lead_ws))
                self.lead_ws = ""
        return out

    def _reasoning(self, out: list[Piece], text: str) -> None:
        if self.strip_reasoning:
            text = text.lstrip("\n")
            if not text:
                return
            self.strip_reasoning = False
        if text:
            out.append(ReasoningDelta(text))

    def _answer(self, out: list[Piece], text: str, before_think: bool = False) -> None:
        if self.strip_answer:
            text = text.lstrip()
            if not text:
                return
            self.strip_answer = False
        if self.at_start:
            if not text.strip():
                # Only whitespace so far: it opens the answer unless a think block follows.
                self.lead_ws = "" if before_think else self.lead_ws + text
                return
            text, self.lead_ws = self.lead_ws + text, ""
            self.at_start = False
        if text:
            out.append(TextDelta(text))


class ThinkingBudget:
    """A logits processor that closes the think block once `budget` reasoning tokens are spent.

    It forces the `</think>` token, so the answer starts right after; the model then continues
    normally. Needs `<think>` / `</think>` to be single tokens (they are in every thinking
    template this server knows).
    """

    def __init__(self, budget: int, open_id: int, close_id: int, start_in_reasoning: bool) -> None:
        self.budget = budget
        self.open_id = open_id
        self.close_id = close_id
        self.in_reasoning = start_in_reasoning
        self.closed = False
        self.num_reasoning = 0
        self.num_seen = 0
        self.start_in_reasoning = start_in_reasoning

    def fork(self) -> ThinkingBudget:
        """A fresh copy for another sequence (processors hold one sequence's state)."""
        return ThinkingBudget(self.budget, self.open_id, self.close_id, self.start_in_reasoning)

    def __call__(self, generated_ids: Sequence[int], logits: torch.Tensor) -> None:
        for token_id in generated_ids[self.num_seen :]:
            if token_id == self.open_id and not self.closed:
                self.in_reasoning = True
            elif token_id == self.close_id:
                self.in_reasoning, self.closed = False, True
            elif self.in_reasoning:
                self.num_reasoning += 1
        self.num_seen = len(generated_ids)
        if self.in_reasoning and self.num_reasoning >= self.budget:
            keep = logits[self.close_id].clone()
            logits.fill_(float("-inf"))
            logits[self.close_id] = keep if torch.isfinite(keep) else 0.0
