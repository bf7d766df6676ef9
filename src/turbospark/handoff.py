"""Event-loop wake-ups a thread holds back until it is about to leave the GIL for a long call.

The engine thread posts every step's tokens to the event loop (`generate._Mailbox`), and the
loop, once woken, runs the output pipeline and the SSE rendering in Python. Woken at the end of
a step, the loop wanted the GIL while the engine thread still had Python to run before its next
forward (scheduling, the attention metadata): torch lets the GIL go around every small op, the
loop took it at the first one and kept it for its whole pipeline, and the engine thread waited
it out, 1.4-2.2 times a token (SmolLM2 on 2 cores; perf's sched_switch stacks end in `take_gil`
after a torch op). Held back to the moment the engine enters the native decode step (one call
of ~8 ms that holds no GIL), the loop's work runs while the engine computes: the engine thread's
voluntary switches went from 1.4-2.2 to 0.04 a token.

A thread opts in with `hold()`; from then on `wake(fn)` from that thread queues `fn`, and
`release()` runs what is queued. The holder calls `release()` before each long GIL-free call and
before anything that may block (an idle wait, the decode-rate cap's sleep), so a wake-up is late
by at most the Python between two such points. Other threads' `wake` calls run at once.

Before a short GIL-free call that comes round again soon (one decode step) the holder calls
`release_step()` instead: a wake-up run there may put itself off to the next release with
`keep(fn)` (the event loop's mailbox does, to take two tokens per wake-up where a step is
shorter than its gap). A plain `release()` runs kept wake-ups too, except with `kept=False`
(the engine's check after each forward, which must not undo the put-off of the step it ends).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_local = threading.local()


def hold() -> None:
    """From now on this thread's `wake` calls wait for its next `release`."""
    if getattr(_local, "held", None) is None:
        _local.held = []
        _local.kept = []
        _local.stepping = False


def wake(fn: Callable[[], None]) -> None:
    """Runs `fn` now, or at this thread's next `release` if it holds its wake-ups."""
    held: list[Callable[[], None]] | None = getattr(_local, "held", None)
    if held is None:
        fn()
    else:
        held.append(fn)


def release(*, kept: bool = True) -> None:
    """Runs the wake-ups this thread holds, in the order they came (those put off with `keep`
    first, unless `kept` is False)."""
    held: list[Callable[[], None]] | None = getattr(_local, "held", None)
    if held is None:
        return
    if kept and _local.kept:
        held[:0] = _local.kept
        _local.kept = []
    while held:
        held.pop(0)()


def release_step() -> None:
    """`release()` before one short step: a wake-up run here may `keep` itself for the next."""
    if getattr(_local, "held", None) is None:
        return
    _local.stepping = True
    try:
        release()
    finally:
        _local.stepping = False


def stepping() -> bool:
    """Whether this thread is in `release_step` (a wake-up run now may `keep` itself)."""
    return bool(getattr(_local, "stepping", False))


def keep(fn: Callable[[], None]) -> None:
    """From a wake-up run by `release_step`: run `fn` at this thread's next release instead."""
    if not stepping():
        raise RuntimeError("handoff.keep outside release_step")
    _local.kept.append(fn)
