"""Splits generated text into reasoning and answer as it streams.

Templates with thinking wrap reasoning in `<think>...</think>`; some open the block in the
generation prompt, so the model starts inside it (`start_in_reasoning`). Text that could be the
start of a tag is held back until it is known not to be one, so no tag fragment ever reaches
the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from turbospark.events import ReasoningDelta, TextDelta


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
        self.seen_answer = False  # reasoning only opens before the answer starts
        self.pending = ""

    def feed(self, text: str) -> list[ReasoningDelta | TextDelta]:
        out: list[ReasoningDelta | TextDelta] = []
        buf = self.pending + text
        self.pending = ""
        while buf:
            if self.in_reasoning:
                at = buf.find(self.close_tag)
                if at >= 0:
                    if at:
                        out.append(ReasoningDelta(buf[:at]))
                    buf = buf[at + len(self.close_tag) :].lstrip("\n")
                    self.in_reasoning = False
                    continue
                hold = _partial_suffix(buf, self.close_tag)
                if len(buf) > hold:
                    out.append(ReasoningDelta(buf[: len(buf) - hold]))
                self.pending = buf[len(buf) - hold :]
                break
            if not self.seen_answer:
                stripped = buf.lstrip()
                if stripped.startswith(self.open_tag):
                    buf = stripped[len(self.open_tag) :].lstrip("\n")
                    self.in_reasoning = True
                    continue
                if self.open_tag.startswith(stripped):
                    self.pending = buf  # could still become "<think>"
                    break
                self.seen_answer = True
            out.append(TextDelta(buf))
            break
        return out

    def finish(self) -> list[ReasoningDelta | TextDelta]:
        rest, self.pending = self.pending, ""
        if not rest:
            return []
        return [ReasoningDelta(rest)] if self.in_reasoning else [TextDelta(rest)]


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
