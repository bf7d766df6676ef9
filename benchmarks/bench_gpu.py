"""GPU engine benchmark: turbospark's CUDA path beside transformers' best setting, same weights.

    python benchmarks/bench_gpu.py                       # both configs, every measurement
    python benchmarks/bench_gpu.py --models qwen2.5-0.5b --skip-hf --json out.json

For each model config (written below as dicts: Qwen2.5-0.5B and Llama-3.1-8B; no hub access),
random bf16 weights are drawn once on the GPU by transformers, and turbospark's model is built
from the very same tensors. Printed per model:

- logits of a 128-token prompt, turbospark against transformers (bf16, SDPA): max abs difference;
- the memory-bandwidth bound for batch-1 decode: bytes of weight read per token (every linear,
  the lm_head, the norms; the embedding table only where it is the tied lm_head) over the
  device-to-device copy bandwidth measured in the same run (bytes read + written);
- batch-1 greedy decode tokens/s after a 128-token prompt: turbospark through its CUDA-graph
  runner (one replay, one argmax and one host sync per token; the step's inputs written into the
  graphs' buffers as three scalars; the token read back while the next step runs, and also
  without that overlap), and transformers' `generate` with a static cache, which
  compiles the forward (torch.compile, mode reduce-overhead) itself. Both exclude the prefill:
  transformers' rate is (N - 1) / (t(N tokens) - t(1 token));
- offline throughput: 256 sequences, input and output lengths uniform in [100, 1024] (seed 0),
  EOS ignored, output tokens per second of wall time from first prefill to last token.
  Until the engine's scheduler lands this drives the model through a small loop of its own:
  prefill steps of whole prompts (up to --prefill-tokens per step, eager), then one batched
  decode step over every unfinished sequence at a time (the CUDA-graph runner, padded to the
  next captured size), each step's metadata computed on the device, one host sync per step.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from typing import Any

import torch

from turbospark.engine.attention import AttentionMetadata, build_attention_metadata
from turbospark.engine.kv_cache import ManagedKVCache
from turbospark.engine.models import build_model

QWEN25_05B: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
LLAMA31_8B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# Qwen2.5-7B (and Qwen2.5-Coder-7B): the agent-sized model of the family whose 0.5B / 1.5B
# coders are pulled on the CPU, so their recorded token ids replay on it (bench_speculative)
QWEN25_7B: dict[str, Any] = {
    **QWEN25_05B,
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
CONFIGS = {"qwen2.5-0.5b": QWEN25_05B, "qwen2.5-7b": QWEN25_7B, "llama-3.1-8b": LLAMA31_8B}
BLOCK_SIZE = 16
DEVICE = torch.device("cuda")


def log(msg: str) -> None:
    print(msg, flush=True)


def copy_bandwidth(gib: float = 2.0, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * (1 << 30))
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times)


def hf_model(config: dict[str, Any]) -> Any:
    import transformers

    kind = {"llama": "Llama", "qwen2": "Qwen2"}[config["model_type"]]
    hf_config = getattr(transformers, f"{kind}Config")(**config)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = getattr(transformers, f"{kind}ForCausalLM")._from_config(
            hf_config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def weight_bytes(model: torch.nn.Module, tied: bool) -> int:
    """Bytes one decode step reads: every distinct parameter, less an untied embedding table
    (a lookup reads one row of it)."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name.endswith("embed_tokens.weight") and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


def make_cache(model: Any, num_blocks: int) -> ManagedKVCache:
    from turbospark.engine.cuda_attention import CudaAttention

    c = model.config
    return ManagedKVCache(
        c.num_hidden_layers,
        num_blocks,
        BLOCK_SIZE,
        c.num_key_value_heads,
        c.head_dim,
        torch.bfloat16,
        DEVICE,
        attention=CudaAttention(),
    )


def decode_meta(
    tables: torch.Tensor, cached: torch.Tensor, arange: torch.Tensor
) -> tuple[AttentionMetadata, torch.Tensor]:
    """A decode step's metadata computed on the device: sequence i (row i of the padded block
    tables) has `cached[i]` tokens in the cache and feeds one more. No host list, no H2D copy."""
    n = tables.shape[0]
    pos = cached.long()
    page = tables.gather(1, (pos // BLOCK_SIZE)[:, None]).squeeze(1).long()
    meta = AttentionMetadata(
        slot_mapping=page * BLOCK_SIZE + pos % BLOCK_SIZE,
        query_start_loc=arange[: n + 1],
        seq_lens=cached + 1,
        block_tables=tables,
        last_token_indices=arange[:n].long(),
        block_size=BLOCK_SIZE,
    )
    return meta, pos


@torch.inference_mode()
def turbospark_decode(
    model: Any, kv: ManagedKVCache, graphs: Any, prompt: list[int], num_tokens: int, overlap: bool
) -> dict[str, Any]:
    """Batch-1 greedy decode through the graph runner; tokens/s excluding the prefill.

    Every step's token reaches the host (one sync per step). With `overlap` the host reads step
    i's token (a copy into pinned memory and an event) only after it has queued step i + 1,
    whose input is step i's argmax already on the device: the host's work and the sync hide
    behind the GPU's, as an engine that detects EOS one step late does.
    """
    table: list[int] = []
    assert kv.grow(table, len(prompt) + num_tokens)
    meta, positions = build_attention_metadata([table], [0], [len(prompt)], BLOCK_SIZE, DEVICE)
    logits = model(torch.tensor(prompt, device=DEVICE), positions, meta, kv)
    token = logits.argmax(-1)
    # the step's inputs live in the graphs' own buffers; per step the host writes three scalars
    ids, pos, step_meta = graphs.static_inputs(1)
    step_meta.block_tables[0, : len(table)] = torch.tensor(table, dtype=torch.int32)
    ids.copy_(token)
    out = [int(token)]
    cached = len(prompt)
    landing = torch.empty(num_tokens, dtype=torch.long, pin_memory=True)
    events: list[torch.cuda.Event] = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(num_tokens - 1):
        pos.fill_(cached)
        step_meta.seq_lens.fill_(cached + 1)
        step_meta.slot_mapping.fill_(table[cached // BLOCK_SIZE] * BLOCK_SIZE + cached % BLOCK_SIZE)
        torch.argmax(graphs(ids, pos, step_meta), dim=-1, out=ids)
        cached += 1
        if not overlap:
            out.append(int(ids[0]))  # the one host sync of the step
            continue
        landing[i : i + 1].copy_(ids, non_blocking=True)
        events.append(torch.cuda.Event())
        events[-1].record()
        if i > 0:  # the previous step's token, while this step runs
            events[i - 1].synchronize()
            out.append(int(landing[i - 1]))
    if overlap:
        events[-1].synchronize()
        out.append(int(landing[num_tokens - 2]))
    elapsed = time.perf_counter() - start
    # the GPU's share: replays of the batch-1 graph alone, back to back
    graph = graphs._graphs[1]
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    for _ in range(50):
        graph.replay()
    end_ev.record()
    end_ev.synchronize()
    replay_s = start_ev.elapsed_time(end_ev) / 1e3 / 50
    step_meta.slot_mapping.fill_(-1)  # back to padding: later replays write nowhere
    step_meta.seq_lens.fill_(0)
    kv.release(table)
    return {"tok_s": (num_tokens - 1) / elapsed, "replay_ms": replay_s * 1e3, "tokens": out}


def hf_decode(hf: Any, prompt: list[int], num_tokens: int) -> float:
    """transformers' best setting: static cache, forward compiled by generate (reduce-overhead)."""
    ids = torch.tensor([prompt], device=DEVICE)

    def run(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = hf.generate(
            ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        assert out.shape[1] == len(prompt) + n
        return time.perf_counter() - start

    for _ in range(2):  # compile (generate compiles the decode forward only), then settle
        run(num_tokens)
    t_full = min(run(num_tokens) for _ in range(2))
    # generate's prefill runs the model uncompiled: time that forward alone and take it out
    with torch.inference_mode():
        prefill = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            hf(ids).logits[:, -1].argmax(-1).tolist()
            prefill.append(time.perf_counter() - start)
    return (num_tokens - 1) / (t_full - statistics.median(prefill))


def offline_lengths(num_seqs: int, seed: int = 0) -> tuple[random.Random, list[int], list[int]]:
    rng = random.Random(seed)
    in_lens = [rng.randint(100, 1024) for _ in range(num_seqs)]
    out_lens = [rng.randint(100, 1024) for _ in range(num_seqs)]
    return rng, in_lens, out_lens


@torch.inference_mode()
def offline(
    model: Any, kv: ManagedKVCache, graphs: Any, num_seqs: int, prefill_tokens: int, seed: int = 0
) -> dict[str, float]:
    """Offline throughput of `num_seqs` sequences (see the module docstring)."""
    rng, in_lens, out_lens = offline_lengths(num_seqs, seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in in_lens]
    tables: list[list[int]] = []
    for i, o in zip(in_lens, out_lens, strict=True):
        table: list[int] = []
        assert kv.grow(table, i + o), "cache too small for the offline run"
        tables.append(table)
    max_blocks = max(len(t) for t in tables)
    tables_d = torch.tensor(
        [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=DEVICE
    )
    torch.cuda.synchronize()
    start = time.perf_counter()
    # prefill: whole prompts, packed into steps of at most `prefill_tokens`
    first_tokens = torch.empty(num_seqs, dtype=torch.long, device=DEVICE)
    i = 0
    while i < num_seqs:
        j, total = i, 0
        while j < num_seqs and (j == i or total + in_lens[j] <= prefill_tokens):
            total += in_lens[j]
            j += 1
        meta, positions = build_attention_metadata(
            tables[i:j], [0] * (j - i), in_lens[i:j], BLOCK_SIZE, DEVICE
        )
        ids = torch.tensor([t for p in prompts[i:j] for t in p], device=DEVICE)
        first_tokens[i:j] = model(ids, positions, meta, kv).argmax(-1)
        i = j
    prefill_s = time.perf_counter() - start
    # decode: every unfinished sequence, one token each per step
    active = list(range(num_seqs))
    produced = [1] * num_seqs  # the prefill's token
    cached = torch.tensor(in_lens, dtype=torch.int32, device=DEVICE)  # tokens in the cache
    tokens = first_tokens
    arange = torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE)
    steps = 0
    while True:
        keep = [k for k, s in enumerate(active) if produced[s] < out_lens[s]]
        if not keep:
            break
        if len(keep) != len(active):
            idx = torch.tensor(keep, device=DEVICE)
            cached, tokens, tables_d = cached[idx], tokens[idx], tables_d[idx]
            active = [active[k] for k in keep]
        meta, pos = decode_meta(tables_d, cached, arange)
        logits = graphs(tokens, pos, meta)
        tokens = logits.argmax(-1)
        tokens.tolist()  # the one host sync of the step, as a server streaming tokens does
        cached = cached + 1
        for s in active:
            produced[s] += 1
        steps += 1
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    for t in tables:
        kv.release(t)
    out_total = sum(out_lens)
    return {
        "out_tok_s": out_total / elapsed,
        "seconds": elapsed,
        "prefill_s": prefill_s,
        "in_tokens": sum(in_lens),
        "out_tokens": out_total,
        "decode_steps": steps,
    }


def profile_replay(graphs: Any, kv: ManagedKVCache, prompt: list[int], steps: int = 20) -> None:
    """Per-kernel GPU time of batch-1 graph replays (a 128-token context), largest first."""
    from torch.profiler import ProfilerActivity, profile

    table: list[int] = []
    assert kv.grow(table, len(prompt) + 1)
    graphs.block_tables[0, : len(table)] = torch.tensor(table, dtype=torch.int32)
    graphs.seq_lens[0] = len(prompt) + 1
    graphs.slot_mapping[0] = table[-1] * BLOCK_SIZE + len(prompt) % BLOCK_SIZE
    graphs.positions[0] = len(prompt)
    graph = graphs._graphs[1]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    log(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))
    graphs.slot_mapping.fill_(-1)
    graphs.seq_lens.zero_()
    kv.release(table)


def bench_model(name: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    from turbospark.engine.cuda_graphs import CudaGraphRunner

    config = CONFIGS[name]
    result: dict[str, Any] = {"model": name}
    t0 = time.perf_counter()
    hf = hf_model(config)
    tensors = dict(hf.state_dict())
    max_context = 2048 + BLOCK_SIZE
    model = build_model(config, tensors, DEVICE, torch.bfloat16, max_positions=max_context)
    del tensors
    torch.cuda.synchronize()
    log(f"[{name}] weights ready in {time.perf_counter() - t0:.1f}s")
    result["weight_bytes"] = weight_bytes(model, bool(config["tie_word_embeddings"]))
    result["bound_tok_s"] = bandwidth / result["weight_bytes"]

    blocks_per_seq = math.ceil(max_context / BLOCK_SIZE)
    _, in_lens, out_lens = offline_lengths(args.offline_seqs)
    offline_blocks = sum(math.ceil((i + o) / BLOCK_SIZE) for i, o in zip(in_lens, out_lens, strict=True))
    kv = make_cache(model, offline_blocks + 2 * blocks_per_seq)
    prompt = torch.randint(
        0, config["vocab_size"], (args.prompt_len,), generator=torch.Generator().manual_seed(1)
    )
    prompt_ids = prompt.tolist()

    # logits against transformers on the same weights (bf16 both)
    with torch.inference_mode():
        want = hf(torch.tensor([prompt_ids], device=DEVICE)).logits[0, -1].float()
        table: list[int] = []
        assert kv.grow(table, len(prompt_ids))
        meta, positions = build_attention_metadata([table], [0], [len(prompt_ids)], BLOCK_SIZE, DEVICE)
        got = model(torch.tensor(prompt_ids, device=DEVICE), positions, meta, kv)[0]
        kv.release(table)
    result["logits_max_abs_diff"] = (got - want).abs().max().item()
    result["logits_std"] = want.std().item()
    result["argmax_equal"] = bool(got.argmax() == want.argmax())
    log(
        f"[{name}] logits vs transformers: max abs diff {result['logits_max_abs_diff']:.3g} "
        f"(logit std {result['logits_std']:.3g}), argmax equal {result['argmax_equal']}"
    )

    t0 = time.perf_counter()
    graphs = CudaGraphRunner(model, kv, max_blocks_per_seq=blocks_per_seq)
    graphs.capture()
    log(f"[{name}] captured {len(graphs.batch_sizes)} graphs in {time.perf_counter() - t0:.1f}s")

    turbospark_decode(model, kv, graphs, prompt_ids, 32, overlap=True)  # warm-up
    sync_runs = [
        turbospark_decode(model, kv, graphs, prompt_ids, args.decode_tokens, False) for _ in range(2)
    ]
    runs = [turbospark_decode(model, kv, graphs, prompt_ids, args.decode_tokens, True) for _ in range(3)]
    best = max(runs, key=lambda r: r["tok_s"])
    result["decode_tok_s"] = best["tok_s"]
    result["decode_sync_tok_s"] = max(r["tok_s"] for r in sync_runs)
    result["graph_replay_ms"] = best["replay_ms"]
    result["overlap_tokens_equal_sync"] = all(r["tokens"] == sync_runs[0]["tokens"] for r in runs + sync_runs)
    log(
        f"[{name}] turbospark batch-1 decode: {best['tok_s']:.0f} tok/s "
        f"(runs {', '.join(str(round(r['tok_s'])) for r in runs)}; without overlapping the host's "
        f"sync: {result['decode_sync_tok_s']:.0f}; same tokens: {result['overlap_tokens_equal_sync']}; "
        f"graph replay alone {best['replay_ms']:.3f} ms)"
    )

    for variant in filter(None, args.compare.split(",")):
        # the same loop with part of the small-batch path off, fresh graphs
        from turbospark.engine import cuda_ops

        flag = {"cublas": "small_batch_kernels", "separate-norms": "fuse_norms"}[variant]
        setattr(cuda_ops, flag, False)
        try:
            other = CudaGraphRunner(model, kv, max_blocks_per_seq=blocks_per_seq)
            other.capture()
            turbospark_decode(model, kv, other, prompt_ids, 32, overlap=True)
            other_runs = [
                turbospark_decode(model, kv, other, prompt_ids, args.decode_tokens, True) for _ in range(3)
            ]
        finally:
            setattr(cuda_ops, flag, True)
        other_best = max(other_runs, key=lambda r: r["tok_s"])
        pairs = zip(other_best["tokens"], best["tokens"], strict=True)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), len(best["tokens"]))
        result[f"decode_{variant}"] = {
            "tok_s": other_best["tok_s"],
            "graph_replay_ms": other_best["replay_ms"],
            "same_tokens_prefix": same,
        }
        log(
            f"[{name}] same loop, {variant}: {other_best['tok_s']:.0f} tok/s "
            f"(runs {', '.join(str(round(r['tok_s'])) for r in other_runs)}; graph replay alone "
            f"{other_best['replay_ms']:.3f} ms; the first {same} of {len(best['tokens'])} greedy tokens "
            "equal the default path's)"
        )
        del other
    if args.profile:
        profile_replay(graphs, kv, prompt_ids)
    if args.offline_seqs:
        off = offline(model, kv, graphs, args.offline_seqs, args.prefill_tokens)
        result["offline"] = off
        log(
            f"[{name}] offline {args.offline_seqs} seqs: {off['out_tok_s']:.0f} out tok/s "
            f"({off['out_tokens']} out / {off['in_tokens']} in tokens in {off['seconds']:.1f}s, "
            f"prefill {off['prefill_s']:.1f}s, {off['decode_steps']} decode steps)"
        )
    if not args.skip_hf:
        t0 = time.perf_counter()
        result["hf_decode_tok_s"] = hf_decode(hf, prompt_ids, args.decode_tokens)
        log(
            f"[{name}] transformers static cache + compile: {result['hf_decode_tok_s']:.0f} tok/s "
            f"(incl. compile {time.perf_counter() - t0:.0f}s)"
        )
    del graphs, kv, model, hf
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="qwen2.5-0.5b,llama-3.1-8b", help=f"comma-separated: {', '.join(CONFIGS)}"
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--offline-seqs", type=int, default=256, help="0 skips the offline run")
    parser.add_argument(
        "--prefill-tokens", type=int, default=16384, help="most prompt tokens per prefill step"
    )
    parser.add_argument(
        "--skip-hf", action="store_true", help="skip transformers' decode (its compile is slow)"
    )
    parser.add_argument("--profile", action="store_true", help="print a per-kernel table of batch-1 replays")
    parser.add_argument(
        "--compare",
        default="",
        help="also run batch-1 decode with part of the small-batch path off, comma-separated: "
        "cublas (every matmul on cuBLAS), separate-norms (RMSNorm as its own kernel)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    props = torch.cuda.get_device_properties(DEVICE)
    log(f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
    import transformers

    log(f"torch {torch.__version__}, transformers {transformers.__version__}")
    bandwidth = copy_bandwidth()
    log(f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)")
    results = [bench_model(name.strip(), args, bandwidth) for name in args.models.split(",")]

    log("")
    log(
        f"{'model':<14} {'bound':>7} {'turbospark':>10} {'transformers':>12} "
        f"{'offline out tok/s':>18} {'logit diff':>10}"
    )
    for r in results:
        hf = f"{r['hf_decode_tok_s']:.0f}" if "hf_decode_tok_s" in r else "-"
        off = f"{r['offline']['out_tok_s']:.0f}" if "offline" in r else "-"
        log(
            f"{r['model']:<14} {r['bound_tok_s']:>7.0f} {r['decode_tok_s']:>10.0f} {hf:>12} {off:>18} "
            f"{r['logits_max_abs_diff']:>10.3g}"
        )
    log("(batch-1 decode tok/s after a 128-token prompt; bound = copy bandwidth / weight bytes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "bandwidth": bandwidth, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
