"""Runs a plan on its backend off the event loop and streams events back into it.

`stream_choice` is the one async entry every API uses. It takes the backend's FIFO slot, runs
`run_completion` on a worker thread, turns each token into events there (`OutputPipeline`) and
hands them to the event loop as they are made. When the consumer stops listening (the client
disconnected, or the caller closed the generator) the cancel flag is set, and the slot is only
given back once the worker has actually stopped. A `Ping` is yielded whenever nothing arrived for
`ping_interval` seconds, in the queue or during a long prefill, so SSE APIs can keep idle
clients connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from turbospark.backend import BackendError, CompletionResult, TokenEvent
from turbospark.errors import ApiError, ErrorKind
from turbospark.events import Event, Finish, Ping
from turbospark.output import OutputPipeline
from turbospark.plan import Plan

_executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="turbospark-gen")

_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def stream_choice(
    plan: Plan, index: int = 0, ping_interval: float | None = None
) -> AsyncIterator[Event]:
    """Events of one choice; the last one is always `Finish` (unless an error is raised)."""
    backend = plan.backend
    queue = backend.generation_queue()
    if queue is not None:
        # Waiting in line pings too: a client's idle timeout must not fire while it is queued.
        slot = asyncio.ensure_future(queue.acquire())
        try:
            while not slot.done():
                await asyncio.wait({slot}, timeout=ping_interval)
                if not slot.done():
                    yield Ping()
            slot.result()  # a full line raises here
        except BaseException:
            if not slot.done():
                slot.cancel()  # the consumer left while in line: acquire() takes it out of the line
            elif not slot.cancelled() and slot.exception() is None:
                queue.release()  # the slot arrived just as the consumer left
            raise
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[object] = asyncio.Queue()
    cancel = threading.Event()
    pipeline = OutputPipeline(plan)
    config = plan.config_for_choice(index)
    rate = backend.rate_control()
    images = plan.request.images() or None

    def on_progress(token: TokenEvent) -> None:
        if rate is not None:
            rate.pace()
        events = pipeline.feed(token)
        if pipeline.stopped:
            cancel.set()
        if events:
            loop.call_soon_threadsafe(inbox.put_nowait, events)

    def work() -> None:
        try:
            result: CompletionResult = backend.run_completion(
                plan.prompt_ids, config, images, cancel, on_progress
            )
            final = pipeline.finish(result)
            loop.call_soon_threadsafe(inbox.put_nowait, final)
            loop.call_soon_threadsafe(inbox.put_nowait, _DONE)
        except BaseException as exc:  # handed to the event loop, re-raised there
            loop.call_soon_threadsafe(inbox.put_nowait, _Failure(exc))

    future = loop.run_in_executor(_executor, work)
    try:
        while True:
            try:
                item = (
                    await asyncio.wait_for(inbox.get(), ping_interval) if ping_interval else await inbox.get()
                )
            except TimeoutError:
                yield Ping()
                continue
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise _as_api_error(item.exc)
            assert isinstance(item, list)
            for event in item:
                yield event
    finally:
        cancel.set()
        with contextlib.suppress(BaseException):
            await asyncio.shield(future)
        if queue is not None:
            queue.release()


async def run_choice(plan: Plan, index: int = 0) -> list[Event]:
    """All events of one choice, for non-streaming responses."""
    return [ev async for ev in stream_choice(plan, index)]


def _as_api_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, BackendError):
        kind = ErrorKind.INVALID_REQUEST if exc.status < 500 else ErrorKind.INTERNAL
        return ApiError(kind, str(exc), status=exc.status)
    return ApiError(ErrorKind.INTERNAL, f"generation failed: {type(exc).__name__}: {exc}")


def finish_of(events: list[Event]) -> Finish:
    last = events[-1]
    assert isinstance(last, Finish)
    return last
