"""Speculative decoding on the CPU: draftless proposers against plain decoding, same run.

Workloads (greedy, batch 1, the served engine of a pulled model):

- edit: the model is given a Python file of ~120 lines and asked to return it whole with one
  change (a function renamed), the way an agent re-emits a file it edits;
- tool: an agent turn whose answer repeats an earlier tool call's JSON with one argument changed;
- free: free text that does not copy its prompt (a short essay);
- translate: a paragraph translated into French, which copies neither the prompt's words nor its
  own (few drafts match: what speculation costs where it does not pay).

For each workload, speculation off and each proposer run back to back on one loaded model
(`--rounds` times, round robin, the median kept), so load from other processes hits every mode
alike. Reported: decode tokens/s (from the engine's first token to its last), its ratio to off,
the drafts' acceptance, and whether the greedy text equals off's token for token.

    python benchmarks/bench_speculative.py --model qwen2.5-coder:0.5b
    python benchmarks/bench_speculative.py --model qwen2.5-coder:1.5b --max-tokens 400
    python benchmarks/bench_speculative.py --device cuda  # a GPU: extra verify rows nearly free
    python benchmarks/bench_speculative.py --model qwen2.5-coder:1.5b --modes off,ngram,draft \
        --draft-model qwen2.5-coder:0.5b

The machine's CPU is shared and noisy: compare ratios within one run only.

On a GPU, random weights (`benchmarks/random_model.py`) cannot measure acceptance: their greedy
text copies nothing. There the workloads are replayed: `--record FILE` (on the CPU, a pulled
model) writes each workload's prompt ids and greedy output ids; `--replay FILE` (on the GPU, a
random folder of a config with the same vocabulary, e.g. qwen2.5-0.5b or qwen2.5-7b) feeds the
recorded prompt and forces the recorded output as the target's continuation: after each forward
the runner's logits rows are replaced by a one-hot at the recorded token of their position, so
the n-gram proposer drafts from the real context and is accepted exactly where it would be on the
real model, while every forward (plain decode, and the verification of 1 + k positions) costs
what it costs on that GPU. Both modes pay the same replacement. `--batch N` runs N copies of each
workload at once (throughput over all N; above the speculator's `max_batch` decoding sequences a
step does not speculate).

    python benchmarks/bench_speculative.py --model qwen2.5-coder:0.5b --max-tokens 300 \
        --modes off --record benchmarks/data/speculative_replay.json
    python benchmarks/bench_speculative.py --model /tmp/rand-qwen-7b --device cuda \
        --replay benchmarks/data/speculative_replay.json --modes off,ngram --batch 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from turbospark.backend import NEVER_CANCEL, CompletionResult, GenerationConfig
from turbospark.engine.backend import load_backend
from turbospark.engine.draft import DraftProposer
from turbospark.engine.engine import StepOutput
from turbospark.engine.runner import ModelRunner
from turbospark.engine.scheduler import ScheduledBatch
from turbospark.engine.speculative import SpeculativeConfig, Speculator


def python_file(num_functions: int = 14) -> str:
    """A plausible module of ~120 lines (deterministic)."""
    parts = [
        '"""Inventory helpers for a small warehouse service."""',
        "",
        "from __future__ import annotations",
        "",
    ]
    parts += ["import math", "from dataclasses import dataclass", "", ""]
    parts += ["@dataclass", "class Item:", "    name: str", "    quantity: int", "    price: float", "", ""]
    for i in range(num_functions):
        body = textwrap.dedent(
            f'''
            def total_value_{i}(items: list[Item], discount: float = 0.{i % 9 + 1}) -> float:
                """Value of the items in bin {i}, after a discount of {i % 9 + 1}0 percent."""
                value = 0.0
                for item in items:
                    if item.quantity > {i}:
                        value += item.quantity * item.price
                return math.floor(value * (1.0 - discount) * 100) / 100
            '''
        ).strip("\n")
        parts += [*body.splitlines(), "", ""]
    return "\n".join(parts).rstrip() + "\n"


def chatml(system: str, turns: list[tuple[str, str]]) -> str:
    out = f"<|im_start|>system\n{system}<|im_end|>\n"
    for role, text in turns:
        out += f"<|im_start|>{role}\n{text}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


def workloads() -> dict[str, str]:
    system = "You are a careful coding assistant."
    source = python_file()
    edit = chatml(
        system,
        [
            (
                "user",
                "Here is inventory.py:\n```python\n" + source + "```\n"
                "Rename the function `total_value_7` to `bin_seven_value`. Reply with the whole "
                "updated file in one python code block and nothing else.",
            )
        ],
    )
    call = {
        "name": "edit_file",
        "arguments": {
            "path": "src/warehouse/inventory.py",
            "old_string": "def total_value_7(items: list[Item], discount: float = 0.8) -> float:",
            "new_string": "def bin_seven_value(items: list[Item], discount: float = 0.8) -> float:",
            "replace_all": False,
        },
    }
    tool = chatml(
        system + ' Call tools by answering with one JSON object {"name": ..., "arguments": ...}.',
        [
            ("user", "Rename total_value_7 to bin_seven_value in src/warehouse/inventory.py."),
            ("assistant", json.dumps(call, indent=2)),
            (
                "user",
                "The tool failed: the file is locked. Make exactly the same call again, "
                "but with the path src/warehouse/inventory_v2.py. Answer with the JSON only.",
            ),
        ],
    )
    free = chatml(
        "You are a helpful assistant.",
        [
            (
                "user",
                "Write a short essay (about 300 words) on why lighthouses were built where they "
                "were, and what replaced their keepers.",
            )
        ],
    )
    translate = chatml(
        "You are a helpful assistant.",
        [
            (
                "user",
                "Translate into French, and answer with the translation only:\n\n"
                "The harbour master walked along the breakwater every morning before dawn. He "
                "counted the fishing boats, noted which had not come back, and wrote the weather "
                "in a ledger his grandfather had started. When the radio tower was built, the "
                "town council voted to keep the ledger in the library, where children still read "
                "the entries about storms, lost nets, and the winter the bay froze solid.",
            )
        ],
    )
    return {"edit": edit, "tool": tool, "free": free, "translate": translate}


def force_replay(runner: ModelRunner, outputs: dict[tuple[int, ...], list[int]]) -> Callable[[], None]:
    """Makes `runner` emit each sequence's recorded output (`--replay`): its logits rows become a
    one-hot at the recorded token of their position, found by the sequence's prompt. Returns the
    undo."""
    plain = runner.execute

    @torch.inference_mode()
    def execute(batch: ScheduledBatch, *, want_ids: bool = False) -> StepOutput:
        step = runner.step_inputs(batch)
        out = runner.run_step(step, want_ids=False)
        counts = step.num_logits or [1] * len(step.sample_rows)
        targets: list[int] = []
        for r, c in zip(step.sample_rows, counts, strict=True):
            seq = batch.seqs[r]
            recorded = outputs[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            end = step.num_cached[r] + step.num_new[r]  # positions before this one's next token
            for j in range(c):
                g = end - c + j + 1 - seq.num_prompt_tokens  # the generated index it predicts
                targets.append(recorded[g] if 0 <= g < len(recorded) else recorded[-1])
        logits = out.logits
        logits.fill_(0.0)
        index = torch.tensor(targets, dtype=torch.long, device=logits.device)
        logits.scatter_(1, index[:, None], 1.0)
        return StepOutput(logits, targets if want_ids else None)

    runner.execute = execute  # type: ignore[method-assign]

    def undo() -> None:
        runner.execute = plain  # type: ignore[method-assign]

    return undo


def format_profile(summary: dict[str, dict[str, Any]]) -> str:
    """`--profile`: per step kind, steps, mean ms a step, and its parts' mean ms."""
    out = []
    for kind, row in summary.items():
        if kind == "all":
            continue
        parts = ", ".join(f"{k} {v:.1f}" for k, v in row["ms"].items() if v >= 0.05)
        out.append(f"{kind}: {row['steps']} steps, {row['total_ms']:.1f} ms ({parts})")
    return "; ".join(out)


def run_batch(
    engine: Any, prompt: list[int], config: GenerationConfig, batch: int
) -> tuple[list[int], float]:
    """`batch` copies of one request at once: the first's tokens, and output tok/s over all."""
    results: list[CompletionResult | None] = [None] * batch

    def one(i: int) -> None:
        results[i] = engine.run([*prompt], config, NEVER_CANCEL, lambda _: None)

    if batch == 1:
        one(0)
        (result,) = results
        assert result is not None
        n = len(result.token_ids)
        return result.token_ids, (n - 1) / result.decode_seconds if result.decode_seconds > 0 else 0.0
    threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]

    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    done = [r for r in results if r is not None]
    return done[0].token_ids, sum(len(r.token_ids) for r in done) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder:0.5b")
    parser.add_argument("--modes", default="off,ngram,suffix")
    parser.add_argument("--workloads", default="edit,tool,free,translate")
    parser.add_argument("--max-tokens", type=int, default=700)
    parser.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig().num_tokens)
    parser.add_argument("--max-batch", type=int, default=SpeculativeConfig().max_batch)
    parser.add_argument(
        "--max-rows",
        type=int,
        default=None,
        help="rows a speculating step may feed (default: as serve, 8 on the CPU, none on a GPU; 0: none)",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--draft-model", default=None, help="mode 'draft' drafts with this model")
    parser.add_argument("--record", help="write each workload's prompt and first mode's output ids here")
    parser.add_argument("--replay", help="force the outputs recorded in this file (see the docstring)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print each mode's engine step split (decode / verify steps: ms a step, forward ms)",
    )
    parser.add_argument("--batch", default="1", help="comma-separated: copies of each request at once")
    args = parser.parse_args()

    backend = load_backend(args.model, device=args.device, progress=False)
    draft_runner = None
    if args.draft_model:
        draft = load_backend(
            args.draft_model,
            device=args.device,
            progress=False,
            max_context=backend.max_context,
            kv_sequences=1,
        )
        draft_runner = draft.runner
    engine = backend.engine
    max_rows = args.max_rows if args.max_rows is not None else (8 if args.device == "cpu" else 0)
    recorded: dict[str, dict[str, list[int]]] = {}
    if args.replay:
        with open(args.replay) as f:
            recorded = json.load(f)
        prompts = {name: w["prompt_ids"] for name, w in recorded.items()}
        force_replay(backend.runner, {tuple(w["prompt_ids"]): w["output_ids"] for w in recorded.values()})
        stop: frozenset[int] = frozenset()
    else:
        tok = backend.tokenizer
        (im_end,) = tok.encode("<|im_end|>")
        prompts = {name: tok.encode(text) for name, text in workloads().items()}
        stop = frozenset({im_end})
    device = (
        torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda")
        else (platform.processor() or platform.machine())
    )
    print(
        f"# {args.model} on {device}, {torch.get_num_threads()} threads"
        + (" (replayed)" if args.replay else "")
    )
    print("# mode     workload  batch  tokens  tok/s  vs off  accepted/proposed  same text as off")
    modes = args.modes.split(",")
    earlier: list[list[int]] = []
    for name in args.workloads.split(","):
        if name not in prompts:
            continue
        prompt = prompts[name]
        max_tokens = len(recorded[name]["output_ids"]) if args.replay else args.max_tokens
        config = GenerationConfig(max_new_tokens=max_tokens, temperature=0.0, stop_token_ids=stop)
        for batch in [int(b) for b in args.batch.split(",")]:
            rates: dict[str, list[float]] = {m: [] for m in modes}
            texts: dict[str, list[int]] = {}
            counts: dict[str, tuple[int, int]] = {}
            for _ in range(args.rounds):
                for mode in modes:
                    speculator = None
                    if mode == "draft":
                        assert draft_runner is not None, "mode draft needs --draft-model"
                        speculator = Speculator(
                            SpeculativeConfig(
                                method="draft",
                                draft_model=args.draft_model,
                                num_tokens=args.num_speculative_tokens,
                                max_batch=args.max_batch,
                                max_rows=max_rows or None,
                            ),
                            model=args.model,
                        )
                        speculator.proposer = DraftProposer(draft_runner, max_seqs=1)
                    elif mode != "off":
                        speculator = Speculator(
                            SpeculativeConfig(
                                method=mode,
                                num_tokens=args.num_speculative_tokens,
                                max_batch=args.max_batch,
                                max_rows=max_rows or None,
                            ),
                            model=args.model,
                        )
                        if mode == "suffix":  # earlier responses: the previous workloads' (not this one's)
                            for ids in earlier:
                                speculator.proposer.responses.add(ids)  # type: ignore[attr-defined]
                    engine.speculator = speculator
                    if args.profile:
                        engine.enable_profile(1 << 30)
                    # later modes hit the prefix cache: only the decode (first token to last) is timed
                    ids, rate = run_batch(engine, prompt, config, batch)
                    rates[mode].append(rate)
                    if args.profile and engine.profile is not None:
                        print(f"#   {mode:<8} {name:<9} {format_profile(engine.profile.summary())}")
                        engine.profile = None
                    texts.setdefault(mode, ids)
                    if speculator is not None:
                        counts[mode] = (speculator.num_accepted, speculator.num_proposed)
            engine.speculator = None
            earlier.append(texts[modes[0]])
            if args.record and name not in recorded:
                recorded[name] = {"prompt_ids": list(prompt), "output_ids": texts[modes[0]]}
            base = statistics.median(rates["off"]) if "off" in rates else None
            for mode in modes:
                rate = statistics.median(rates[mode])
                ratio = f"{rate / base:5.2f}x" if base else "  -  "
                acc = "{}/{}".format(*counts[mode]) if mode in counts else "-"
                same = "-" if mode == "off" or "off" not in texts else str(texts[mode] == texts["off"])
                print(
                    f"  {mode:8s} {name:9s} {batch:5d}  {len(texts[mode]):6d}  {rate:7.1f}  {ratio}"
                    f"  {acc:>17s}  {same}",
                    flush=True,
                )
    if args.record:
        with open(args.record, "w") as f:
            json.dump(recorded, f)


if __name__ == "__main__":
    main()
