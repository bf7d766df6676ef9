"""`RateControl.pace` on a simulated clock: the cap holds when sleeps overshoot, and a pause
buys no burst beyond the catch-up allowance."""

from __future__ import annotations

import pytest

from turbospark import ratecontrol
from turbospark.ratecontrol import CATCH_UP_TOKENS, RateControl


class Clock:
    """time.monotonic / time.sleep stand-ins: every sleep overshoots by `overshoot` seconds, as
    sleeps do on a busy machine."""

    def __init__(self, overshoot: float) -> None:
        self.now = 1000.0
        self.overshoot = overshoot
        self.sleeps = 0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds + self.overshoot


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock(overshoot=0.002)
    monkeypatch.setattr(ratecontrol.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(ratecontrol.time, "sleep", fake.sleep)
    return fake


@pytest.mark.parametrize("tokens_per_step", [1, 4])
def test_oversleeping_does_not_pull_the_rate_below_the_cap(clock: Clock, tokens_per_step: int) -> None:
    # 100 tokens/s is 10 ms a token; each sleep overshooting by 2 ms would give 83 tokens/s
    # if every late step started the schedule afresh
    rate = RateControl(100.0)
    rate.pace(tokens_per_step)
    start = clock.now
    steps = 500
    for _ in range(steps):
        rate.pace(tokens_per_step)
    elapsed = clock.now - start
    assert steps * tokens_per_step / elapsed >= 99.0
    # and never above the cap by more than the allowance (plus the step in flight)
    assert steps * tokens_per_step <= 100.0 * elapsed + CATCH_UP_TOKENS + tokens_per_step


def test_a_pause_buys_only_the_catch_up_allowance(clock: Clock) -> None:
    clock.overshoot = 0.0
    rate = RateControl(100.0)
    for _ in range(10):
        rate.pace()
    clock.now += 60.0  # idle for a minute: the slots of that minute are not owed
    sleeps = clock.sleeps
    start = clock.now
    for _ in range(CATCH_UP_TOKENS + 1):
        rate.pace()
    assert clock.sleeps == sleeps and clock.now == start  # the allowance, at once
    for _ in range(100):
        rate.pace()
    # then one token per 10 ms again
    assert clock.now - start == pytest.approx(100 * 0.01, abs=1e-9)
