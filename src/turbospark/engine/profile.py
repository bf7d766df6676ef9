"""`StepProfile`: where an engine step's milliseconds go (`serve --profile-steps N`).

With a profile on (`Engine.enable_profile`), each step stamps its boundaries into `marks`:
started, scheduled (the speculator's proposals and `Scheduler.schedule`), inputs built (the
batch's sampling rows and drafts, and the runner's `StepInputs` where the runner builds them
apart from its forward), forward done, sampled, posted (`Scheduler.post`, the speculator's
bookkeeping, the step's counters) and paced (the decode-rate cap's wait). `idle` is the gap
between the previous step's end and this step's start (the loop, its lock, a step that found
nothing to run); a wait for new work is not idle time, and the step after one counts none.

Every `every` steps the window's averages are logged, one entry per step kind (`step_kind`:
decode, mixed, prefill, verify) and one over all of them (`all`), and added to the totals that
`summary` reports. The parts of a step are consecutive intervals, so they sum to its total.
The runner's strategy (graph replay, native step, layer by layer) is not in the split: the
runner does not report it.
"""

from __future__ import annotations

import logging
from typing import Any

from turbospark.engine.scheduler import ScheduledBatch

log = logging.getLogger("turbospark.engine.profile")

PARTS = ("schedule", "inputs", "forward", "sample", "post", "pace", "idle")
KINDS = ("decode", "mixed", "prefill", "verify")
# indices into `StepProfile.marks`, in the order a step passes them
STARTED, SCHEDULED, BUILT, RAN, SAMPLED, POSTED, PACED = range(7)
# one row of sums: steps, total seconds, each part's seconds, tokens fed, tokens generated
_STEPS, _TOTAL, _FIRST_PART = 0, 1, 2
_FED, _GENERATED = _FIRST_PART + len(PARTS), _FIRST_PART + len(PARTS) + 1


def step_kind(batch: ScheduledBatch) -> str:
    """decode: every sequence feeds its one last token; prefill: none does (prompt chunks
    only); mixed: both; verify: some sequence verifies speculative drafts."""
    if any(batch.num_draft):
        return "verify"
    decodes = sum(1 for n, samples in zip(batch.num_new, batch.samples, strict=True) if n == 1 and samples)
    if decodes == len(batch.num_new):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


class StepProfile:
    """Sums of the steps' parts, by kind, over a window of `every` steps (then logged) and over
    the whole run. Used on the engine thread; `reset` and `summary` while the engine is idle."""

    def __init__(self, every: int, name: str = "model") -> None:
        if every < 1:
            raise ValueError(f"a step profile needs a window of at least 1 step, not {every}")
        self.every = every
        self.name = name
        self.marks = [0.0] * (PACED + 1)
        self._last_end: float | None = None
        self._window: dict[str, list[float]] = {}
        self._totals: dict[str, list[float]] = {}
        self._num_in_window = 0
        self.last_window: dict[str, dict[str, Any]] = {}  # the last logged window's report

    def waited(self) -> None:
        """The engine waits for work: the next step's gap is not idle time."""
        self._last_end = None

    def reset(self) -> None:
        """Forgets every step so far (a benchmark's warm-up)."""
        self._window, self._totals, self._num_in_window = {}, {}, 0
        self.last_window = {}
        self._last_end = None

    def record(self, batch: ScheduledBatch, generated: int) -> None:
        """Adds the step whose boundaries are in `marks`."""
        m = self.marks
        idle = 0.0 if self._last_end is None else max(0.0, m[STARTED] - self._last_end)
        self._last_end = m[PACED]
        kind = step_kind(batch)
        row = self._window.get(kind)
        if row is None:
            row = self._window[kind] = [0.0] * (_GENERATED + 1)
        row[_STEPS] += 1
        row[_TOTAL] += m[PACED] - m[STARTED] + idle
        for i in range(PACED):  # schedule .. pace: from each mark to the next
            row[_FIRST_PART + i] += m[i + 1] - m[i]
        row[_FIRST_PART + PARTS.index("idle")] += idle
        row[_FED] += batch.num_tokens
        row[_GENERATED] += generated
        self._num_in_window += 1
        if self._num_in_window >= self.every:
            self._flush()

    def _flush(self) -> None:
        self.last_window = report(self._window)
        log.info("%s", format_line(self.name, self.last_window))
        for kind, row in self._window.items():
            into = self._totals.setdefault(kind, [0.0] * len(row))
            for i, value in enumerate(row):
                into[i] += value
        self._window, self._num_in_window = {}, 0

    def summary(self) -> dict[str, dict[str, Any]]:
        """Every step since the start (or `reset`), the open window included: see `report`."""
        merged = {kind: list(row) for kind, row in self._totals.items()}
        for kind, row in self._window.items():
            into = merged.setdefault(kind, [0.0] * len(row))
            for i, value in enumerate(row):
                into[i] += value
        return report(merged)


def report(sums: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Per kind (and `all`): steps, mean total ms a step, each part's mean ms (`ms`) and share
    of the total (`share`), mean tokens fed and generated a step."""
    rows = dict(sums)
    if rows:
        rows["all"] = [sum(r[i] for r in sums.values()) for i in range(_GENERATED + 1)]
    out: dict[str, dict[str, Any]] = {}
    for kind in [*KINDS, "all"]:
        row = rows.get(kind)
        if row is None or not row[_STEPS]:
            continue
        steps, total = row[_STEPS], row[_TOTAL]
        ms = {part: 1000.0 * row[_FIRST_PART + i] / steps for i, part in enumerate(PARTS)}
        out[kind] = {
            "steps": int(steps),
            "total_ms": 1000.0 * total / steps,
            "ms": ms,
            "share": {part: (row[_FIRST_PART + i] / total if total else 0.0) for i, part in enumerate(PARTS)},
            "fed_tokens": row[_FED] / steps,
            "generated_tokens": row[_GENERATED] / steps,
        }
    return out


def format_line(name: str, rep: dict[str, dict[str, Any]]) -> str:
    """One log line: each kind's mean ms a step and its parts."""
    parts = []
    for kind, r in rep.items():
        split = ", ".join(f"{p} {r['ms'][p]:.2f}" for p in PARTS)
        parts.append(
            f"{kind} x{r['steps']}: {r['total_ms']:.2f} ms ({split}; "
            f"{r['fed_tokens']:.1f} fed / {r['generated_tokens']:.1f} generated tokens)"
        )
    steps = rep["all"]["steps"] if "all" in rep else 0
    return f"{name}: step profile over {steps} steps, ms a step: " + " | ".join(parts)


def format_table(rep: dict[str, dict[str, Any]]) -> str:
    """The report as a table: a row per kind, a column per part (mean ms a step)."""
    head = f"{'kind':<9}{'steps':>7}{'total':>9}" + "".join(f"{p:>9}" for p in PARTS)
    lines = [head + f"{'fed':>8}{'gen':>8}"]
    for kind, r in rep.items():
        cells = "".join(f"{r['ms'][p]:>9.3f}" for p in PARTS)
        lines.append(
            f"{kind:<9}{r['steps']:>7}{r['total_ms']:>9.3f}{cells}"
            f"{r['fed_tokens']:>8.1f}{r['generated_tokens']:>8.1f}"
        )
    return "\n".join(lines)
