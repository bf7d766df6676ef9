"""Runs a plan on its backend and streams events back into the event loop.

`stream_choice` is the one async entry every API uses. A backend with `submit_completion` (the
PyTorch engine) queues the generation from the loop and posts each token back into it, through
a per-loop mailbox that wakes the loop once per engine step; the loop turns tokens into events
(`OutputPipeline`). Other backends run `run_completion` on a worker thread per generation, which
makes the events there and hands them to the loop. When the consumer stops listening (the
client disconnected, or the caller closed the generator) the cancel flag is set, and the
generator only returns once the engine has actually dropped the sequence. A full line is an
`OVERLOADED` error (429 / 529 / 503 with Retry-After, by API). A `Ping` is yielded whenever
nothing arrived for `ping_interval` seconds, in the line or during a long prefill, so SSE APIs
can keep idle clients connected.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable

from turbospark import handoff
from turbospark.backend import BackendError, CompletionResult, EngineOverloaded, TokenEvent
from turbospark.errors import ApiError, ErrorKind
from turbospark.events import Event, Ping, ReasoningDelta, TextDelta
from turbospark.output import OutputPipeline
from turbospark.plan import Plan

_DONE = object()
ENGINE_CHECK_SECONDS = 1.0  # how often a quiet direct-path stream checks that the engine runs
# Decode steps shorter than this wake the event loop every other step: each wake-up then
# carries two tokens per stream, sent as one chunk (`_merged`), which halves what the loop and
# the client spend per token on cores the engine's threads fill. No token waits longer than the
# gap and one step, the first token of a reply goes out at once, and slower steps wake the loop
# each time.
WAKE_GAP_SECONDS = 0.010


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def stream_choice(
    plan: Plan, index: int = 0, ping_interval: float | None = None
) -> AsyncIterator[Event]:
    """Events of one choice; the last one is always `Finish` (unless an error is raised)."""
    backend = plan.backend
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[object] = asyncio.Queue()
    cancel = threading.Event()
    pipeline = OutputPipeline(plan)
    config = plan.config_for_choice(index)
    images = plan.request.images() or None
    stopped = loop.create_future()

    def deliver(token: TokenEvent, post: Callable[[list[Event]], None]) -> None:
        events = pipeline.feed(token)
        if pipeline.stopped:
            cancel.set()
        if events:
            post(events)

    def finish(result: CompletionResult, post: Callable[[object], None]) -> None:
        post(pipeline.finish(result))
        post(_DONE)

    try:
        outbox = _LoopOutbox(_mailbox(loop), lambda raw: take(raw))
        submission = backend.submit_completion(plan.prompt_ids, config, images, cancel, outbox)
    except Exception as exc:  # refused before the first token: the line is full, a bad prompt
        raise _as_api_error(exc) from exc

    # On the direct path, the engine's items are turned into events on the loop itself: events
    # made while the list before them still waits in the inbox join that list, and the consumer
    # sends them as one (`_merged`).
    waiting: list[Event] | None = None

    def queue(item: object) -> None:
        nonlocal waiting
        if not isinstance(item, list):
            waiting = None
            inbox.put_nowait(item)
        elif waiting is not None:
            waiting.extend(item)
        else:
            waiting = list(item)  # ours to extend
            inbox.put_nowait(waiting)

    def take(raw: object) -> None:
        """One item from the engine, on the event loop, in the order they were made."""
        assert submission is not None
        try:
            item = submission.take(raw)
            if isinstance(item, TokenEvent):
                deliver(item, queue)
            elif item is not None:
                finish(item, queue)
        except BaseException as exc:
            queue(_Failure(exc))
        if not isinstance(raw, TokenEvent):
            _settle(stopped)  # the engine is done with the sequence

    def work() -> None:
        def post(item: object) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, item)

        try:
            result: CompletionResult = backend.run_completion(
                plan.prompt_ids, config, images, cancel, lambda token: deliver(token, post)
            )
            finish(result, post)
        except BaseException as exc:  # handed to the event loop, re-raised there
            post(_Failure(exc))
        finally:
            loop.call_soon_threadsafe(_settle, stopped)

    if submission is None:
        # One thread per generation, blocked in run_completion while the engine batches it: a
        # pool would cap how many requests can wait in the engine's line.
        threading.Thread(target=work, name="turbospark-gen", daemon=True).start()
    # on the direct path nothing else notices an engine thread that died: it is looked at
    # whenever nothing arrived for a while
    check = ENGINE_CHECK_SECONDS if submission is not None else None
    quiet_since = loop.time()
    try:
        if submission is not None and ping_interval is not None:
            # Admitted to the engine's line (a full line raised above): a streaming reply can
            # start now, headers and opening event, instead of waiting in line for a token.
            yield Ping()
        while True:
            try:
                # tokens queued already are taken without a wait (a wait_for made a task and a
                # timer per token on the event loop, which shares two cores with the engine)
                item = inbox.get_nowait()
            except asyncio.QueueEmpty:
                wait = check
                if ping_interval is not None:
                    due = quiet_since + ping_interval - loop.time()
                    if due <= 0:
                        quiet_since = loop.time()
                        yield Ping()  # in the engine's line or in a long prefill
                        continue
                    wait = due if wait is None else min(wait, due)
                try:
                    async with asyncio.timeout(wait):
                        item = await inbox.get()
                except TimeoutError:
                    if submission is not None and not submission.alive():
                        await asyncio.sleep(0)  # items the engine posted before it ended come first
                        if inbox.empty():
                            _settle(stopped)  # nothing will drop the sequence now
                            raise ApiError(
                                ErrorKind.INTERNAL, "generation failed: the engine stopped"
                            ) from None
                    continue
            quiet_since = loop.time()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise _as_api_error(item.exc)
            assert isinstance(item, list)
            if submission is not None:
                if item is waiting:
                    waiting = None  # taken: what the engine makes next goes in a new list
                item = _merged(item)
            for event in item:
                yield event
    finally:
        cancel.set()  # the consumer left (or finished): the engine drops the sequence
        with contextlib.suppress(BaseException):
            await asyncio.shield(stopped)


def _merged(events: list[Event]) -> list[Event]:
    """`events` with each run of text (or of reasoning) deltas joined into one: tokens that
    waited together go out in one chunk, which costs the loop, the socket and the client one
    write and one parse instead of one per token (the loop runs late behind the engine's
    threads on a machine whose cores they fill)."""
    if len(events) < 2:
        return events
    out: list[Event] = [events[0]]
    for event in events[1:]:
        last = out[-1]
        if type(event) is TextDelta and type(last) is TextDelta:
            if last.logprobs is None and event.logprobs is None:
                out[-1] = TextDelta(last.text + event.text)
            else:
                out[-1] = TextDelta(last.text + event.text, [*(last.logprobs or ()), *(event.logprobs or ())])
        elif type(event) is ReasoningDelta and type(last) is ReasoningDelta:
            out[-1] = ReasoningDelta(last.text + event.text)
        else:
            out.append(event)
    return out


class _Mailbox:
    """Calls from other threads onto one event loop, coalesced: however many arrive before the
    loop runs, they cost one wake-up (`call_soon_threadsafe` writes to the loop's socket each
    time). The engine thread posts every token of every sequence on this loop here, so a step
    wakes the loop once, and no thread per request sits between the engine and the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # weakly: `_mailboxes` keys on the loop, and a value holding its key would keep both
        self._loop = weakref.ref(loop)
        self._calls: collections.deque[tuple[Callable[[object], None], object]] = collections.deque()
        self._armed = False  # a drain is scheduled and has not started
        self._urgent = False  # something other than a token waits: no putting the wake-up off
        self._last_wake = -math.inf  # time.monotonic() of the last one

    def post(self, fn: Callable[[object], None], arg: object) -> None:  # any thread
        self._calls.append((fn, arg))
        if not isinstance(arg, TokenEvent):
            self._urgent = True
        if not self._armed:
            self._armed = True
            # the engine thread holds its wake-ups until it enters its next forward (`handoff`)
            handoff.wake(self._wake)

    def _wake(self) -> None:
        now = time.monotonic()
        if handoff.stepping() and not self._urgent and now - self._last_wake < WAKE_GAP_SECONDS:
            # only tokens, and the loop was woken less than a gap ago: they wait for the next
            # decode step and go out with its tokens, in one chunk
            handoff.keep(self._wake)
            return
        self._urgent = False
        self._last_wake = now
        loop = self._loop()
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # the loop
        # disarmed before taking: a call posted from here on schedules its own drain
        self._armed = False
        while self._calls:
            fn, arg = self._calls.popleft()
            fn(arg)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = _Mailbox(loop)
    return box


class _LoopOutbox:
    """A sequence's outbox (`turbospark.backend.Outbox`) that hands each item to `take` on the
    event loop."""

    __slots__ = ("_mailbox", "_take")

    def __init__(self, mailbox: _Mailbox, take: Callable[[object], None]) -> None:
        self._mailbox = mailbox
        self._take = take

    def put(self, item: object, /) -> None:
        self._mailbox.post(self._take, item)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def run_choice(plan: Plan, index: int = 0) -> list[Event]:
    """All events of one choice, for non-streaming responses."""
    return [ev async for ev in stream_choice(plan, index)]


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineOverloaded):
        return ApiError(ErrorKind.OVERLOADED, str(exc), retry_after=exc.retry_after)
    if isinstance(exc, BackendError):
        kind = ErrorKind.INVALID_REQUEST if exc.status < 500 else ErrorKind.INTERNAL
        return ApiError(kind, str(exc), status=exc.status)
    return ApiError(ErrorKind.INTERNAL, f"generation failed: {type(exc).__name__}: {exc}")
