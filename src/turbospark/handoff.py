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
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_local = threading.local()


def hold() -> None:
    """From now on this thread's `wake` calls wait for its next `release`."""
    if getattr(_local, "held", None) is None:
        _local.held = []


def wake(fn: Callable[[], None]) -> None:
    """Runs `fn` now, or at this thread's next `release` if it holds its wake-ups."""
    held: list[Callable[[], None]] | None = getattr(_local, "held", None)
    if held is None:
        fn()
    else:
        held.append(fn)


def release() -> None:
    """Runs the wake-ups this thread holds, in the order they came."""
    held: list[Callable[[], None]] | None = getattr(_local, "held", None)
    while held:
        held.pop(0)()
