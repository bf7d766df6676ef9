"""Tensor parallelism: TP=N against TP=1 in the same run, through the served engine's own path.

    python benchmarks/bench_tp.py                          # Llama-3.1-8B config, TP 1 and 2, cuda:0..1
    python benchmarks/bench_tp.py --tp 1,2,4 --json out.json
    python benchmarks/bench_tp.py --device cpu --preset tiny --tp 1,2   # a smoke run of this script
    python benchmarks/bench_tp.py --device cpu --model qwen2.5-coder:0.5b --dtype float32 --batch 4

Run from the repository root with the package installed (`pip install -e .`) or PYTHONPATH=src.

Unless --model names a checkpoint to load instead, a random-weight checkpoint folder of the
preset's config is written once (bf16 weights drawn with
std 0.02, a word-level tokenizer; no hub access; reused from --folder on later runs). Each TP
size then runs in a process of its own (`--child`), which loads the folder with
`load_backend(..., tensor_parallel=N)` exactly as `turbospark serve --tensor-parallel N` does
(workers spawned, NCCL on CUDA with NVLink multicast off) and drives the engine through
`run_completion`:

- batch-1 decode: one request, a 128-token prompt, 256 greedy tokens with EOS ignored; tokens/s
  over the decode time the engine reports (the prefill excluded), best of --repeats;
- batched throughput: 256 requests at once (--batch), 128-token prompts of distinct random ids
  (no prefix-cache hits), 128 tokens each; generated tokens per second of wall time from the
  first submission to the last token.

A warm-up request comes first (it captures the CUDA graphs on every rank). Printed: each size's
numbers, then each size's ratio to TP=1 and the issue's two goals for TP=2 (batch-1 decode
faster than TP=1; batched throughput >= 1.6x TP=1).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench_gpu import LLAMA31_8B  # the same config the single-GPU benchmark measures

TINY: dict[str, Any] = {
    **LLAMA31_8B,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PRESETS = {"llama-3.1-8b": LLAMA31_8B, "tiny": TINY}
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_folder(folder: Path, config: dict[str, Any], device: str) -> None:
    """config.json, one safetensors file per layer (bounded host memory), a word tokenizer."""
    import tokenizers
    from safetensors.torch import save_file

    if (folder / "done").is_file():
        log(f"reusing {folder}")
        return
    folder.mkdir(parents=True, exist_ok=True)
    gen_device = torch.device(device if torch.device(device).type == "cuda" else "cpu")
    generator = torch.Generator(gen_device).manual_seed(0)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        w = torch.empty(shape, dtype=torch.bfloat16, device=gen_device)
        return w.normal_(0.0, 0.02, generator=generator).cpu()

    started = time.perf_counter()
    save_file(
        {
            "model.embed_tokens.weight": rand(vocab, hidden),
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            "lm_head.weight": rand(vocab, hidden),
        },
        str(folder / "model-outer.safetensors"),
    )
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {
            p + "self_attn.q_proj.weight": rand(hidden, hidden),
            p + "self_attn.k_proj.weight": rand(kv, hidden),
            p + "self_attn.v_proj.weight": rand(kv, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, hidden),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
        save_file(layer, str(folder / f"model-layer{i:03d}.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(253)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (folder / "done").write_text("")
    log(f"wrote {folder} in {time.perf_counter() - started:.0f} s")


def describe_hardware(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    name = "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One TP size: load as `serve` does, warm up, then the two measurements."""
    from turbospark.backend import NEVER_CANCEL, GenerationConfig
    from turbospark.engine.backend import load_backend
    from turbospark.engine.scheduler import SchedulerConfig

    started = time.perf_counter()
    model = load_backend(
        str(args.model or args.folder),
        device=args.device,
        dtype=args.dtype,
        quant=args.quant,
        progress=False,
        kv_cache_gb=args.kv_cache_gb,
        max_context=args.prompt + max(args.decode, args.batched_decode) + 16,
        scheduler=SchedulerConfig(
            max_active=args.batch, max_waiting=args.batch, max_batched_tokens=args.max_batched_tokens
        ),
        tensor_parallel=args.tp,
    )
    load_seconds = time.perf_counter() - started
    vocab = model.vocab_size
    rng = random.Random(args.tp)

    def prompt() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(args.prompt)]

    def run(ids: list[int], n: int) -> Any:
        config = GenerationConfig(max_new_tokens=n, temperature=0.0)  # no stop ids: EOS ignored
        return model.run_completion(ids, config, None, NEVER_CANCEL, lambda event: None)

    run(prompt(), 8)  # warm-up: CUDA graphs captured on every rank
    best = 0.0
    for _ in range(args.repeats):
        result = run(prompt(), args.decode)
        assert len(result.token_ids) == args.decode
        best = max(best, (args.decode - 1) / result.decode_seconds)
    prompts = [prompt() for _ in range(args.batch)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.batch) as pool:
        results = list(pool.map(lambda ids: run(ids, args.batched_decode), prompts))
    wall = time.perf_counter() - t0
    generated = sum(len(r.token_ids) for r in results)
    if model.tensor_parallel is not None:
        model.tensor_parallel.close()
    return {
        "tp": args.tp,
        "load_seconds": round(load_seconds, 1),
        "batch1_decode_tok_s": round(best, 1),
        "batched_tok_s": round(generated / wall, 1),
        "batched_wall_s": round(wall, 2),
        "batched_generated": generated,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--tp", default="1,2", help="comma-separated TP sizes; the first is the baseline")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--folder", type=Path, default=None, help="where the random checkpoint is (re)used")
    ap.add_argument("--model", default=None, help="load this model spec instead of a random checkpoint")
    ap.add_argument("--quant", default="none", help="as serve's --quant (default none: float weights)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--batched-decode", type=int, default=128)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-gb", type=float, default=16.0, help="per GPU (shared by the ranks on CPU)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.update(NCCL_ENV)
    if args.child:
        args.tp = int(args.tp)
        print(json.dumps(child(args)), flush=True)
        return 0

    config = dict(PRESETS[args.preset])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    folder = args.folder or Path(tempfile.gettempdir()) / (
        f"turbospark-bench-tp-{args.preset}-{config['num_hidden_layers']}"
    )
    if args.model is None:
        write_folder(folder, config, args.device)
    sizes = [int(s) for s in args.tp.split(",")]
    rows = []
    for tp in sizes:
        log(f"TP={tp} ...")
        cmd = [sys.executable, __file__, "--child", "--tp", str(tp), "--folder", str(folder)]
        if args.model:
            cmd += ["--model", args.model]
        for name in ("device", "dtype", "quant", "prompt", "decode", "batched_decode", "batch"):
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        cmd += ["--max-batched-tokens", str(args.max_batched_tokens), "--kv-cache-gb", str(args.kv_cache_gb)]
        cmd += ["--repeats", str(args.repeats)]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        log(json.dumps(rows[-1]))
    base = rows[0]
    hardware = describe_hardware(args.device)
    what = args.model or f"{args.preset} ({config['num_hidden_layers']} layers, random weights)"
    print(f"{what}, {args.dtype}, quant {args.quant}, {args.device}: {hardware}")
    vs = f"vs TP={base['tp']}"
    print(f"| TP | batch-1 decode tok/s | {vs} | batched tok/s ({args.batch} seqs) | {vs} |")
    print("|---|---|---|---|---|")
    for row in rows:
        d = row["batch1_decode_tok_s"] / base["batch1_decode_tok_s"]
        b = row["batched_tok_s"] / base["batched_tok_s"]
        print(
            f"| {row['tp']} | {row['batch1_decode_tok_s']} | {d:.2f}x | {row['batched_tok_s']} | {b:.2f}x |"
        )
    two = next((r for r in rows if r["tp"] == 2), None)
    if two is not None and base["tp"] == 1:
        faster = two["batch1_decode_tok_s"] > base["batch1_decode_tok_s"]
        ratio = two["batched_tok_s"] / base["batched_tok_s"]
        print(f"goal: TP=2 batch-1 decode faster than TP=1: {'met' if faster else 'NOT met'}")
        verdict = "met" if ratio >= 1.6 else "NOT met"
        print(f"goal: TP=2 batched throughput >= 1.6x TP=1: {ratio:.2f}x, {verdict}")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "config": config, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
