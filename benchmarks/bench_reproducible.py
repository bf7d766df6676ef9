"""The cost of reproducible CPU steps (`engine/row_kernels.py`): the default against
`TURBOSPARK_FAST_NONDETERMINISTIC=1` (kernels chosen by row count), same run, alternating.

Through the engine (scheduler, batching, prefix cache off by fresh prompts) on the packaged
SmolLM2 (int4, as served) and on random weights of Qwen2.5-0.5B's config (`--quant`), per
setting: prefill tokens/s of a `--prompt-tokens` prompt (chunks of 1,024), decode tokens/s of
one stream, aggregate decode tokens/s of 8 and of 16 streams (16 runs as two one-call steps of
8 in the default), and the decode rate of one stream while 512-token prompts keep arriving
(mixed steps: a prompt chunk and a decode row). Each setting runs in its own process; medians of
`--rounds`.

    python benchmarks/bench_reproducible.py --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ONE_RUN = "--one-run"
SETTINGS = {"reproducible": {}, "fast-nondeterministic": {"TURBOSPARK_FAST_NONDETERMINISTIC": "1"}}


def one_run(model_name: str, quant: str, prompt_tokens: int, new_tokens: int, threads: int) -> None:
    import torch

    from turbospark.backend import NEVER_CANCEL, GenerationConfig
    from turbospark.engine.backend import resolve_kv_dtype
    from turbospark.engine.cpu_kernels import cpu_kernels
    from turbospark.engine.engine import Engine
    from turbospark.engine.models import build_model
    from turbospark.engine.runner import ModelRunner
    from turbospark.engine.scheduler import Scheduler, SchedulerConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    act = cpu_kernels().activation_dtype
    if model_name == "smollm2":
        from turbospark.engine.loader import load_checkpoint

        ckpt = load_checkpoint("smollm2", progress=False)
        config, tensors = ckpt.config, dict(ckpt.tensors)
        quant = "int4"
    else:
        import transformers

        from bench_gpu import CONFIGS

        config = CONFIGS[model_name]
        hf = transformers.Qwen2ForCausalLM._from_config(transformers.Qwen2Config(**config))
        tensors = dict(hf.state_dict())
        del hf
    model = build_model(config, tensors, "cpu", act, quant=quant, consume=True, max_positions=4096)
    kv = resolve_kv_dtype("cpu", act, None)
    vocab = int(config["vocab_size"])

    def engine(max_active: int = 16) -> Engine:
        runner = ModelRunner(model, max_context=2048, num_blocks=2048, block_size=16, kv_dtype=kv)
        sched = SchedulerConfig(max_active=max_active, max_batched_tokens=256, max_prefill_tokens=1024)
        return Engine(runner, Scheduler(sched, runner.block_manager), max_context=2048, name="bench")

    rng = torch.Generator().manual_seed(1)

    def prompt(n: int) -> list[int]:
        return [int(t) for t in torch.randint(100, vocab - 100, (n,), generator=rng)]

    greedy = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0)
    eng = engine()
    eng.run(prompt(64), GenerationConfig(max_new_tokens=4, temperature=0.0), NEVER_CANCEL, lambda _: None)
    start = time.perf_counter()
    eng.run(
        prompt(prompt_tokens),
        GenerationConfig(max_new_tokens=1, temperature=0.0),
        NEVER_CANCEL,
        lambda _: None,
    )
    prefill = prompt_tokens / (time.perf_counter() - start)
    one = eng.run(prompt(32), greedy, NEVER_CANCEL, lambda _: None)
    decode = len(one.token_ids) / one.decode_seconds

    def streams(n: int) -> float:
        done: list[int] = []
        prompts = [prompt(32) for _ in range(n)]

        def go(p: list[int]) -> None:
            done.append(len(eng.run(p, greedy, NEVER_CANCEL, lambda _: None).token_ids))

        ts = [threading.Thread(target=go, args=(p,)) for p in prompts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return sum(done) / (time.perf_counter() - t0)

    eight, sixteen = streams(8), streams(16)
    # one stream decoding while 512-token prompts arrive one after another
    stop = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            eng.run(
                prompt(512), GenerationConfig(max_new_tokens=1, temperature=0.0), NEVER_CANCEL, lambda _: None
            )

    feeder = threading.Thread(target=feed)
    feeder.start()
    mixed_result = eng.run(prompt(32), greedy, NEVER_CANCEL, lambda _: None)
    stop.set()
    feeder.join()
    mixed = len(mixed_result.token_ids) / mixed_result.decode_seconds
    print(
        json.dumps(
            {
                "prefill": prefill,
                "decode": decode,
                "8 streams": eight,
                "16 streams": sixteen,
                "decode beside prompts": mixed,
                "profile": cpu_kernels().describe(),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,qwen2.5-0.5b")
    parser.add_argument("--quant", default="int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(ONE_RUN, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        one_run(args.model, args.quant, args.prompt_tokens, args.new_tokens, args.threads)
        return
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    profile = ""
    for _ in range(args.rounds):
        for model in args.models.split(","):
            for name, extra in SETTINGS.items():
                cmd = [sys.executable, __file__, ONE_RUN, "--model", model, "--quant", args.quant]
                cmd += ["--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens)]
                cmd += ["--new-tokens", str(args.new_tokens)]
                out = subprocess.run(
                    cmd, env={**os.environ, **extra}, capture_output=True, text=True, check=True
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                profile = row.pop("profile")
                results.setdefault((model, name), []).append(row)
    print(profile)
    print(f"{args.threads} threads, medians of {args.rounds} alternating rounds (tokens/s)")
    for model in args.models.split(","):
        base = {
            k: statistics.median(r[k] for r in results[(model, "fast-nondeterministic")])
            for k in results[(model, "fast-nondeterministic")][0]
        }
        for name in SETTINGS:
            med = {k: statistics.median(r[k] for r in results[(model, name)]) for k in base}
            cells = ", ".join(f"{k} {v:.1f} ({v / base[k]:.2f}x)" for k, v in med.items())
            print(f"{model} {name}: {cells}")


if __name__ == "__main__":
    main()
