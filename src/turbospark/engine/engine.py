"""The engine: one thread per loaded model that steps every admitted sequence together.

`step()` is schedule -> run the model once for every scheduled sequence -> sample -> hand each
sequence its new token. Requests enter through `submit` (from any thread) and leave through
their sequence's outbox, whose items the submitter passes through a `Delivery`; `run` is the
blocking `run_completion` body both backends share: it submits, then hands each token to the
caller's `on_progress` on the caller's own thread, so detokenizing, stop strings, reasoning and
tool parsing never slow the batch (`generate.stream_choice` does the same on the event loop).

The decode-rate cap paces steps: a step that produced k tokens waits until the process-wide
`RateControl` allows k more. With a step profile on (`enable_profile`, `serve --profile-steps`)
the step's accounting also hands each step's boundaries to a `StepProfile`
(`turbospark.engine.profile`); off, a step only looks at `self.profile` and finds None.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from turbospark import handoff, metrics
from turbospark.backend import (
    CancelFlag,
    CompletionResult,
    FinishReason,
    GenerationConfig,
    Outbox,
    ProgressCallback,
    TokenEvent,
)
from turbospark.engine.profile import BUILT, PACED, POSTED, RAN, SAMPLED, SCHEDULED, STARTED, StepProfile
from turbospark.engine.scheduler import ScheduledBatch, Scheduler
from turbospark.engine.sequence import Sequence, SequenceFailed, SequenceStatus
from turbospark.engine.speculative import Speculator, sample_step
from turbospark.ratecontrol import RateControl
from turbospark.sampling import argmax_only, make_generator, sample_batch

log = logging.getLogger("turbospark.engine")

_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _stop_engines() -> None:
    """Engine threads end before the interpreter does: one torn down inside a torch op aborts
    the process ("terminate called without an active exception")."""
    for engine in list(_engines):
        engine.stop(wait=5.0)


@dataclass(slots=True)
class StepOutput:
    """What a runner's step gives back: `logits` (num_sampling, vocab) float32, one row per
    sequence with `batch.samples[i]` set, in batch order; and, where the runner was asked for
    them (`want_ids`) and found them on the way (a native lm_head writes each row's argmax with
    its logits), every sampling row's argmax, so no sampler runs."""

    logits: torch.Tensor
    token_ids: list[int] | None = None


class StepRunner(Protocol):
    """Runs the model once over a scheduled batch (`ModelRunner`; the scripted `ReplayRunner`;
    `TensorParallelRunner`). `want_ids`: every sampling row takes its argmax, with nothing
    edited or reported beside it, so the runner may return the ids it finds."""

    @property
    def vocab_size(self) -> int: ...

    def execute(self, batch: ScheduledBatch, *, want_ids: bool = False) -> StepOutput: ...


class Delivery:
    """The submitter's side of one sequence (`turbospark.backend.Submission`): every item of its
    outbox goes through `take`, in order, on the submitter's thread. Once the cancel flag is set
    no further token is handed on, and the result holds exactly the tokens that were."""

    def __init__(self, engine: Engine, seq: Sequence) -> None:
        self.engine = engine
        self.seq = seq
        self.delivered: list[int] = []

    def take(self, item: object) -> TokenEvent | CompletionResult | None:
        seq = self.seq
        if isinstance(item, TokenEvent):
            if seq.cancel.is_set():
                return None
            self.delivered.append(item.token_id)
            return item
        if isinstance(item, SequenceFailed):
            raise item.error
        assert isinstance(item, CompletionResult)
        if seq.cancel.is_set():
            item.token_ids = self.delivered
            item.finish_reason = FinishReason.CANCELLED
        seconds = time.monotonic() - seq.arrival_time
        metrics.observe_request(
            self.engine.name,
            seconds,
            prompt_tokens=item.num_prompt_tokens,
            finish_reason=item.finish_reason.value,
            loops_broken=seq.loop_guard.loops,
        )
        log.info(
            "%s: request done in %.1f s (prefill %.1f s, decode %.1f s): %d prompt tokens, %d cached; "
            "%d generated; %s%s",
            self.engine.name,
            seconds,
            item.prefill_seconds,
            item.decode_seconds,
            item.num_prompt_tokens,
            item.num_cached_tokens,
            len(item.token_ids),
            item.finish_reason.value,
            f"; the loop guard broke {seq.loop_guard.loops} loop(s)" if seq.loop_guard.loops else "",
        )
        return item

    def alive(self) -> bool:
        return self.engine.alive()


class Engine:
    def __init__(
        self,
        runner: StepRunner,
        scheduler: Scheduler,
        *,
        max_context: int,
        rate: RateControl | None = None,
        name: str = "model",
        speculator: Speculator | None = None,
    ) -> None:
        """`speculator`: speculative decoding (`turbospark.engine.speculative`); the runner must
        return every verifying position's logits (`ModelRunner` does)."""
        self.runner = runner
        self.speculator = speculator
        self.scheduler = scheduler
        self.max_context = max_context
        self.rate = rate
        self.name = name
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_steps = 0
        self._run_started = 0.0
        self.step_seconds = 0.0  # inside the model forward
        self.overhead_seconds = 0.0  # schedule + sample + bookkeeping
        self.profile: StepProfile | None = None  # `enable_profile`
        self._profile_device: torch.device | None = None  # a CUDA device the profile syncs

    # ---- entry points (any thread) ----
    def submit(
        self,
        prompt_ids: Seq[int],
        config: GenerationConfig,
        cancel: CancelFlag,
        runner_state: Any = None,
        outbox: Outbox | None = None,
    ) -> Sequence:
        """Queues a request; raises `EngineOverloaded` at once when the line is full. Its items
        go to `outbox` (from the engine thread), else to a queue of the sequence's own."""
        seq = Sequence(
            seq_id=next(self._ids),
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            config=config,
            max_new_tokens=config.budget(len(prompt_ids), self.max_context),
            cancel=cancel,
            generator=make_generator(config.seed),
            runner_state=runner_state,
        )
        if outbox is not None:
            seq.outbox = outbox
        with self._lock:
            if seq.max_new_tokens <= 0:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = FinishReason.LENGTH
                seq.outbox.put(seq.result())
                return seq
            self.scheduler.add(seq)
            self._work.notify()
            self._export_gauges()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}", daemon=True)
                self._thread.start()
                _engines.add(self)
                metrics.watch_engine(self)
        return seq

    def run(
        self,
        prompt_ids: Seq[int],
        config: GenerationConfig,
        cancel: CancelFlag,
        on_progress: ProgressCallback,
        runner_state: Any = None,
    ) -> CompletionResult:
        """Submits and waits; `on_progress` sees every token, on this thread, as it is made.

        Once `cancel` is set (by the caller, or by `on_progress` on a stop string) no further
        token is handed over, and the result holds exactly the tokens that were.
        """
        box: queue.SimpleQueue[object] = queue.SimpleQueue()
        seq = self.submit(prompt_ids, config, cancel, runner_state, outbox=box)
        delivery = Delivery(self, seq)
        while True:
            try:
                item = box.get(timeout=0.5)
            except queue.Empty:
                if not self.alive():
                    raise RuntimeError("the engine thread stopped") from None
                continue
            taken = delivery.take(item)
            if isinstance(taken, TokenEvent):
                on_progress(taken)
            elif taken is not None:
                return taken

    def alive(self) -> bool:
        """False once the engine thread has ended: on `stop` (after handing every sequence its
        result) or killed by an error that is not an `Exception`, when sequences in it get no
        further items."""
        thread = self._thread
        return thread is None or thread.is_alive()

    def stop(self, wait: float | None = None) -> None:
        """Ends the engine thread after its current step; sequences still in it are cancelled."""
        with self._lock:
            self._stopping = True
            self._work.notify()
        if wait is not None and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait)

    # ---- the engine thread ----
    def _loop(self) -> None:
        # tokens wake their event loop when this thread next enters a forward, not while it
        # still runs Python the loop would contend for (`turbospark.handoff`)
        handoff.hold()
        try:
            while True:
                with self._lock:
                    if not self.scheduler.has_work():
                        handoff.release()
                        if self.profile is not None:
                            self.profile.waited()
                    while not self.scheduler.has_work() and not self._stopping:
                        self._work.wait()
                    if self._stopping:
                        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                            self.scheduler.finish(seq, FinishReason.CANCELLED)
                        return
                try:
                    self.step()
                except Exception:  # a bug in the step itself: fail what is running, keep serving
                    log.exception("engine step failed")
                    with self._lock:
                        for seq in [*self.scheduler.running]:
                            self.scheduler.fail(seq, RuntimeError("the engine step failed"))
        finally:
            handoff.release()

    def step(self) -> int:
        """One engine step: schedule -> run -> sample -> post -> pace. Returns the tokens handed out."""
        started = time.perf_counter()
        batch = self._schedule()
        if not batch.seqs:
            handoff.release()
            time.sleep(0.001)  # everything left was cancelled, or waits for blocks
            return 0
        sampling, drafts = batch.sampling_seqs(), batch.drafts()
        verifying = any(drafts)
        # an all-greedy step may take its argmax from the runner (found as the lm_head writes it)
        output = self._run(batch, want_ids=bool(sampling) and argmax_only(sampling) and not verifying)
        if output is None:
            return 0
        ran = time.perf_counter()
        results = self._sample(output, sampling, drafts)
        emitted = self._post(batch, sampling, drafts, results)
        self._account(batch, emitted, started, ran)
        return emitted

    def _schedule(self) -> ScheduledBatch:
        """The speculator's drafts, then the scheduler's batch for this step."""
        with self._lock:
            if self.speculator is not None:
                self.speculator.propose(self.scheduler.running, self.max_context)
            batch = self.scheduler.schedule()
            self._export_gauges()
        if self.profile is not None:
            self.profile.marks[SCHEDULED] = time.perf_counter()
        return batch

    def _post(
        self,
        batch: ScheduledBatch,
        sampling: list[Sequence],
        drafts: list[list[int]],
        results: list[list[TokenEvent] | Exception],
    ) -> int:
        """Each sequence's new tokens to its outbox (`Scheduler.post`); returns how many."""
        if self.profile is not None:
            if self._profile_device is not None:
                torch.cuda.synchronize(self._profile_device)
            self.profile.marks[SAMPLED] = time.perf_counter()
        with self._lock:
            emitted = self.scheduler.post(batch, sampling, results, self.name)
            if self.speculator is not None:
                self.speculator.observe(sampling, drafts, results)
            self._export_gauges()
        return emitted

    @staticmethod
    def _sample(
        output: StepOutput, sampling: list[Sequence], drafts: list[list[int]]
    ) -> list[list[TokenEvent] | Exception]:
        """Each sampling sequence's new tokens: one, or a verification's accepted drafts and one
        more (an exception where its sampling failed)."""
        if output.token_ids is not None:
            return [[TokenEvent(token_id=t)] for t in output.token_ids]
        if any(drafts):
            return sample_step(output.logits, sampling, drafts)
        return [[e] if isinstance(e, TokenEvent) else e for e in sample_batch(output.logits, sampling)]

    def _account(self, batch: ScheduledBatch, emitted: int, started: float, ran: float) -> None:
        """The step's counters (metrics, and the forward's share of the step's time), then the
        decode-rate cap's wait; with a profile on, the step's parts go to it."""
        metrics.count_step(self.name, batch.num_tokens, emitted)
        self.num_steps += 1
        posted = time.perf_counter()
        self.step_seconds += ran - self._run_started
        self.overhead_seconds += (posted - started) - (ran - self._run_started)
        self._pace(emitted)
        profile = self.profile
        if profile is not None:
            marks = profile.marks
            marks[STARTED], marks[RAN], marks[POSTED] = started, ran, posted
            marks[PACED] = time.perf_counter()
            profile.record(batch, emitted)

    def _run(self, batch: ScheduledBatch, *, want_ids: bool) -> StepOutput | None:
        """The forward; a failure fails the step's sequences (others go on) and gives None. The
        runner releases the held wake-ups as it enters its long call; whatever path it took,
        none stay held past it."""
        self._run_started = time.perf_counter()
        try:
            if self.profile is not None:
                return self._run_profiled(batch, want_ids=want_ids)
            return self.runner.execute(batch, want_ids=want_ids)
        except Exception as exc:
            log.exception("model step failed")
            with self._lock:
                for seq in batch.seqs:
                    if seq.status is SequenceStatus.RUNNING:
                        self.scheduler.fail(seq, exc)
            return None
        finally:
            handoff.release(kept=False)

    def _run_profiled(self, batch: ScheduledBatch, *, want_ids: bool) -> StepOutput:
        """The forward as a profiled step runs it: a runner that builds its inputs apart from its
        forward (`ModelRunner.step_inputs`, `run_step`) has them timed apart; on CUDA the device
        is synchronized after the forward, so its time is the device's, not its launches'."""
        assert self.profile is not None
        build = getattr(self.runner, "step_inputs", None)
        run_step = getattr(self.runner, "run_step", None)
        if build is not None and run_step is not None:
            inputs = build(batch)
            self.profile.marks[BUILT] = time.perf_counter()
            output: StepOutput = run_step(inputs, want_ids=want_ids)
        else:
            self.profile.marks[BUILT] = time.perf_counter()
            output = self.runner.execute(batch, want_ids=want_ids)
        if output.logits.is_cuda:
            self._profile_device = output.logits.device
            torch.cuda.synchronize(self._profile_device)
        return output

    def enable_profile(self, every: int) -> StepProfile:
        """Profiles the steps from now on (`turbospark.engine.profile`): every `every` steps the
        split of a step's time is logged. Off (None) by default: the steps then pay nothing."""
        self.profile = StepProfile(every, self.name)
        return self.profile

    def _pace(self, emitted: int) -> None:
        """The process-wide decode-rate cap: waits until `emitted` more tokens are allowed."""
        if self.rate is not None and emitted:
            if self.rate.cap() is not None:
                handoff.release()  # the cap may sleep: these tokens go out first
            self.rate.pace(emitted)

    def _export_gauges(self) -> None:
        s = self.scheduler
        metrics.set_engine_state(
            self.name,
            running=s.num_running,
            waiting=s.num_waiting,
            blocks_used=s.blocks.num_used_blocks,
            blocks_total=s.blocks.num_blocks,
            prefix_hit_tokens=s.num_prefix_hit_tokens,
            preemptions=s.num_preemptions,
        )
