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
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import textwrap

import torch

from turbospark.backend import NEVER_CANCEL, GenerationConfig
from turbospark.engine.backend import load_backend
from turbospark.engine.draft import DraftProposer
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder:0.5b")
    parser.add_argument("--modes", default="off,ngram,suffix")
    parser.add_argument("--workloads", default="edit,tool,free,translate")
    parser.add_argument("--max-tokens", type=int, default=700)
    parser.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig().num_tokens)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--draft-model", default=None, help="mode 'draft' drafts with this model")
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
    tok = backend.tokenizer
    (im_end,) = tok.encode("<|im_end|>")
    print(
        f"# {args.model} on {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    print("# mode     workload  tokens  decode tok/s  vs off  accepted/proposed  same text as off")
    modes = args.modes.split(",")
    earlier: list[list[int]] = []
    for name in args.workloads.split(","):
        prompt = tok.encode(workloads()[name])
        config = GenerationConfig(
            max_new_tokens=args.max_tokens, temperature=0.0, stop_token_ids=frozenset({im_end})
        )
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
                        ),
                        model=args.model,
                    )
                    speculator.proposer = DraftProposer(draft_runner, max_seqs=1)
                elif mode != "off":
                    speculator = Speculator(
                        SpeculativeConfig(method=mode, num_tokens=args.num_speculative_tokens),
                        model=args.model,
                    )
                    if mode == "suffix":  # earlier responses: the previous workloads' (not this one's)
                        for ids in earlier:
                            speculator.proposer.responses.add(ids)  # type: ignore[attr-defined]
                engine.speculator = speculator
                # later modes hit the prefix cache: only the decode (first token to last) is timed
                result = engine.run([*prompt], config, NEVER_CANCEL, lambda _: None)
                n = len(result.token_ids)
                rates[mode].append((n - 1) / result.decode_seconds if result.decode_seconds > 0 else 0.0)
                texts.setdefault(mode, result.token_ids)
                if speculator is not None:
                    counts[mode] = (speculator.num_accepted, speculator.num_proposed)
        engine.speculator = None
        earlier.append(texts[modes[0]])
        base = statistics.median(rates["off"]) if "off" in rates else None
        for mode in modes:
            rate = statistics.median(rates[mode])
            ratio = f"{rate / base:5.2f}x" if base else "  -  "
            acc = "{}/{}".format(*counts[mode]) if mode in counts else "-"
            same = "-" if mode == "off" or "off" not in texts else str(texts[mode] == texts["off"])
            print(f"  {mode:8s} {name:8s} {len(texts[mode]):6d}  {rate:12.1f}  {ratio}  {acc:>17s}  {same}")


if __name__ == "__main__":
    main()
