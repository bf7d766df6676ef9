"""The engine's tokens go straight to the event loop (`submit_completion` + the loop's mailbox):
the same events as the worker-thread path, stop strings and disconnects handled alike, no
thread per request."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import sys
import threading
import time

import pytest
from test_backend import WORDS, backend, word_tokenizer
from tiny_models import FAMILIES, checkpoint

from turbospark import generate, handoff
from turbospark.backend import TokenEvent
from turbospark.engine import native
from turbospark.engine.backend import RealChatModel
from turbospark.engine.cpu_kernels import cpu_kernels
from turbospark.engine.models import build_model
from turbospark.errors import ApiError
from turbospark.events import (
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallArgs,
    ToolCallStart,
)
from turbospark.generate import run_choice, stream_choice
from turbospark.plan import Plan, make_plan
from turbospark.registry import ModelRegistry
from turbospark.request import ChatRequest, SamplingParams

PROMPT = " ".join(WORDS[10:40])


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    registry = ModelRegistry()
    registry.add(backend(max_context=200))
    return registry


native_only = pytest.mark.skipif(
    native.kernels() is None or not cpu_kernels().native_rows,
    reason="the CPU profile does not run the native decode step here",
)


def native_registry() -> ModelRegistry:
    """The tiny llama in int4, which decodes through the native step (`handoff.release_step`)."""
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=0, init_std=1.0)
    model = RealChatModel(
        "tiny-llama", build_model(cfg, tensors, quant="int4"), word_tokenizer(), max_context=200
    )
    assert model.runner.model.whole_step is not None
    own = ModelRegistry()
    own.add(model)
    return own


def plan(registry: ModelRegistry, prompt: str = PROMPT, **fields: object) -> Plan:
    request = ChatRequest(
        model="tiny-llama",
        messages=[],
        prompt=prompt,
        sampling=SamplingParams(temperature=0.0),
        **fields,  # type: ignore[arg-type]
    )
    return make_plan(request, registry)


def comparable(events: list[Event]) -> list[Event]:
    """Events with the finish's timings and prefix-cache hits zeroed (a second run of a prompt
    finds it cached; two runs differ in nothing else), and each run of text deltas joined (the
    direct path sends tokens that waited together as one)."""
    return [
        dataclasses.replace(
            e,
            prefill_seconds=0.0,
            decode_seconds=0.0,
            usage=dataclasses.replace(e.usage, cached_tokens=0),
        )
        if isinstance(e, Finish)
        else e
        for e in generate._merged(events)
    ]


def text_of(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def through_threads(monkeypatch: pytest.MonkeyPatch, p: Plan) -> list[Event]:
    """The same plan on the worker-thread path (what a backend without the direct path gets)."""
    with monkeypatch.context() as m:
        m.setattr(type(p.backend), "submit_completion", lambda *args: None)
        return comparable(asyncio.run(run_choice(p)))


def test_tokens_reach_the_loop_without_a_thread(monkeypatch: pytest.MonkeyPatch, registry) -> None:
    started = threading.Thread.start

    def no_worker(thread: threading.Thread) -> None:
        assert not thread.name.startswith("turbospark-gen"), "a worker thread was started"
        started(thread)

    monkeypatch.setattr(threading.Thread, "start", no_worker)
    p = plan(registry, max_tokens=12)
    events = asyncio.run(run_choice(p))
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.reason == "length"
    assert finish.usage.completion_tokens == 12
    monkeypatch.setattr(threading.Thread, "start", started)
    assert comparable(events) == through_threads(monkeypatch, plan(registry, max_tokens=12))


def test_a_stop_string_ends_both_paths_alike(monkeypatch: pytest.MonkeyPatch, registry) -> None:
    text = text_of(asyncio.run(run_choice(plan(registry, max_tokens=12))))
    stop = text.split()[4]  # a word in the middle of the greedy reply
    direct = asyncio.run(run_choice(plan(registry, max_tokens=12, stop=[stop])))
    assert comparable(direct) == through_threads(monkeypatch, plan(registry, max_tokens=12, stop=[stop]))
    finish = direct[-1]
    assert isinstance(finish, Finish) and finish.reason == "stop"
    assert stop not in text_of(direct) and text.startswith(text_of(direct))
    # the tokens handed on, not those the engine made before it saw the cancel flag
    assert finish.usage.completion_tokens <= 5


def test_a_consumer_that_leaves_frees_the_sequence(registry) -> None:
    engine = registry.resolve("tiny-llama").backend.engine  # type: ignore[attr-defined]

    async def leave_early() -> list[Event]:
        got: list[Event] = []
        stream = stream_choice(plan(registry, max_tokens=150))
        async for event in stream:
            got.append(event)
            if len(got) == 3:
                break
        await stream.aclose()  # returns once the engine dropped the sequence
        return got

    assert len(asyncio.run(leave_early())) == 3
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


def test_a_refused_prompt_is_an_api_error_before_any_event(registry) -> None:
    too_long = " ".join(WORDS[:250])  # past the 200-token context
    with pytest.raises(ApiError) as caught:
        asyncio.run(run_choice(plan(registry, prompt=too_long, max_tokens=4)))
    assert caught.value.status == 400 and "context" in str(caught.value)


def counted_mailbox() -> tuple[generate._Mailbox, list[object]]:
    """A mailbox on the running loop, and a list that grows by one at each of its wake-ups."""
    loop = asyncio.get_running_loop()
    wakeups: list[object] = []
    schedule = loop.call_soon_threadsafe

    def counting(*args):  # type: ignore[no-untyped-def]
        wakeups.append(args[0])
        return schedule(*args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    return generate._Mailbox(loop), wakeups


def test_the_mailbox_keeps_order_and_coalesces_wakeups() -> None:
    async def main() -> tuple[list[object], int]:
        box, wakeups = counted_mailbox()
        got: list[object] = []
        done = asyncio.Event()

        def take(item: object) -> None:
            got.append(item)
            if item == 999:
                done.set()

        def producer() -> None:
            for i in range(1000):
                box.post(take, i)

        thread = threading.Thread(target=producer)
        thread.start()
        await asyncio.wait_for(done.wait(), 10)
        thread.join()
        return got, len(wakeups)

    got, wakeups = asyncio.run(main())
    assert got == list(range(1000))
    assert 1 <= wakeups < 1000  # posts that found a drain pending woke nobody


def test_the_mailbox_puts_a_lone_token_off_to_the_next_step_within_its_gap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tokens posted less than WAKE_GAP_SECONDS after the last wake-up wait for the next step's
    release; anything else (a result) and every plain release wake the loop at once."""
    monkeypatch.setattr(generate, "WAKE_GAP_SECONDS", 3600.0)  # the gap is never over by itself

    async def main() -> tuple[list[object], list[tuple[int, int]]]:
        box, wakeups = counted_mailbox()
        got: list[object] = []
        seen: list[tuple[int, int]] = []  # (wake-ups, items taken) after each scripted step

        def take(item: object) -> None:
            got.append(item)

        def settled(count: int) -> None:  # waits for the loop to take `count` items in all
            deadline = time.monotonic() + 10
            while len(got) < count and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.02)  # and for anything more it should not take
            seen.append((len(wakeups), len(got)))

        def engine_like() -> None:
            handoff.hold()
            box.post(take, TokenEvent(1))
            handoff.release_step()  # the first token: long since the last wake-up
            settled(1)
            box.post(take, TokenEvent(2))
            handoff.release_step()  # within the gap, tokens only: kept
            handoff.release(kept=False)
            settled(1)
            box.post(take, TokenEvent(3))
            box._last_wake -= 2 * generate.WAKE_GAP_SECONDS  # the gap has passed
            handoff.release_step()  # 2 and 3 in one wake-up
            settled(3)
            box.post(take, TokenEvent(4))
            box.post(take, "the result")
            handoff.release_step()  # not only tokens: at once
            settled(5)
            box.post(take, TokenEvent(5))
            handoff.release_step()
            settled(5)
            handoff.release()  # the engine goes idle: the kept token goes out
            settled(6)

        thread = threading.Thread(target=engine_like)
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.001)
        return got, seen

    got, seen = asyncio.run(main())
    assert got == [TokenEvent(1), TokenEvent(2), TokenEvent(3), TokenEvent(4), "the result", TokenEvent(5)]
    assert seen == [(1, 1), (1, 1), (2, 3), (3, 5), (3, 5), (4, 6)]


def test_runs_of_deltas_are_joined_and_nothing_else() -> None:
    lp = [TokenLogprob("a", 1, -0.5)], [TokenLogprob("b", 2, -1.5)]
    call = ToolCallStart(0, "call_1", "f")
    events: list[Event] = [
        TextDelta("a", lp[0]),
        TextDelta("b"),
        TextDelta("c", lp[1]),
        ReasoningDelta("x"),
        ReasoningDelta("y"),
        call,
        ToolCallArgs(0, "{"),
        ToolCallArgs(0, "}"),
        TextDelta("d"),
        TextDelta("e"),
    ]
    assert generate._merged(events) == [
        TextDelta("abc", [*lp[0], *lp[1]]),
        ReasoningDelta("xy"),
        call,
        ToolCallArgs(0, "{"),
        ToolCallArgs(0, "}"),
        TextDelta("de"),
    ]
    assert generate._merged([TextDelta("a")]) == [TextDelta("a")]


@native_only
def test_a_fast_stream_sends_tokens_that_waited_together_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a gap longer than the whole reply, the first token wakes the loop and every later
    one waits for the result: two text events at most, the same text as the thread path."""
    monkeypatch.setattr(generate, "WAKE_GAP_SECONDS", 3600.0)
    own = native_registry()
    events = asyncio.run(run_choice(plan(own, max_tokens=12)))
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert 1 <= len(deltas) <= 2
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.usage.completion_tokens == 12
    assert text_of(events) == text_of(through_threads(monkeypatch, plan(own, max_tokens=12)))


def test_a_finished_loop_leaves_no_mailbox_behind() -> None:
    async def one() -> None:
        generate._mailbox(asyncio.get_running_loop())

    gc.collect()  # loops of earlier tests
    before = len(generate._mailboxes)
    for _ in range(3):
        asyncio.run(one())
    gc.collect()
    assert len(generate._mailboxes) == before


class _EngineKilled(BaseException):
    """Not an `Exception`: the engine's loop does not catch it, and its thread dies."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_fails_the_stream_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    own = ModelRegistry()  # its engine dies here: not the module's
    model = backend(max_context=200)
    own.add(model)
    engine = model.engine

    def killed() -> int:
        raise _EngineKilled

    monkeypatch.setattr(engine, "step", killed)
    monkeypatch.setattr(generate, "ENGINE_CHECK_SECONDS", 0.05)

    async def main() -> None:
        await asyncio.wait_for(run_choice(plan(own, max_tokens=8)), timeout=20)

    with pytest.raises(ApiError) as caught:
        asyncio.run(main())
    assert caught.value.status == 500 and "engine stopped" in str(caught.value)
    assert not engine.alive()


@native_only
def test_tokens_wake_the_loop_as_the_next_forward_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine thread holds a step's wake-up until it enters the next native decode step (or
    goes idle): never while it still runs Python the loop would take the GIL from."""
    own = native_registry()
    woken_from: list[str] = []
    wake = generate._Mailbox._wake

    def recording(self: generate._Mailbox) -> None:
        # _wake <- handoff's release (through release_step) <- the place that released
        frame = sys._getframe(1)
        while frame.f_code.co_filename == handoff.__file__:
            frame = frame.f_back  # type: ignore[assignment]
        woken_from.append(frame.f_code.co_qualname)
        wake(self)

    monkeypatch.setattr(generate._Mailbox, "_wake", recording)
    events = asyncio.run(run_choice(plan(own, max_tokens=12)))
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.usage.completion_tokens == 12
    assert "NativeDecoder.run" in woken_from
    assert set(woken_from) <= {"NativeDecoder.run", "Engine._loop"}
