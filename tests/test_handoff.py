"""Wake-ups held by the thread that posts them until it releases them (`turbospark.handoff`)."""

from __future__ import annotations

import threading

from turbospark import handoff


def test_a_holding_thread_runs_its_wakeups_at_release_in_order() -> None:
    ran: list[str] = []

    def engine_like() -> None:
        handoff.wake(lambda: ran.append("before hold"))  # not holding yet: at once
        handoff.hold()
        handoff.wake(lambda: ran.append("a"))
        handoff.wake(lambda: ran.append("b"))
        ran.append("still computing")
        handoff.release()
        handoff.release()  # nothing left: runs nothing twice
        handoff.wake(lambda: ran.append("c"))
        ran.append("next step")
        handoff.release()

    thread = threading.Thread(target=engine_like)
    thread.start()
    thread.join()
    assert ran == ["before hold", "still computing", "a", "b", "next step", "c"]


def test_other_threads_are_not_held() -> None:
    ran: list[str] = []
    holding = threading.Event()
    done = threading.Event()

    def holder() -> None:
        handoff.hold()
        handoff.wake(lambda: ran.append("held"))
        holding.set()
        done.wait(10)
        handoff.release()

    thread = threading.Thread(target=holder)
    thread.start()
    holding.wait(10)
    handoff.wake(lambda: ran.append("free"))  # this thread never held: runs now
    assert ran == ["free"]
    done.set()
    thread.join()
    assert ran == ["free", "held"]
