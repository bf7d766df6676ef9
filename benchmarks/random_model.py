"""Write a servable Hugging Face folder with random weights from a real model config.

    python benchmarks/random_model.py --config llama-3.1-8b --out /tmp/rand-llama-8b

For benchmarking the server where no real weights may be fetched. The folder holds what
`turbospark serve --model PATH` loads from any HF checkpoint:

- config.json and *.safetensors: written by transformers' own `save_pretrained` from the model
  class of the config (`bench_gpu.CONFIGS`), random bf16 weights drawn by transformers' init
  (seed 0; on the GPU when there is one: the same tensors `bench_gpu.py` measures);
- tokenizer.json: NOT the model's real tokenizer (that is hub data). A byte-level BPE built here
  with the `tokenizers` library, with exactly the config's vocabulary size, so every id the
  model can emit decodes to text: the 256 byte symbols, then merges that spell every 2- and
  3-letter lowercase string (with and without a leading space) and as many 4-letter ones as
  fill the vocabulary, then the special tokens at the config's bos/eos ids and above. Its
  tokens are 1-4 characters long, so an English prompt's token count is of the same order as a
  real tokenizer's (the measured count is what the server reports);
- tokenizer_config.json (bos/eos and a chat template of the family's format) and
  generation_config.json (the eos ids).

The model's text is random tokens (random weights); what a serving benchmark measures (time to
first token, inter-token latency, throughput) depends on the shapes, not on the words.
"""

from __future__ import annotations

import argparse
import json
import string
import time
from pathlib import Path
from typing import Any

from bench_gpu import CONFIGS

LETTERS = "etaoinsrhldcumfpgwybvkxjqz"
SPACE = "\u0120"  # byte-level BPE's symbol for a space

# special tokens from the family's real tokenizer: (offset from the first special id, text)
SPECIALS = {
    "llama": {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        9: "<|eot_id|>",
    },
    "qwen2": {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"},
}
TEMPLATES = {
    "llama": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "qwen2": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}
BOS_EOS = {"llama": ("<|begin_of_text|>", "<|eot_id|>"), "qwen2": (None, "<|im_end|>")}


def build_tokenizer(vocab_size: int, first_special: int, model_type: str) -> Any:
    """A byte-level BPE of exactly `vocab_size` ids, specials from `first_special` on."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []

    def add(prefix: str, last: str) -> bool:
        if len(vocab) >= first_special:
            return False
        token = prefix + last
        if token not in vocab:
            merges.append((prefix, last))
            vocab[token] = len(vocab)
        return True

    heads = [SPACE, *LETTERS, *string.ascii_uppercase]
    level = [h + c for h in heads for c in LETTERS]
    for token in level:
        add(token[:-1], token[-1])
    while len(vocab) < first_special:  # 3 letters, then 4, ... until the vocabulary is full
        level = [p + c for p in level for c in LETTERS]
        for token in level:
            if not add(token[:-1], token[-1]):
                break
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    named = SPECIALS[model_type]
    specials = [
        AddedToken(named.get(i, f"<|reserved_special_token_{i}|>"), special=True)
        for i in range(vocab_size - first_special)
    ]
    tokenizer.add_special_tokens(specials)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    return tokenizer


def write_folder(name: str, out: Path) -> None:
    import torch
    import transformers

    config: dict[str, Any] = dict(CONFIGS[name])
    model_type = config["model_type"]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    kind = {"llama": "Llama", "qwen2": "Qwen2"}[model_type]
    hf_config = getattr(transformers, f"{kind}Config")(**config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with device:
        model = getattr(transformers, f"{kind}ForCausalLM")._from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="5GB")
    del model
    print(f"weights written in {time.perf_counter() - t0:.1f}s", flush=True)

    first_special = min(config["bos_token_id"], config["eos_token_id"])
    tokenizer = build_tokenizer(config["vocab_size"], first_special, model_type)
    tokenizer.save(str(out / "tokenizer.json"))
    bos, eos = BOS_EOS[model_type]
    eos_ids = sorted({config["eos_token_id"], tokenizer.token_to_id(eos)})
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos, "chat_template": TEMPLATES[model_type]}, indent=2)
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}, indent=2))
    print(f"{out}: {name} config, random weights, a {config['vocab_size']}-id byte-level BPE", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    write_folder(args.config, args.out)


if __name__ == "__main__":
    main()
