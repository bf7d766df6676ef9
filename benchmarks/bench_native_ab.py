"""Prefill and decode under different CPU settings (native kernels on / off, CPU profiles), on
random weights of a real config.

For a CPU where no GGUF is at hand (a lent machine): random float weights of a config from
`bench_gpu.CONFIGS` (Qwen2.5-0.5B by default), quantized as `--quant` says, built as the server
builds them; prefill tokens/s of a `--prompt-tokens` prompt, then decode tokens/s of
`--new-tokens` greedy tokens. `--settings` lists the environments compared (default: the native
kernels forced on, then off).
Each setting runs in its own process (the CPU profile is fixed per process), alternating
`--rounds` times; medians are reported. Speed does not depend on the weights' values.

    python benchmarks/bench_native_ab.py --threads 2 --quant int4,int8
    python benchmarks/bench_native_ab.py \\
        --settings "TURBOSPARK_CPU_KERNELS=auto;TURBOSPARK_CPU_KERNELS=bf16-native"
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
    from turbospark.engine.backend import resolve_kv_dtype
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
    kv_dtype = resolve_kv_dtype("cpu", cpu_kernels().activation_dtype, None)  # the server's
    runner = ModelRunner(model, max_context=prompt_tokens + new_tokens + 16, kv_dtype=kv_dtype)
    seq = SequenceState()
    ids = [int(t) for t in torch.randint(0, config["vocab_size"], (prompt_tokens,))]
    runner.forward([(seq, ids[:16])])  # warm-up
    runner.release(seq)
    start = time.perf_counter()
    logits = runner.forward([(seq, ids)])[0]
    prefill = prompt_tokens / (time.perf_counter() - start)
    token = int(logits.argmax())
    for _ in range(4):  # warm-up
        token = int(runner.forward([(seq, [token])])[0].argmax())
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = int(runner.forward([(seq, [token])])[0].argmax())
    rate = new_tokens / (time.perf_counter() - start)
    print(json.dumps({"rate": rate, "prefill": prefill, "profile": cpu_kernels().describe()}))


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
    parser.add_argument(
        "--settings",
        default="TURBOSPARK_NATIVE_KERNELS=1;TURBOSPARK_NATIVE_KERNELS=0",
        help="environments to compare, ';' between settings, ',' between VAR=VALUE",
    )
    parser.add_argument(ONE_RUN, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        one_run(args.config, args.quant, args.prompt_tokens, args.new_tokens, args.threads)
        return
    settings = [dict(kv.split("=", 1) for kv in group.split(",") if kv) for group in args.settings.split(";")]
    names = [",".join(f"{k}={v}" for k, v in env.items()) or "default" for env in settings]
    rates: dict[tuple[str, str], list[tuple[float, float]]] = {}
    profiles: dict[str, str] = {}
    for _ in range(args.rounds):
        for quant in args.quant.split(","):
            for name, extra in zip(names, settings, strict=True):
                cmd = [sys.executable, __file__, ONE_RUN, "--config", args.config, "--quant", quant]
                cmd += ["--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens)]
                cmd += ["--new-tokens", str(args.new_tokens)]
                env = {**os.environ, **extra}
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                rates.setdefault((quant, name), []).append((result["prefill"], result["rate"]))
                profiles[name] = result["profile"]
    for name, profile in profiles.items():
        print(f"{name}: {profile}")
    print(
        f"\n{args.config}, random weights, {args.threads} threads, "
        f"prefill {args.prompt_tokens} tokens, then decode"
    )
    for quant in args.quant.split(","):
        first = None
        for name in names:
            prefill = statistics.median(p for p, _ in rates[(quant, name)])
            decode = statistics.median(d for _, d in rates[(quant, name)])
            first = first or (prefill, decode)
            ratio = f"{prefill / first[0]:.2f}x / {decode / first[1]:.2f}x of the first"
            print(f"{quant} {name}: prefill {prefill:.1f} tok/s, decode {decode:.1f} tok/s ({ratio})")


if __name__ == "__main__":
    main()
