"""Drafts from a smaller model (`--speculative draft:MODEL`): the `Proposer` that runs a second,
smaller model of the same tokenizer greedily, k tokens ahead of each speculating sequence.

The draft model has its own KV cache and runner (`ModelRunner`'s one-sequence reference path:
a few sequences, one at a time, on the engine thread before the step). Per sequence it keeps the
tokens it has fed; at each proposal the fed tokens are cut back to their common prefix with the
sequence's tokens (drafts the target rejected are dropped: their keys are overwritten on the next
feed), the tokens the sequence gained since are fed in one forward (the whole prompt, chunked, on
the first proposal), and k tokens are drafted one forward each. Its cache holds at most
`max_seqs` sequences; a sequence that does not fit gets no drafts. A sequence that leaves the
running set (finished, cancelled, preempted) frees its draft cache at the next proposal
(`retain`).

Verification is the target's, so a draft model changes the speed and never the tokens: greedy
output is plain decoding's and sampled output keeps the target's distribution. On a CPU the
draft costs real time per token (a 0.5B draft for a 1.5B target reads a third of the target's
bytes per drafted token) and its first proposal prefills the whole prompt again:
benchmarks/RESULTS.md has what it gives.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from turbospark.backend import NEVER_CANCEL
from turbospark.engine.runner import ModelRunner, SequenceState
from turbospark.engine.sequence import Sequence as EngineSequence

log = logging.getLogger("turbospark.engine")

FEED_ONE_BY_ONE = 8  # a sequence's new tokens up to this many go in as decode rows


class DraftProposer:
    name = "draft"

    def __init__(self, runner: ModelRunner, max_seqs: int = 4) -> None:
        """`runner`: the draft model's, its KV cache sized for `max_seqs` full contexts."""
        self.runner = runner
        self.max_seqs = max_seqs
        self._states: dict[int, tuple[SequenceState, list[int]]] = {}  # seq id -> (cache, fed ids)

    @torch.inference_mode()
    def propose(self, seq: EngineSequence, k: int) -> list[int]:
        held = self._states.get(seq.seq_id)
        if held is None:
            if len(self._states) >= self.max_seqs:
                return []
            held = self._states[seq.seq_id] = (SequenceState(), [])
        state, fed = held
        ids = seq.token_ids
        common = 0
        for a, b in zip(fed, ids, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # the last token is fed again for its logits
        del fed[common:]
        state.num_cached = common
        try:
            logits = self._feed(state, ids[common:])
            fed.extend(ids[common:])
            drafts: list[int] = []
            while True:
                token = int(torch.argmax(logits))
                drafts.append(token)
                if len(drafts) == k or len(fed) + 1 >= self.runner.max_context:
                    return drafts
                logits = self.runner.forward([(state, [token])])[0]
                fed.append(token)
        except RuntimeError as exc:  # its cache is full: no drafts for this sequence
            log.debug("draft model: no drafts for sequence %d: %s", seq.seq_id, exc)
            self._drop(seq.seq_id)
            return []

    def _feed(self, state: SequenceState, ids: list[int]) -> torch.Tensor:
        """The draft model's logits after `ids`: a prompt in chunks, the few tokens a sequence
        gained since its last proposal (the target's own token, the last accepted draft) one
        forward each, as decode rows: on the CPU a short chunk runs the prompt kernels, which cost
        0.54 s for 3 tokens where a decode row costs 21 ms (0.5B draft, 2-core EPYC)."""
        if len(ids) > FEED_ONE_BY_ONE:
            logits = self.runner.prefill(state, ids, NEVER_CANCEL)
            assert logits is not None
            return logits
        assert ids, "a proposal feeds at least the sequence's last token"
        for token in ids:
            out = self.runner.forward([(state, [token])])[0]
        return out

    def retain(self, live: Iterable[int]) -> None:
        """Frees the draft cache of every sequence not in `live` (the running sequence ids)."""
        keep = set(live)
        for seq_id in [s for s in self._states if s not in keep]:
            self._drop(seq_id)

    def finished(self, seq: EngineSequence) -> None:
        self._drop(seq.seq_id)

    def _drop(self, seq_id: int) -> None:
        held = self._states.pop(seq_id, None)
        if held is not None:
            self.runner.release(held[0])
