"""Cost of a grammar mask per decoded token, against unconstrained decoding.

For each workload (a JSON schema response format, and a Hermes tool call with two tools) a valid
output is tokenized, then replayed token by token. Per token it times:

- `sample`: turbospark's unconstrained sampler step on (vocab,) logits (temperature + top-p),
- `llguidance`: the `GrammarProcessor` turbospark uses (advance the matcher, compute the mask,
  apply it to the logits) plus the same sampler step,
- `xgrammar` and `outlines-core`, if importable: their matcher advance + mask + apply + sample,
- `model step` (with --model-step): one cached decode step of a random-weight model with
  Qwen2.5-0.5B's shapes, for scale.

Grammar compile time (per request) is reported beside. Without --tokenizer, a byte-level BPE with
a 151k vocabulary (Qwen2.5's size) is trained once on the Python standard library and cached.

    PYTHONPATH=src python benchmarks/bench_grammar.py --threads 1 [--model-step] [--tokenizer tokenizer.json]

Measured on a 2-core x86_64 CPU (shared, load ~4), torch 2.13 CPU, --threads 1, 151k-token BPE,
llguidance 1.9.1, xgrammar 0.2.9, outlines-core 0.2.14 (the last two installed only to compare):

    workload     per token                              us/token  compile ms
    json_schema  unconstrained sample, greedy              427.5         0.0
    json_schema  unconstrained sample, t=0.7 top_p=0.9    20371.8         0.0
    json_schema  mask: llguidance (turbospark)             202.5         2.7
    json_schema  mask: xgrammar                            836.9        55.9
    json_schema  mask: outlines-core                      5961.3      3490.3
    tool_call    unconstrained sample, greedy              450.1         0.0
    tool_call    unconstrained sample, t=0.7 top_p=0.9    20213.2         0.0
    tool_call    mask: llguidance (turbospark)             307.1         3.0
    tool_call    mask: xgrammar                            838.7       154.1
    -            decode step, Qwen2.5-0.5B shapes (fp32)   233701.0         0.0

The llguidance token trie is built once per model (1.4 s for 151k tokens). The mask adds about
0.2-0.3 ms per token: under half a greedy sampler step and about 0.1 % of a 0.5B model's decode
step on this CPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sysconfig
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import tokenizers
import torch

from turbospark.backend import GenerationConfig
from turbospark.grammar import (
    GrammarProcessor,
    _json_rule,
    _Lark,
    ll_tokenizer,
    make_matcher,
    tool_call_grammar,
)
from turbospark.request import Tool
from turbospark.sampling import make_generator, sample
from turbospark.tokenizer import Tokenizer
from turbospark.toolcalls import ToolFamily

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "days", "unit"],
}
SCHEMA_OUTPUT = json.dumps(
    {
        "city": "San Francisco",
        "country": "United States of America",
        "days": 7,
        "unit": "fahrenheit",
        "hourly": True,
        "fields": ["temperature", "precipitation_probability", "wind_speed", "humidity"],
    },
    indent=2,
)
TOOLS = [
    Tool("get_weather", parameters=SCHEMA),
    Tool(
        "search_files",
        parameters={
            "type": "object",
            "properties": {"pattern": {"type": "string"}, "max_results": {"type": "integer"}},
            "required": ["pattern"],
        },
    ),
]
TOOL_OUTPUT = (
    "<tool_call>\n"
    + json.dumps({"name": "get_weather", "arguments": json.loads(SCHEMA_OUTPUT)})
    + "\n</tool_call>"
)


def bench_tokenizer(path: str | None) -> Tokenizer:
    if path is None:
        path = os.path.join(tempfile.gettempdir(), "turbospark-bench-bpe151k.json")
        if not os.path.exists(path):
            print("training a 151k byte-level BPE on the Python standard library (once, ~1.5 min) ...")
            hf = tokenizers.Tokenizer(tokenizers.models.BPE())
            hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
            hf.decoder = tokenizers.decoders.ByteLevel()
            trainer = tokenizers.trainers.BpeTrainer(
                vocab_size=151_000,
                initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                show_progress=False,
            )

            def texts() -> Any:
                for name in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True)):
                    try:
                        with open(name, encoding="utf-8") as fh:
                            yield fh.read()
                    except (UnicodeDecodeError, OSError):
                        continue

            hf.train_from_iterator(texts(), trainer=trainer)
            hf.add_tokens(
                [tokenizers.AddedToken(t, normalized=False) for t in ("<tool_call>", "</tool_call>")]
            )
            hf.save(path)
        hf = tokenizers.Tokenizer.from_file(path)
    else:
        hf = tokenizers.Tokenizer.from_file(path)
    eos = hf.token_to_id("<|im_end|>") or hf.token_to_id("<|endoftext|>") or 0
    return Tokenizer(hf, {"eos_token_ids": [eos]})


def timeit(fn: Callable[[], None], repeat: int) -> float:
    """Median seconds of `repeat` runs of fn (fn replays a whole output)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", help="a tokenizer.json (default: a trained 151k BPE)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--model-step", action="store_true", help="also time a 0.5B-shaped model decode step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = bench_tokenizer(args.tokenizer)
    vocab = tokenizer.vocab_size
    print(
        f"hardware: {platform.machine()} {os.cpu_count()} cores, torch threads {args.threads}; vocab {vocab}"
    )
    greedy = GenerationConfig(max_new_tokens=1, temperature=0.0)
    nucleus = GenerationConfig(max_new_tokens=1, temperature=0.7, top_p=0.9, seed=0)
    gen = make_generator(0)
    logits_rows = torch.randn(64, vocab)

    def sampler_only(ids: list[int], config: GenerationConfig) -> None:
        for i in range(len(ids)):
            sample(logits_rows[i % 64].clone(), config, gen, (), ())

    t0 = time.perf_counter()
    ll_tokenizer(tokenizer, vocab)
    print(f"llguidance tokenizer (token trie) built once per model in {time.perf_counter() - t0:.2f} s")

    workloads = []
    g = _Lark(tokenizer)
    g.rule(f"{_json_rule(SCHEMA)}", "start")
    workloads.append(("json_schema", g.text(), SCHEMA_OUTPUT))
    g = _Lark(tokenizer)
    g.rule(tool_call_grammar(g, ToolFamily.HERMES, TOOLS, False, None), "start")
    workloads.append(("tool_call", g.text(), TOOL_OUTPUT))

    rows: list[tuple[str, str, float, float]] = []
    for name, grammar, output in workloads:
        ids = tokenizer.encode(output)
        n = len(ids)
        for label, cfg in (("greedy", greedy), ("t=0.7 top_p=0.9", nucleus)):
            us = timeit(lambda ids=ids, cfg=cfg: sampler_only(ids, cfg), args.repeat) / n * 1e6
            rows.append((name, f"unconstrained sample, {label}", us, 0.0))

        t0 = time.perf_counter()
        matcher = make_matcher(grammar, tokenizer, vocab, "bench")
        compile_s = time.perf_counter() - t0
        template = GrammarProcessor(matcher, vocab, tokenizer.eos_token_ids)
        assert template.matcher.try_consume_tokens(ids) == n, "the output must fit the grammar"

        rows_clone = [logits_rows[i % 64].clone() for i in range(n)]

        def run_llg(
            ids: list[int] = ids,
            template: GrammarProcessor = template,
            rows_clone: list[torch.Tensor] = rows_clone,
        ) -> None:
            proc = template.fork()
            for i in range(len(ids)):
                logits = rows_clone[i]
                proc(ids[:i], logits)
            assert torch.isfinite(rows_clone[-1][ids[-1]])

        us = timeit(run_llg, args.repeat) / n * 1e6
        rows.append((name, "mask: llguidance (turbospark)", us, compile_s * 1e3))
        rows += other_libraries(name, tokenizer, ids, logits_rows, args.repeat)
        print(f"{name}: {n} tokens")

    if args.model_step:
        step = model_step_seconds(args.threads)
        rows.append(("-", "decode step, Qwen2.5-0.5B shapes (fp32)", step * 1e6, 0.0))

    print(f"\n{'workload':<12} {'per token':<36} {'us/token':>10} {'compile ms':>11}")
    for name, what, us, compile_ms in rows:
        print(f"{name:<12} {what:<36} {us:>10.1f} {compile_ms:>11.1f}")


def other_libraries(
    name: str, tokenizer: Tokenizer, ids: list[int], logits_rows: torch.Tensor, repeat: int
) -> list[tuple[str, str, float, float]]:
    """The same replay through xgrammar and outlines-core (mask + apply), where installed."""
    rows: list[tuple[str, str, float, float]] = []
    n = len(ids)
    vocab = tokenizer.vocab_size
    try:
        import transformers
        import xgrammar as xgr
    except ImportError:
        xgr = None
    if xgr is not None:
        hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tok, vocab_size=vocab, stop_token_ids=sorted(tokenizer.eos_token_ids)
        )
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        if name == "json_schema":
            compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
        else:
            compiled = compiler.compile_structural_tag(
                [
                    xgr.StructuralTagItem(
                        begin='<tool_call>\n{"name": "' + t.name + '", "arguments": ',
                        schema=json.dumps(t.parameters),
                        end="}\n</tool_call>",
                    )
                    for t in TOOLS
                ],
                ["<tool_call>"],
            )
        compile_s = time.perf_counter() - t0
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def run_xgr() -> None:
            matcher = xgr.GrammarMatcher(compiled)
            for i in range(n):
                logits = logits_rows[i % 64].clone().unsqueeze(0)
                matcher.fill_next_token_bitmask(bitmask)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
                assert matcher.accept_token(ids[i])

        try:
            rows.append((name, "mask: xgrammar", timeit(run_xgr, repeat) / n * 1e6, compile_s * 1e3))
        except AssertionError:
            rows.append((name, "xgrammar: output rejected", float("nan"), compile_s * 1e3))
    try:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        oc = None
    if oc is not None and name == "json_schema":
        byte_of = {ch: b for b, ch in enumerate(_byte_alphabet())}
        pieces: dict[bytes, list[int]] = {}
        eos = min(tokenizer.eos_token_ids)
        for token, tid in tokenizer.hf.get_vocab().items():
            if tid == eos:
                continue
            raw = bytes(byte_of[c] for c in token) if all(c in byte_of for c in token) else token.encode()
            pieces.setdefault(raw, []).append(tid)
        t0 = time.perf_counter()
        index = oc.Index(
            build_regex_from_schema(json.dumps(SCHEMA), r"[\n ]{0,24}"), oc.Vocabulary(eos, pieces)
        )
        compile_s = time.perf_counter() - t0

        def run_oc() -> None:
            guide = oc.Guide(index)
            for i in range(n):
                logits = logits_rows[i % 64].clone()
                allowed = torch.tensor(guide.get_tokens(), dtype=torch.long)
                keep = logits.index_select(0, allowed)
                logits.fill_(float("-inf")).index_copy_(0, allowed, keep)
                guide.advance(ids[i])

        rows.append((name, "mask: outlines-core", timeit(run_oc, repeat) / n * 1e6, compile_s * 1e3))
    return rows


def _byte_alphabet() -> list[str]:
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def model_step_seconds(threads: int) -> float:
    """One cached decode step of a random-weight model with Qwen2.5-0.5B's shapes (fp32, CPU)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.inference_mode():
        out = model(torch.tensor([list(range(64))]), use_cache=True)
        past = out.past_key_values
        token = torch.tensor([[42]])
        times = []
        for _ in range(12):
            t0 = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
