"""A tiny random-weight BERT with a real WordPiece tokenizer, for the embedding tests.

Shaped like all-MiniLM-L6-v2's config (absolute positions, gelu, two token types), shrunk so a
forward runs in milliseconds. The tokenizer is built with `tokenizers` the way BERT's is: a
lowercasing BertNormalizer, BertPreTokenizer, WordPiece over a small vocabulary and the
`[CLS] $A [SEP]` template; its tokenizer.json is saved with a training-time truncation and
padding on, as real ones often are, so a test can show they are not applied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

_WORD_LIST = (
    "the a an cat cats feline dog dogs stock stocks market price sat on mat is was it and of to in "
    "quick brown fox jumps over lazy eating food man woman car road red blue green sun moon sky "
    "##s ##ing ##ed ##ly"
)
WORDS = _WORD_LIST.split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = {tok: i for i, tok in enumerate(SPECIAL + WORDS + [c for c in "abcdefghijklmnopqrstuvwxyz.,!?"])}

TINY_BERT: dict[str, Any] = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "vocab_size": len(VOCAB),
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "position_embedding_type": "absolute",
    "pad_token_id": 0,
}


def bert_tokenizer() -> Tokenizer:
    tok = Tokenizer(WordPiece(VOCAB, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.decoder = decoders.WordPiece()
    tok.enable_truncation(max_length=8)  # like real tokenizer.json files: must not be applied
    tok.enable_padding(length=8)
    return tok


def reference_bert(config: dict[str, Any] = TINY_BERT, seed: int = 0) -> Any:
    """transformers' BertModel with random weights (norms and biases randomized too), fp32, eval."""
    import transformers

    hf_config = transformers.BertConfig(**config)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.BertModel(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def write_bert_folder(folder: Path, pooling: str = "mean", seed: int = 0) -> Path:
    """A sentence-transformers style folder: config.json, model.safetensors, tokenizer.json,
    modules.json and 1_Pooling/config.json (the old flag format)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = reference_bert(seed=seed)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(TINY_BERT))
    bert_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64, "do_lower_case": True}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {
        "word_embedding_dimension": TINY_BERT["hidden_size"],
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": pooling == "mean_sqrt_len",
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    return folder
