"""Tensor-parallel execution: the server's process is rank 0 and drives N-1 worker processes.

Rank 0 holds everything a single-process server holds (HTTP, plans, the engine thread, the
scheduler and block manager, sampling) plus its own shard of the model and of the KV cache.
Each engine step, `TensorParallelRunner.execute` broadcasts the step's `StepInputs` (packed ids,
block tables, cached and new token counts, the rows that sample) over a gloo control group (one
broadcast for a step of a few sequences);
every rank rebuilds the same `AttentionMetadata` from them and runs the same
`ModelRunner.run_step` on its shard, meeting the others in the model's collectives (two
all-reduces per layer, the vocab-parallel embedding and lm_head: `tensor_parallel.py`). Block
ids come from rank 0's block manager and are valid on every rank: each rank's cache has the same
blocks, holding its own kv heads. Only rank 0 samples.

Processes: workers are started with torch.multiprocessing's spawn by `TensorParallelGroup.launch`
(from `load_backend`), meet rank 0 at a TCPStore on 127.0.0.1 (a port the OS picks), take rank
0's kernel settings (`WorkerJob.kernel_settings`: its command line's choices reach them too) and
load their own shard of the checkpoint. The model's collectives run on NCCL on CUDA (one GPU a rank,
NVLink multicast off) and gloo on CPU: the backend follows the device, the code is the same.
A worker leaves when rank 0 sends the stop message (`close`, also run at exit), when the control
connection breaks, or when its parent process is gone (a watchdog thread), so no worker outlives
the server; it ignores SIGINT and SIGTERM, which a terminal or a service manager sends to the
whole process group, so that the server can drain its running replies first.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from turbospark.engine.engine import StepOutput
from turbospark.engine.kernel_settings import KernelSettings, use_settings
from turbospark.engine.memory import fix_mmap_threshold, release_freed_memory, weight_stats
from turbospark.engine.runner import ModelRunner, StepInputs
from turbospark.engine.tensor_parallel import Shard

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from turbospark.engine.scheduler import ScheduledBatch

log = logging.getLogger("turbospark.engine")

# NVLink multicast (NVLS) stays off: on shared multi-GPU hosts a program using it can take the
# GPUs out of service. Set in rank 0 before NCCL starts; spawned workers inherit it.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# An idle server sends no step for as long as it likes: workers wait on the control group.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
STARTUP_TIMEOUT_S = 600.0  # spawn + import + load, per worker, before rank 0 gives up
_OP_STOP, _OP_STEP = 0, 1


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: the CPU for every rank, or the r-th GPU counted from `device`'s index."""
    base = torch.device(device)
    if base.type == "cpu":
        return base
    return torch.device(base.type, (base.index or 0) + rank)


def check_devices(device: str, world_size: int) -> None:
    """Raises ValueError when this machine cannot host `world_size` ranks on `device`."""
    if world_size < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, not {world_size}")
    if not dist.is_available():
        raise ValueError("tensor parallelism needs torch.distributed, which this torch build lacks")
    base = torch.device(device)
    if base.type == "cpu":
        if not dist.is_gloo_available():
            raise ValueError("tensor parallelism on CPU needs torch.distributed's gloo backend")
        return
    if base.type != "cuda":
        raise ValueError(f"tensor parallelism runs on cpu or cuda, not {base.type}")
    first = base.index or 0
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if first + world_size > count:
        raise ValueError(
            f"--tensor-parallel {world_size} on {device} needs GPUs {first}..{first + world_size - 1}; "
            f"this machine has {count}"
        )
    if not dist.is_nccl_available():
        raise ValueError("tensor parallelism on CUDA needs torch.distributed's NCCL backend")


def _backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# ---- the per-step message ----
def encode_step(step: StepInputs) -> list[int]:
    """[num_seqs, num_rows, num_new..., num_cached..., table lengths..., tables..., rows..., ids...]"""
    out = [len(step.num_new), len(step.sample_rows), *step.num_new, *step.num_cached]
    out.extend(len(t) for t in step.block_tables)
    for table in step.block_tables:
        out.extend(table)
    out.extend(step.sample_rows)
    out.extend(step.input_ids)
    return out


def decode_step(data: list[int]) -> StepInputs:
    num_seqs, num_rows = data[0], data[1]
    at = 2
    num_new = data[at : at + num_seqs]
    at += num_seqs
    num_cached = data[at : at + num_seqs]
    at += num_seqs
    lengths = data[at : at + num_seqs]
    at += num_seqs
    tables = []
    for n in lengths:
        tables.append(data[at : at + n])
        at += n
    rows = data[at : at + num_rows]
    at += num_rows
    return StepInputs(
        input_ids=data[at:], block_tables=tables, num_cached=num_cached, num_new=num_new, sample_rows=rows
    )


class StepChannel:
    """Rank 0 -> workers, over a gloo group on CPU tensors: one broadcast of a fixed-size
    message (op, length, then the step's first ints), and a second one for the rest only when a
    step does not fit (a large batch's block tables); a decode step of a few sequences fits."""

    FIRST = 1024  # ints in the fixed-size message

    def __init__(self, group: Any) -> None:
        self.group = group

    def send(self, step: StepInputs | None) -> None:
        payload = [] if step is None else encode_step(step)
        first = torch.zeros(self.FIRST, dtype=torch.long)
        head = [_OP_STOP if step is None else _OP_STEP, len(payload), *payload[: self.FIRST - 2]]
        first[: len(head)] = torch.tensor(head, dtype=torch.long)
        dist.broadcast(first, 0, group=self.group)
        if len(payload) > self.FIRST - 2:
            dist.broadcast(torch.tensor(payload[self.FIRST - 2 :], dtype=torch.long), 0, group=self.group)

    def recv(self) -> StepInputs | None:
        first = torch.empty(self.FIRST, dtype=torch.long)
        dist.broadcast(first, 0, group=self.group)
        op, length = first[:2].tolist()
        if op == _OP_STOP:
            return None
        payload = first[2 : 2 + length].tolist()
        if length > self.FIRST - 2:
            rest = torch.empty(length - (self.FIRST - 2), dtype=torch.long)
            dist.broadcast(rest, 0, group=self.group)
            payload += rest.tolist()
        return decode_step(payload)


# ---- what a worker is told to build ----
@dataclass(frozen=True, slots=True)
class CheckpointSource:
    """Loads (HF config, HF-named tensors) the way rank 0 did: picklable, run in each worker."""

    spec: str
    load_kwargs: Mapping[str, Any]

    def __call__(self) -> tuple[dict[str, Any], Mapping[str, torch.Tensor]]:
        from turbospark.engine.loader import load_checkpoint

        ckpt = load_checkpoint(self.spec, **dict(self.load_kwargs))
        return ckpt.config, dict(ckpt.tensors)


@dataclass(frozen=True, slots=True)
class WorkerJob:
    """Everything a worker needs to build the same runner as rank 0 over its own shard."""

    source: Callable[[], tuple[dict[str, Any], Mapping[str, torch.Tensor]]]
    device: str  # rank 0's device; rank r runs on `rank_device(device, r)`
    dtype: torch.dtype
    quant: str | None
    max_positions: int
    max_context: int
    num_blocks: int
    block_size: int
    threads: int
    kv_dtype: torch.dtype | None = None  # None: the model's
    # rank 0's kernel switches, given on its command line or in its environment (None: the
    # worker's own environment decides)
    kernel_settings: KernelSettings | None = None


class TensorParallelGroup:
    """Rank 0's handle on the group: the workers, the control channel, start-up and shutdown."""

    def __init__(self, world_size: int, job: WorkerJob, store: Any, processes: Sequence[BaseProcess]) -> None:
        self.world_size = world_size
        self.job = job
        self.shard = Shard(0, world_size)
        self.device = rank_device(job.device, 0)
        self._store = store
        self._processes = processes
        self._channel: StepChannel | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.failure: str | None = None  # why the group stopped serving, once it has
        self.worker_stats: list[dict[str, int]] = []  # each worker's weights: parameters, bytes
        self._threads_before = torch.get_num_threads()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._processes if p.pid is not None]

    @classmethod
    def launch(cls, world_size: int, job: WorkerJob) -> TensorParallelGroup:
        """Starts ranks 1..N-1 and joins them in a process group; returns once all have joined
        (they then load their shards while rank 0 loads its own: see `wait_ready`)."""
        if dist.is_initialized():
            raise ValueError(
                "one tensor-parallel model per server process: another one already holds this "
                "process's torch.distributed group"
            )
        device = rank_device(job.device, 0)
        if device.type == "cuda":
            os.environ.update(NCCL_ENV)
            torch.cuda.set_device(device)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
        )
        context = torch.multiprocessing.get_context("spawn")
        processes = [
            context.Process(
                target=_worker_main,
                args=(rank, world_size, store.port, job),
                name=f"turbospark-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, world_size)
        ]
        group = cls(world_size, job, store, processes)
        atexit.register(group.close)
        torch.set_num_threads(job.threads)
        try:
            for p in processes:
                p.start()
            group._wait_for("joined")
            kwargs: dict[str, Any] = {}
            if device.type == "cuda":
                kwargs["device_id"] = device  # NCCL communicators made now, not inside a graph capture
            dist.init_process_group(
                _backend_for(device),
                store=store,
                rank=0,
                world_size=world_size,
                timeout=COLLECTIVE_TIMEOUT,
                **kwargs,
            )
            group._channel = StepChannel(dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))
        except BaseException:
            group.close()
            raise
        log.info("tensor parallel: %d ranks on %s (%s)", world_size, job.device, _backend_for(device))
        return group

    def _wait_for(self, what: str) -> list[str]:
        """Waits until every worker has set `what/<rank>`; a worker that exits or reports a
        failure first ends the wait with its reason."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        values: dict[int, str] = {}
        while len(values) < len(self._processes):
            for rank, p in enumerate(self._processes, start=1):
                if rank in values:
                    continue
                if self._store.check([f"failed/{rank}"]):
                    reason = self._store.get(f"failed/{rank}").decode()
                    raise RuntimeError(f"tensor-parallel rank {rank} failed: {reason}")
                if self._store.check([f"{what}/{rank}"]):
                    values[rank] = self._store.get(f"{what}/{rank}").decode()
                elif not p.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with status {p.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers not {what} after {STARTUP_TIMEOUT_S:.0f} s")
            if len(values) < len(self._processes):
                time.sleep(0.05)
        return [values[r] for r in sorted(values)]

    def wait_ready(self) -> None:
        """Returns once every worker holds its shard and its KV cache; raises (and stops the
        group) if one failed."""
        try:
            self.worker_stats = [json.loads(v) for v in self._wait_for("ready")]
        except BaseException:
            self.close()
            raise

    def run(self, step: StepInputs, run_step: Callable[[StepInputs], StepOutput]) -> StepOutput:
        """Sends the step to every worker and runs rank 0's share of it."""
        with self._lock:
            if self.failure is not None or self._closed:
                raise RuntimeError(f"the tensor-parallel group stopped: {self.failure or 'closed'}")
            dead = [r for r, p in enumerate(self._processes, start=1) if not p.is_alive()]
            try:
                if dead:
                    raise RuntimeError(f"tensor-parallel rank {dead[0]} exited")
                assert self._channel is not None
                self._channel.send(step)
                return run_step(step)
            except BaseException as exc:
                # the ranks are out of step now: nothing more can run on this group
                self.failure = f"{type(exc).__name__}: {exc}"
                log.error("tensor-parallel step failed; stopping the group: %s", self.failure)
                self._stop_workers(send_stop=False)
                raise

    def close(self) -> None:
        """Stops the workers (the stop message, then signals for any that do not leave) and
        leaves the process group. Safe to call more than once, from any thread."""
        locked = self._lock.acquire(timeout=30)  # a step stuck in a collective must not block exit
        try:
            if self._closed:
                return
            self._closed = True
            self._stop_workers(send_stop=self.failure is None and self._channel is not None)
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
            torch.set_num_threads(self._threads_before)
        finally:
            if locked:
                self._lock.release()
        atexit.unregister(self.close)

    def _stop_workers(self, *, send_stop: bool) -> None:
        if send_stop and self._channel is not None and all(p.is_alive() for p in self._processes):
            try:
                self._channel.send(None)
            except Exception as exc:  # a broken connection: the signals below end them
                log.warning("tensor-parallel stop message not delivered: %s", exc)
        for p in self._processes:
            if p.pid is None:  # never started
                continue
            p.join(timeout=10 if send_stop else 0.5)
            if p.is_alive():  # workers ignore SIGTERM (see `_worker_main`)
                p.kill()
                p.join()


class TensorParallelRunner:
    """The engine's `StepRunner` for rank 0: the single-process `ModelRunner`'s step, run on
    every rank at once. The engine, the scheduler and the block manager do not change."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup) -> None:
        self.runner = runner
        self.group = group

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def execute(self, batch: ScheduledBatch, *, want_ids: bool = False) -> StepOutput:
        return self.group.run(self.runner.step_inputs(batch), self.runner.run_step)


# ---- the worker process ----
def _exit_with_parent() -> None:
    """Ends this worker when the process that started it is gone (a crash, a SIGKILL: cases in
    which no stop message comes and a collective could wait for its timeout)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="turbospark-tp-watchdog", daemon=True).start()


def _worker_main(rank: int, world_size: int, port: int, job: WorkerJob) -> None:
    # Ctrl-C in a terminal, or a service manager's SIGTERM to the whole group, reaches the
    # workers too; the server drains its running replies first, which needs them, and then
    # stops them itself (or the watchdog does, if it is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank{rank} %(name)s: %(message)s")
    if job.kernel_settings is not None:
        use_settings(job.kernel_settings)  # before the shard loads: the same kernels as rank 0
    torch.set_num_threads(job.threads)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
    )
    device = rank_device(job.device, rank)
    try:
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        store.set(f"joined/{rank}", "1")
        dist.init_process_group(
            _backend_for(device),
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
            **kwargs,
        )
        channel = StepChannel(dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))
        runner = _build_runner(rank, world_size, device, job)
    except BaseException as exc:
        store.set(f"failed/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    assert isinstance(runner.model, torch.nn.Module)
    count, size, _ = weight_stats(runner.model, replicated=False)
    store.set(f"ready/{rank}", json.dumps({"num_parameters": count, "size_bytes": size}))
    try:
        while (step := channel.recv()) is not None:
            runner.run_step(step)
    except Exception as exc:  # rank 0 gone or out of step: nothing more to do here
        log.warning("leaving: %s: %s", type(exc).__name__, exc)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _build_runner(rank: int, world_size: int, device: torch.device, job: WorkerJob) -> ModelRunner:
    from turbospark.engine.models import build_model

    fix_mmap_threshold()  # as rank 0 loads: freed weights go back to the OS at once
    config, loaded = job.source()
    tensors = dict(loaded)  # consumed by the build, weight by weight
    del loaded
    model = build_model(
        config,
        tensors,
        device,
        job.dtype,
        quant=job.quant,
        max_positions=job.max_positions,
        consume=True,
        shard=Shard(rank, world_size),
    )
    del tensors
    release_freed_memory()
    return ModelRunner(
        model,
        max_context=job.max_context,
        num_blocks=job.num_blocks,
        block_size=job.block_size,
        device=device,
        kv_dtype=job.kv_dtype,
    )
