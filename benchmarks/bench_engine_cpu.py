"""CPU engine benchmark: turbospark vs transformers (bf16) vs llama.cpp, same GGUF, same run.

Per model: prefill tokens/s at each prompt length (default 512 and 4,000 tokens, a fresh
sequence each time) and decode tokens/s over 128 greedy tokens after the shortest prompt, for
turbospark as the server runs it (`--quant auto`: int4 for 4-bit GGUFs), transformers in bf16
(the same dequantized weights) and llama.cpp (llama-cpp-python reading the GGUF itself). The
engines run round robin, `--repeats` times, and the median is reported, so load from other
processes hits every engine alike. The CPU's model name and the instruction sets torch uses are
printed first, with the memory-bandwidth bound of each turbospark decode.

    python benchmarks/bench_engine_cpu.py --threads 2
    python benchmarks/bench_engine_cpu.py --threads 2 --models smollm2 --lengths 512 --repeats 5

Prompt ids are the same for every engine: a chat-style text repeated to the length needed.
transformers in bf16 is slow where bf16 is emulated (AVX2): by default it only runs the shortest
prompt (`--transformers-lengths`).
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from turbospark.engine.backend import resolve_kv_dtype
from turbospark.engine.cpu_info import cpu_flags
from turbospark.engine.cpu_kernels import cpu_kernels
from turbospark.engine.loader import load_checkpoint
from turbospark.engine.models import build_model
from turbospark.engine.quant import auto_quant
from turbospark.engine.runner import ModelRunner, SequenceState
from turbospark.engine.scheduler import SchedulerConfig

PROMPT_TEXT = (
    "You are reviewing a design document for a small inference server. The server loads a "
    "language model once, keeps its weights in memory, and answers chat requests from several "
    "clients that speak different HTTP dialects. Each request is turned into one internal form, "
    "planned (system prompt, reasoning effort, token budget), queued in arrival order, and then "
    "run by an engine that only ever sees token ids. The engine keeps a paged key/value cache so "
    "that many sequences can share memory, polls a cancel flag so that a client that goes away "
    "stops costing compute, and reports every token as soon as it is sampled so that streams "
    "stay smooth. The document argues that a model of one hundred and thirty five million "
    "parameters can answer quickly on two processor cores if the weights are stored in eight "
    "bits and the per-token work avoids needless copies. Summarize the argument in three short "
    "bullet points, then name one risk the authors did not discuss and one measurement that "
    "would settle it."
)


def memory_bandwidth_gbs() -> float:
    """Read bandwidth of a 512 MiB sum (far past the caches), best of 5."""
    x = torch.ones(128 * 1024 * 1024)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def bytes_per_token(model: torch.nn.Module, context: int, kv_dtype: torch.dtype) -> int:
    """Bytes a decode step reads: every matmul weight (incl. lm_head) + scales + the KV cache
    of `context` tokens."""
    total = 0
    for name, mod in model.named_modules():
        if "embed_tokens" in name or name == "rotary":
            continue  # one embedding row per token; rotary reads one row per token too
        q4 = getattr(mod, "q4", None)  # the native kernels' int4 layout: what decode reads then
        if q4 is not None:
            total += sum(t.numel() * t.element_size() for t in (q4.codes, q4.scales, q4.offsets))
        q8 = getattr(mod, "q8", None)  # their int8 layout (it replaces the (out, in) codes)
        if q8 is not None:
            total += sum(t.numel() * t.element_size() for t in (q8.codes, q8.scales))
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            if getattr(mod, "nibbles", None) is t:
                continue  # int4's prefill copy of the codes: decode never reads it
            if q4 is not None and getattr(mod, "scales_and_zeros", None) is t:
                continue  # torch's layout of the scales: the native kernel reads its own
            if q8 is not None and getattr(mod, "scales", None) is t:
                continue  # the many-row path's scales: the native kernel reads its own
            total += t.numel() * t.element_size()
    cfg = model.config  # type: ignore[attr-defined]
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * context
    return total + kv * kv_dtype.itemsize


def cpu_kind() -> str:
    """The CPU's model name and the instruction sets that matter here, as torch and Linux see them."""
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}; flags: {' '.join(isa) or '?'}\n{cpu_kernels().describe()}"


def prompt_ids(encode: Callable[[str], list[int]], length: int) -> list[int]:
    text = f"<|im_start|>user\n{PROMPT_TEXT}<|im_end|>\n<|im_start|>assistant\n"
    ids = encode(text)
    return (ids * (length // len(ids) + 1))[:length]


@dataclass
class Engine:
    name: str
    prefill: Callable[[list[int]], float]  # prompt -> seconds
    decode: Callable[[list[int], int], float]  # prompt, n -> seconds for n greedy tokens after it
    lengths: set[int] | None = None  # prompt lengths it runs (None: all)
    bound_tok_s: float | None = None
    prefill_tok_s: dict[int, list[float]] = field(default_factory=dict)
    decode_tok_s: list[float] = field(default_factory=list)


def turbospark_engine(config: dict, tensors: dict, max_len: int, bw: float, decode_context: int) -> Engine:
    quant = auto_quant(tensors)  # what `turbospark serve` picks for these weights
    dtype = cpu_kernels().activation_dtype  # as the server: float32 where bf16 is emulated
    model = build_model(config, tensors, "cpu", dtype, quant=quant, max_positions=max_len)
    # the server's KV cache: float16 where the native decode attention reads it
    kv_dtype = resolve_kv_dtype("cpu", dtype, None)
    runner = ModelRunner(model, max_context=max_len, kv_dtype=kv_dtype)
    chunk = SchedulerConfig().max_prefill_tokens  # the engine's chunk for a prompt alone

    def prefill(ids: list[int]) -> float:
        seq = SequenceState()
        t = time.perf_counter()
        for start in range(0, len(ids), chunk):
            runner.forward([(seq, ids[start : start + chunk])])
        elapsed = time.perf_counter() - t
        runner.release(seq)
        return elapsed

    def decode(ids: list[int], n: int) -> float:
        seq = SequenceState()
        for start in range(0, len(ids), chunk):
            logits = runner.forward([(seq, ids[start : start + chunk])])[0]
        t = time.perf_counter()
        for _ in range(n):
            logits = runner.forward([(seq, [int(logits.argmax())])])[0]
        elapsed = time.perf_counter() - t
        runner.release(seq)
        return elapsed

    bound = bw * 1e9 / bytes_per_token(model, decode_context, kv_dtype)  # type: ignore[arg-type]
    kv_name = str(kv_dtype).removeprefix("torch.").replace("float", "f")
    return Engine(f"turbospark {quant} kv {kv_name}", prefill, decode, bound_tok_s=bound)


def transformers_engine(config: dict, tensors: dict, lengths: set[int]) -> Engine:
    from transformers import AutoConfig, AutoModelForCausalLM

    clean = {k: v for k, v in config.items() if k != "quantization_config"}
    hf_config = AutoConfig.for_model(**clean)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    model.eval()

    @torch.inference_mode()
    def prefill(ids: list[int]) -> float:
        t = time.perf_counter()
        model(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t

    @torch.inference_mode()
    def decode(ids: list[int], n: int) -> float:
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        cache, tok = out.cache, out.logits[0, -1].argmax()
        t = time.perf_counter()
        for _ in range(n):
            out = model(tok.view(1, 1), cache=cache, use_cache=True)
            cache, tok = out.cache, out.logits[0, -1].argmax()
        return time.perf_counter() - t

    return Engine("transformers bf16", prefill, decode, lengths=lengths)


def llama_cpp_engine(gguf: str, max_len: int, threads: int) -> Engine | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(
        model_path=gguf, n_ctx=max_len, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
    )

    def prefill(ids: list[int]) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - t

    def decode(ids: list[int], n: int) -> float:
        llm.reset()
        llm.eval(ids)
        tok = int(llm.sample(temp=0.0))
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = int(llm.sample(temp=0.0))
        return time.perf_counter() - t

    kind = re.search(r"[qQ]\d\w*$", Path(gguf).stem)
    return Engine(f"llama.cpp {kind.group(0) if kind else ''}", prefill, decode)


def bench_model(spec: str, args: argparse.Namespace, bw: float) -> list[Engine]:
    lengths = sorted(int(n) for n in args.lengths.split(","))
    max_len = lengths[-1] + args.new_tokens + 64
    ckpt = load_checkpoint(spec, progress=False)
    tensors = dict(ckpt.tensors)
    tokenizer = ckpt.tokenizer
    ids = {n: prompt_ids(lambda t: tokenizer.encode(t).ids, n) for n in lengths}
    # decode runs after the shortest prompt: its mean context over the new tokens
    decode_context = lengths[0] + args.new_tokens // 2
    engines = [turbospark_engine(ckpt.config, tensors, max_len, bw, decode_context)]
    if not args.no_transformers:
        hf_lengths = (
            {int(n) for n in args.transformers_lengths.split(",")}
            if args.transformers_lengths
            else set(lengths)
        )
        engines.append(transformers_engine(ckpt.config, tensors, hf_lengths))
    if not args.no_llama_cpp:
        peer = llama_cpp_engine(ckpt.source, max_len, args.threads)
        if peer is None:
            print("llama.cpp: llama_cpp (llama-cpp-python) is not installed; skipped")
        else:
            engines.append(peer)
    del tensors, ckpt
    gc.collect()
    for e in engines:  # warm-up: first calls allocate and pick kernels
        e.prefill(ids[lengths[0]][:64])
    for _ in range(args.repeats):  # round robin over engines, each measurement in turn
        for n in lengths:
            for e in engines:
                if e.lengths is None or n in e.lengths:
                    e.prefill_tok_s.setdefault(n, []).append(n / e.prefill(ids[n]))
        for e in engines:
            e.decode_tok_s.append(args.new_tokens / e.decode(ids[lengths[0]], args.new_tokens))
    print(f"\n{spec}: prefill tok/s (median of {args.repeats}) and decode tok/s after {lengths[0]} tokens")
    header = f"{'engine':<24}" + "".join(f"{'prefill ' + str(n):>14}" for n in lengths)
    print(header + f"{'decode':>10}{'bw bound':>10}")
    for e in engines:
        cells = "".join(
            f"{statistics.median(e.prefill_tok_s[n]):>14.0f}" if n in e.prefill_tok_s else f"{'-':>14}"
            for n in lengths
        )
        bound = f"{e.bound_tok_s:.0f}" if e.bound_tok_s else "-"
        print(f"{e.name:<24}{cells}{statistics.median(e.decode_tok_s):>10.1f}{bound:>10}")
    peer = next((e for e in engines if e.name.startswith("llama.cpp")), None)
    if peer is not None:
        ours = engines[0]
        med = statistics.median
        ratios = [
            f"prefill {n}: {med(ours.prefill_tok_s[n]) / med(peer.prefill_tok_s[n]):.2f}x" for n in lengths
        ]
        dec = statistics.median(ours.decode_tok_s) / statistics.median(peer.decode_tok_s)
        print(f"turbospark / llama.cpp: {', '.join(ratios)}, decode {dec:.2f}x")
    return engines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="smollm2,qwen2.5-coder:0.5b,qwen2.5-coder:1.5b")
    parser.add_argument("--lengths", default="512,4000", help="prompt lengths for prefill")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="round-robin runs; medians reported")
    parser.add_argument(
        "--transformers-lengths", default="512", help="prompt lengths transformers runs ('' = all)"
    )
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_kind())
    bw = memory_bandwidth_gbs()
    print(f"threads {args.threads}, torch {torch.__version__}, memory read bandwidth {bw:.1f} GB/s")
    for spec in args.models.split(","):
        bench_model(spec.strip(), args, bw)
        gc.collect()


if __name__ == "__main__":
    main()
