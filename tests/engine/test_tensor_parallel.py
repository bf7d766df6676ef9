"""Tensor parallelism on CPU: two gloo ranks compute what one process computes.

Tiny random-weight llama and qwen2 folders are loaded twice, single-process and with
`tensor_parallel=2` (this process is rank 0, one worker is spawned), and fed the same steps
(a chunked prefill, a mixed prefill + decode step, batched decodes); the logits agree within
float32 tolerance. Then `turbospark serve --tensor-parallel 2` answers the openai client with the
same greedy text as `--tensor-parallel 1`, also for requests batched together, and leaves no
process behind when it stops, nor when it is killed.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from tiny_models import FAMILIES, save_folder

from turbospark.cli import parser
from turbospark.engine.backend import RealChatModel, load_backend
from turbospark.engine.parallel import (
    StepChannel,
    TensorParallelGroup,
    WorkerJob,
    check_devices,
    decode_step,
    encode_step,
)
from turbospark.engine.runner import StepInputs
from turbospark.testing import ServerProcess

# Large weights make the greedy choice clear-cut, so float32 rounding cannot flip a token.
INIT_STD = 1.0
# The two row-parallel sums per layer add the ranks' partial products in another order than
# one matmul does: a few float32 ulps of logits ~30 in size.
RTOL, ATOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    out = {}
    for family in ("llama", "qwen2", "llama3"):
        out[family] = root / f"tiny-{family}"
        save_folder(out[family], FAMILIES[family], seed=0, init_std=INIT_STD)
    return out


def load(folder: Path, tensor_parallel: int) -> RealChatModel:
    return load_backend(
        str(folder),
        dtype="float32",
        quant="none",
        progress=False,
        kv_cache_gb=0.01,
        tensor_parallel=tensor_parallel,
    )


def children_of(pid: int) -> set[int]:
    """Every live descendant of `pid` (zombies count as gone), read from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: set[int], timeout: float = 60.0) -> set[int]:
    """The pids still alive once all are gone or `timeout` passed (a bound, not a speed claim)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(is_alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if is_alive(p)}


def test_step_message_round_trips() -> None:
    step = StepInputs(
        input_ids=[5, 6, 7, 8],
        block_tables=[[3, 4], [], [9]],
        num_cached=[17, 0, 2],
        num_new=[1, 2, 1],
        sample_rows=[0, 2],
    )
    assert decode_step(encode_step(step)) == step
    assert StepChannel.FIRST < 3 * 400  # the long step below takes the second broadcast


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_gloo_ranks_give_the_single_process_logits(folders: dict[str, Path], family: str) -> None:
    single = load(folders[family], 1)
    parallel = load(folders[family], 2)
    group = parallel.tensor_parallel
    assert group is not None
    try:
        cfg = FAMILIES[family]
        # rank 0 holds half the kv heads in its cache; the blocks are the single process's
        assert parallel.runner.kv_cache.k.shape[1] == cfg["num_key_value_heads"] // 2
        assert parallel.runner.kv_cache.num_blocks == single.runner.kv_cache.num_blocks
        # details count every rank's shard: the whole model
        assert parallel.details().num_parameters == single.details().num_parameters

        def both(step: StepInputs) -> torch.Tensor:
            want = single.runner.run_step(step).logits
            got = group.run(step, parallel.runner.run_step).logits
            assert got.shape == want.shape == (len(step.sample_rows), cfg["vocab_size"])
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            return want

        a = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]  # 19 tokens
        b = [40, 41, 42, 43, 44]
        tables = [[0, 1], [2]]
        # a's prompt in two chunks: the first samples nothing (its lm_head is skipped)
        both(StepInputs(a[:16], [tables[0]], [0], [16], []))
        logits = both(StepInputs(a[16:], [tables[0]], [16], [3], [0]))
        a.append(int(logits[0].argmax()))
        # a decodes while b's whole prompt prefills, in one packed step
        logits = both(StepInputs([a[-1], *b], tables, [19, 0], [1, 5], [0, 1]))
        for i, seq in enumerate((a, b)):
            seq.append(int(logits[i].argmax()))
        for _ in range(4):  # batched decodes, greedy on the single process's logits
            logits = both(StepInputs([a[-1], b[-1]], tables, [len(a) - 1, len(b) - 1], [1, 1], [0, 1]))
            for i, seq in enumerate((a, b)):
                seq.append(int(logits[i].argmax()))
        # three 400-token prompts in one step: a message longer than the channel's first part
        prompts = [[(7 * k + 3 * i) % 316 + 4 for i in range(400)] for k in range(3)]
        tables = [list(range(3 + 25 * k, 28 + 25 * k)) for k in range(3)]
        both(StepInputs([t for p in prompts for t in p], tables, [0, 0, 0], [400] * 3, [0, 1, 2]))
    finally:
        group.close()
    assert group.worker_pids and not any(is_alive(pid) for pid in group.worker_pids)


def broken_source() -> tuple[dict, dict]:
    """A worker's checkpoint source that fails (run in the spawned worker)."""
    raise OSError("the checkpoint vanished")


def small_job(source: Callable[[], tuple[dict, dict]], **extra: Any) -> WorkerJob:
    """A worker job of a tiny float32 model on CPU, its checkpoint from `source`."""
    return WorkerJob(
        source=source,
        device="cpu",
        dtype=torch.float32,
        quant=None,
        max_positions=64,
        max_context=64,
        num_blocks=4,
        block_size=16,
        threads=1,
        **extra,
    )


def test_a_worker_that_cannot_load_fails_start_up_with_its_reason() -> None:
    job = small_job(broken_source)
    group = TensorParallelGroup.launch(2, job)
    with pytest.raises(RuntimeError, match="rank 1 failed: OSError: the checkpoint vanished"):
        group.wait_ready()
    assert not wait_gone(set(group.worker_pids))
    with pytest.raises(RuntimeError, match="stopped: closed"):
        group.run(StepInputs([1], [[0]], [0], [1], [0]), lambda step: torch.zeros(1))


def source_that_shows_its_kernel_settings() -> tuple[dict, dict]:
    """A worker's checkpoint source that fails with the worker's kernel settings in its reason."""
    from turbospark.engine import kernel_settings

    raise OSError(f"settings here: {kernel_settings.current()!r}")


def test_a_worker_takes_rank_0s_kernel_settings() -> None:
    """Given on rank 0's command line, not in any environment: the job carries them over."""
    from turbospark.engine.kernel_settings import KernelSettings

    chosen = KernelSettings(cpu_kernels="float32", fast_nondeterministic=True, pool_steal=False)
    job = small_job(source_that_shows_its_kernel_settings, kernel_settings=chosen)
    group = TensorParallelGroup.launch(2, job)
    with pytest.raises(RuntimeError, match="rank 1 failed") as failed:
        group.wait_ready()
    assert repr(chosen) in str(failed.value)
    assert not wait_gone(set(group.worker_pids))


def test_a_model_that_does_not_split_is_refused_with_its_numbers(folders: dict[str, Path]) -> None:
    # the llama3 tiny model has one kv head: two ranks cannot split it
    with pytest.raises(ValueError, match=r"over 2 ranks .* kv heads \(1\) do not"):
        load(folders["llama3"], 2)
    with pytest.raises(ValueError, match=r"over 3 ranks .* attention heads \(4\), kv heads \(2\), "):
        load(folders["llama"], 3)


def test_bad_rank_counts_are_refused_at_start_up() -> None:
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(["serve", "--tensor-parallel", "0"])
    assert exit_info.value.code == 2
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"needs GPUs 0\.\.{gpus}; this machine has {gpus}"):
        check_devices("cuda", gpus + 1)
    with pytest.raises(ValueError, match="at least 1, not 0"):
        check_devices("cpu", 0)


def serve(folder: Path, tensor_parallel: int) -> ServerProcess:
    return ServerProcess(
        "--model",
        str(folder),
        "--dtype",
        "float32",
        "--quant",
        "none",
        "--kv-cache-gb",
        "0.01",
        "--tensor-parallel",
        str(tensor_parallel),
    )


PROMPTS = ["w1 w2 w3 w40 w41 w300", "w7 w7 w9", "w100 w5 w60 w61 w62 w63 w64 w65 w66 w67 w68 w69 w70 w71"]


def answers(url: str, model: str, *, concurrently: bool) -> list[str]:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:

        def ask(prompt: str) -> str:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=12
            )
            return reply.choices[0].message.content or ""

        if not concurrently:
            return [ask(p) for p in PROMPTS]
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            return list(pool.map(ask, PROMPTS))


@pytest.fixture(scope="module")
def single_answers(folders: dict[str, Path]) -> Iterator[list[str]]:
    with serve(folders["llama"], 1) as server:
        yield answers(server.url, "tiny-llama", concurrently=False)


@pytest.mark.slow
def test_served_greedy_text_equals_the_single_process_text(
    folders: dict[str, Path], single_answers: list[str]
) -> None:
    assert all(len(a.split()) >= 3 for a in single_answers), single_answers  # real text to compare
    with serve(folders["llama"], 2) as server:
        workers = children_of(server.proc.pid)
        assert workers, "no worker process was started"
        # what a terminal's Ctrl-C or a service manager sends the whole group: the server decides
        for pid in workers:
            os.kill(pid, signal.SIGINT)
            os.kill(pid, signal.SIGTERM)
        assert answers(server.url, "tiny-llama", concurrently=False) == single_answers
        # batched together in the engine's steps, the answers stay the same
        assert answers(server.url, "tiny-llama", concurrently=True) == single_answers
        assert server.terminate() == 0, server.log()
        assert not wait_gone(workers), f"left behind after shutdown:\n{server.log()}"


@pytest.mark.slow
def test_workers_leave_when_the_server_is_killed(folders: dict[str, Path]) -> None:
    with serve(folders["llama"], 2) as server:
        workers = children_of(server.proc.pid)
        assert workers
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        assert not wait_gone(workers), "a worker outlived its killed server"
