"""Cost of the lazy tool-call constraint (tool_choice auto) on Qwen2.5-Coder-0.5B's tokenizer
with Claude Code's 24 recorded tool schemas (benchmarks/data/claude_code_session.json).

Reports: compiling the call grammars for the tool set (first request, then a request with the
same tools, which the cache answers), the processor's cost per token in the free phase (prose:
a token-id check, plus a short decode while the answer could still open a bare call), and per
token once a call has started (advance the matcher, compute the mask, apply it to 151k logits),
for a tagged `<tool_call>` Bash call and a fenced bare one.

    PYTHONPATH=src python benchmarks/bench_lazy_calls.py [--model qwen2.5-coder:0.5b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from turbospark.grammar import LazyToolCallProcessor, _lazy_cache, lazy_call_grammars
from turbospark.request import Tool
from turbospark.toolcalls import detect_family

DATA = Path(__file__).resolve().parent / "data" / "claude_code_session.json"
CALL = '{"name": "Bash", "arguments": {"command": "cat notes.txt", "description": "Show notes.txt"}}'
ANSWERS = {
    "prose (free)": "The file notes.txt holds one line: turbospark-notes-4711. Nothing else is in it, "
    "so there is nothing more to do here.",
    "tagged call": f"<tool_call>\n{CALL}\n</tool_call>",
    "fenced call": f"```json\n{CALL}\n```",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder:0.5b")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from turbospark.engine.backend import load_backend

    backend = load_backend(args.model, progress=False)
    tokenizer, vocab = backend.tokenizer, max(backend.vocab_size, backend.tokenizer.vocab_size)
    body = json.loads(DATA.read_text())[0]["body"]
    tools = [Tool(t["name"], t.get("description", ""), t["input_schema"]) for t in body["tools"]]
    template = tokenizer.chat_template
    family = detect_family(template)
    timings = []
    for _ in range(2):
        _lazy_cache.clear()
        t0 = time.perf_counter()
        grammars = lazy_call_grammars(tokenizer, vocab, family, tools, True, template, bare=True)
        timings.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    grammars = lazy_call_grammars(tokenizer, vocab, family, tools, True, template, bare=True)
    cached = time.perf_counter() - t0
    assert grammars is not None
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {len(tools)} tools, family {family.value}")
    print(
        f"compile call grammars: {min(timings) * 1e3:.1f} ms; "
        f"same tools again (cached): {cached * 1e3:.2f} ms"
    )
    print(f"{'answer':<16}{'tokens':>7}{'masked':>7}{'us/token all':>14}{'us/masked token':>17}")
    eos = tokenizer.eos_token_ids
    for label, text in ANSWERS.items():
        ids = tokenizer.encode(text)
        per_token, per_mask = [], []
        for _ in range(args.repeat):
            proc = LazyToolCallProcessor(grammars, tokenizer, vocab, eos)
            logits = torch.zeros(vocab)
            t0 = time.perf_counter()
            for i in range(len(ids) + 1):
                proc(ids[:i], logits)
            per_token.append((time.perf_counter() - t0) / (len(ids) + 1))
            if proc.num_masked:
                per_mask.append(proc.mask_seconds / proc.num_masked)
            assert (proc.trigger is not None) == (label != "prose (free)"), (label, proc.trigger)
        mask = f"{statistics.median(per_mask) * 1e6:>17.0f}" if per_mask else f"{'-':>17}"
        print(
            f"{label:<16}{len(ids):>7}{proc.num_masked:>7}{statistics.median(per_token) * 1e6:>14.0f}{mask}"
        )


if __name__ == "__main__":
    main()
