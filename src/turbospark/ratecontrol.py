"""Process-level decode-rate cap.

One `RateControl` per process paces every decoded token, whatever request it belongs to: a
power or heat budget is a property of the machine, not of a caller. `pace()` is called from the
engine thread once per decoded token and sleeps just long enough to keep the rate under the cap.
"""

from __future__ import annotations

import threading
import time


class RateControl:
    def __init__(self, max_tokens_per_second: float | None = None) -> None:
        if max_tokens_per_second is not None and max_tokens_per_second <= 0:
            raise ValueError("the decode-rate cap must be positive")
        self.max_tokens_per_second = max_tokens_per_second
        self.num_tokens = 0
        self.seconds_slept = 0.0
        self._next_at = 0.0
        self._lock = threading.Lock()

    def pace(self) -> None:
        with self._lock:
            self.num_tokens += 1
            if self.max_tokens_per_second is None:
                return
            now = time.monotonic()
            interval = 1.0 / self.max_tokens_per_second
            wait = self._next_at - now
            self._next_at = max(now, self._next_at) + interval
        if wait > 0:
            time.sleep(wait)
            with self._lock:
                self.seconds_slept += wait
