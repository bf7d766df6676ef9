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


def test_a_step_release_lets_wakeups_wait_for_the_next_release() -> None:
    ran: list[str] = []

    def patient() -> None:
        if handoff.stepping() and "kept once" not in ran:
            ran.append("kept once")
            handoff.keep(patient)
            return
        ran.append("woke")

    def engine_like() -> None:
        handoff.hold()
        handoff.wake(patient)
        handoff.release_step()  # puts itself off
        handoff.release(kept=False)  # the check after a forward leaves it kept
        ran.append("after the forward")
        handoff.release_step()  # the next step runs it
        handoff.wake(patient)
        handoff.release()  # outside a step it cannot keep itself: runs now
        ran.append("end")

    thread = threading.Thread(target=engine_like)
    thread.start()
    thread.join()
    assert ran == ["kept once", "after the forward", "woke", "woke", "end"]


def test_a_plain_release_runs_what_was_kept() -> None:
    ran: list[str] = []
    errors: list[BaseException] = []

    def engine_like() -> None:
        handoff.hold()
        handoff.wake(lambda: handoff.keep(lambda: ran.append("kept")) if handoff.stepping() else None)
        handoff.release_step()
        assert ran == []
        handoff.release()  # before an idle wait: nothing may stay behind
        try:
            handoff.keep(lambda: None)  # only a wake-up run by release_step may keep itself
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=engine_like)
    thread.start()
    thread.join()
    assert ran == ["kept"]
    assert len(errors) == 1
