"""Decode with turbospark's native kernels on and off, on random weights of a real config.

For a CPU where no GGUF is at hand (a lent machine): random float weights of a config from
`bench_gpu.CONFIGS` (Qwen2.5-0.5B by default), quantized as `--quant` says, built as the server
builds them; decode tokens/s of `--new-tokens` greedy tokens after a `--prompt-tokens` prompt.
Each setting runs in its own process (the CPU profile is fixed per process), alternating
`--rounds` times; medians are reported. Speed does not depend on the weights' values.

    python benchmarks/bench_native_ab.py --threads 2 --quant int4,int8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ONE_RUN = "--one-run"


def one_run(config_name: str, quant: str, prompt_tokens: int, new_tokens: int, threads: int) -> None:
    import torch
    import transformers

    from bench_gpu import CONFIGS
    from turbospark.engine.cpu_kernels import cpu_kernels
    from turbospark.engine.models import build_model
    from turbospark.engine.runner import ModelRunner, SequenceState

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = CONFIGS[config_name]
    kind = {"llama": "Llama", "qwen2": "Qwen2"}[config["model_type"]]
    hf = getattr(transformers, f"{kind}ForCausalLM")._from_config(
        getattr(transformers, f"{kind}Config")(**config)
    )
    tensors = dict(hf.state_dict())
    del hf
    model = build_model(config, tensors, "cpu", cpu_kernels().activation_dtype, quant=quant, consume=True)
    runner = ModelRunner(model, max_context=prompt_tokens + new_tokens + 16)
    seq = SequenceState()
    ids = [int(t) for t in torch.randint(0, config["vocab_size"], (prompt_tokens,))]
    logits = runner.forward([(seq, ids)])[0]
    token = int(logits.argmax())
    for _ in range(4):  # warm-up
        token = int(runner.forward([(seq, [token])])[0].argmax())
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = int(runner.forward([(seq, [token])])[0].argmax())
    rate = new_tokens / (time.perf_counter() - start)
    print(json.dumps({"rate": rate, "profile": cpu_kernels().describe()}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="qwen2.5-0.5b")
    parser.add_argument("--quant", default="int4,int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(ONE_RUN, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        one_run(args.config, args.quant, args.prompt_tokens, args.new_tokens, args.threads)
        return
    rates: dict[tuple[str, str], list[float]] = {}
    profiles: dict[str, str] = {}
    for _ in range(args.rounds):
        for quant in args.quant.split(","):
            for native in ("1", "0"):
                cmd = [sys.executable, __file__, ONE_RUN, "--config", args.config, "--quant", quant]
                cmd += ["--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens)]
                cmd += ["--new-tokens", str(args.new_tokens)]
                env = {**os.environ, "TURBOSPARK_NATIVE_KERNELS": native}
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                rates.setdefault((quant, native), []).append(result["rate"])
                profiles[native] = result["profile"]
    for native, profile in profiles.items():
        print(f"native={native}: {profile}")
    print(
        f"\n{args.config}, random weights, {args.threads} threads, decode after {args.prompt_tokens} tokens"
    )
    for quant in args.quant.split(","):
        on, off = statistics.median(rates[(quant, "1")]), statistics.median(rates[(quant, "0")])
        print(f"{quant}: native {on:.1f} tok/s, torch kernels {off:.1f} tok/s, ratio {on / off:.2f}x")


if __name__ == "__main__":
    main()
