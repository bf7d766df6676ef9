"""Build a Hugging Face `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata, and cache it.

Contract: `load_gguf_tokenizer(gguf_file) -> (Tokenizer, tokenizer_config)`. The tokenizer encodes
and decodes to the same ids as transformers' GGUF tokenizer for the same file (the tests check
this on a mixed corpus); `tokenizer_config` is tokenizer_config.json-style (chat_template,
bos/eos/pad/unk tokens, add_bos_token) plus "eos_token_ids", every id that ends generation.

Supported `tokenizer.ggml.model`s: "gpt2" (byte-level BPE; the pre-tokenizer split comes from
`tokenizer.ggml.pre`) and "llama" (SentencePiece-style BPE with byte fallback, merges recovered
from the token scores). Building one from 150k tokens and merges takes about a second, so the
result is cached as tokenizer.json + tokenizer_config.json under `cache_dir()/tokenizers/<key>`,
keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from turbospark.engine.checkpoint import ModelLoadError, cache_dir

if TYPE_CHECKING:
    from turbospark.engine.gguf_file import GGUFFile

# Bump when the built tokenizer changes, so stale cache entries are rebuilt.
CACHE_FORMAT = 1

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Texts of control tokens that end a turn even when the file's eos id names another token
# (llama.cpp treats the same set as end-of-generation).
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<｜end▁of▁sentence｜>",
    }
)

# Pre-tokenizer split regexes, by the family of `tokenizer.ggml.pre` values llama.cpp assigns them.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Vocabularies trained with single digits (StarCoder's lineage, SmolLM): digits first, then GPT-2.
_DIGIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen", "megrez"})
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"})
_GPT4O_PRE = frozenset({"gpt-4o", "llama4"})


@cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies are spelled in it)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_pre_tokenizer(pre: str) -> dict[str, Any]:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    if pre in _DIGIT_PRE:
        return {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {**byte_level, "use_regex": True},
            ],
        }
    split = None
    if pre in _QWEN2_PRE:
        split = _QWEN2_SPLIT
    elif pre in _LLAMA3_PRE:
        split = _LLAMA3_SPLIT
    elif pre in _GPT4O_PRE:
        split = _GPT4O_SPLIT
    if split is None:
        # "default", "gpt2" and families we have no table for: GPT-2's own split.
        return {**byte_level, "use_regex": True}
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {**byte_level, "use_regex": False},
        ],
    }


def _added_token(token_id: int, content: str, special: bool) -> dict[str, Any]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> dict[str, Any]:
    # Adds BOS/EOS when the file says so (add_bos_token / add_eos_token), like an HF tokenizer.json.
    def piece(seq_id: str, type_id: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if bos is not None:
            out.append({"SpecialToken": {"id": bos[0], "type_id": type_id}})
        out.append({"Sequence": {"id": seq_id, "type_id": type_id}})
        if eos is not None:
            out.append({"SpecialToken": {"id": eos[0], "type_id": type_id}})
        return out

    special = {
        text: {"id": text, "ids": [token_id], "tokens": [text]}
        for text, token_id in (t for t in (bos, eos) if t is not None)
    }
    return {
        "type": "TemplateProcessing",
        "single": piece("A", 0),
        "pair": piece("A", 0) + piece("B", 1),
        "special_tokens": special,
    }


def build_byte_level(
    tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str], pre: str
) -> dict[str, Any]:
    """tokenizer.json (as a dict) for a "gpt2" GGUF vocabulary."""
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # Added tokens may be stored as plain text; the BPE vocabulary needs them byte-spelled.
        key = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[key] = i
    added = []
    for i, (token, token_type) in enumerate(zip(tokens, token_types, strict=False)):
        # A control token outside the byte alphabet is a converter mislabel (it could never be a
        # vocabulary entry); transformers skips those too.
        if token_type == TOKEN_CONTROL and set(token) <= alphabet:
            added.append(_added_token(i, token, special=True))
        elif token_type == TOKEN_USER_DEFINED and token in vocab:
            added.append(_added_token(i, token, special=False))
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _byte_level_pre_tokenizer(pre),
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            # Llama 3's own tokenizer.json (and llama.cpp) take a pre-token found whole in the
            # vocabulary without merging it.
            "ignore_merges": pre in _LLAMA3_PRE,
            "vocab": vocab,
            "merges": [merge.split(" ", 1) for merge in merges],
        },
    }


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[list[str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best-scored result first (ties: longer left piece, then longer right piece, as transformers)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for token, score in dict(zip(tokens, scores, strict=False)).items():
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted(
            (p for p in pairs if p[0] in vocab and p[1] in vocab), key=lambda p: (vocab[p[0]], vocab[p[1]])
        )
        found += [(-score, -len(left), -len(right), left, right) for left, right in pairs]
    found.sort(key=lambda m: m[:3])  # stable: ties keep vocabulary order
    return [[m[3], m[4]] for m in found]


def build_sentencepiece(
    tokens: Sequence[str],
    token_types: Sequence[int],
    scores: Sequence[float],
    unk: str | None,
    add_prefix_space: bool,
) -> dict[str, Any]:
    """tokenizer.json (as a dict) for a "llama" (SentencePiece BPE) GGUF vocabulary."""
    vocab = {t: i for i, t in enumerate(tokens)}
    added = [
        _added_token(i, t, special=True)
        for i, (t, tt) in enumerate(zip(tokens, token_types, strict=False))
        if tt in (TOKEN_CONTROL, TOKEN_UNKNOWN)
    ]
    added += [
        _added_token(i, t, special=False)
        for i, (t, tt) in enumerate(zip(tokens, token_types, strict=False))
        if tt == TOKEN_USER_DEFINED
    ]
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_prefix_space:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Metaspace",
            "replacement": "▁",
            "prepend_scheme": "first" if add_prefix_space else "never",
            "split": False,
        },
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": _merges_from_scores(tokens, scores),
        },
    }


def build_tokenizer(
    meta: Mapping[str, Any], tokens: Sequence[str], merges: Sequence[str] | None, source: str
) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer, tokenizer_config) from GGUF metadata; `tokens`/`merges` are the decoded arrays."""
    model = meta.get("tokenizer.ggml.model")
    token_types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))]

    def token_of(key: str) -> tuple[str, int] | None:
        value = meta.get(key)
        if value is None or not 0 <= int(value) < len(tokens):
            return None
        return tokens[int(value)], int(value)

    bos, eos = token_of("tokenizer.ggml.bos_token_id"), token_of("tokenizer.ggml.eos_token_id")
    if model == "gpt2":
        if merges is None:
            raise ModelLoadError(f"{source}: byte-level BPE vocabulary without tokenizer.ggml.merges")
        spec = build_byte_level(tokens, token_types, merges, str(meta.get("tokenizer.ggml.pre", "default")))
        add_bos_default = False
    elif model == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise ModelLoadError(f"{source}: SentencePiece vocabulary without tokenizer.ggml.scores")
        unk = token_of("tokenizer.ggml.unknown_token_id")
        add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        spec = build_sentencepiece(
            tokens, token_types, [float(s) for s in scores], unk[0] if unk else None, add_prefix_space
        )
        add_bos_default = True  # llama.cpp's default for SentencePiece files that do not say
    else:
        raise ModelLoadError(f"{source}: unsupported tokenizer model {model!r} (supported: gpt2, llama)")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    spec["post_processor"] = _post_processor(bos if add_bos else None, eos if add_eos else None)
    try:
        tokenizer = Tokenizer.from_str(json.dumps(spec))
    except Exception as e:  # tokenizers raises a bare Exception on a bad spec
        raise ModelLoadError(f"{source}: cannot build the tokenizer: {e}") from e

    eos_ids = [eos[1]] if eos else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        found = token_of(key)
        if found is not None:
            eos_ids.append(found[1])
    eos_ids += [
        i
        for i, (t, tt) in enumerate(zip(tokens, token_types, strict=False))
        if tt == TOKEN_CONTROL and t in END_OF_GENERATION_TEXTS
    ]
    pad, unk = token_of("tokenizer.ggml.padding_token_id"), token_of("tokenizer.ggml.unknown_token_id")
    chat_template = meta.get("tokenizer.chat_template")
    tokenizer_config: dict[str, Any] = {
        "bos_token": bos[0] if bos else None,
        "eos_token": eos[0] if eos else None,
        "pad_token": pad[0] if pad else None,
        "unk_token": unk[0] if unk else None,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template if isinstance(chat_template, str) else None,
        "eos_token_ids": list(dict.fromkeys(eos_ids)),
    }
    return tokenizer, tokenizer_config


def _cache_entry(path: Path) -> Path:
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CACHE_FORMAT}"
    return cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def _write_cache(entry: Path, tokenizer: Tokenizer, tokenizer_config: Mapping[str, Any]) -> None:
    # Written to a temporary folder and renamed, so a reader never sees half an entry.
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False, indent=1))
    try:
        tmp.rename(entry)
    except OSError:  # another process wrote it first
        for child in tmp.iterdir():
            child.unlink()
        tmp.rmdir()


def load_gguf_tokenizer(gguf: GGUFFile, *, use_cache: bool = True) -> tuple[Tokenizer, dict[str, Any]]:
    """The file's tokenizer and tokenizer_config, from the cache when the file is unchanged."""
    entry = _cache_entry(gguf.path)
    if use_cache and (entry / "tokenizer_config.json").is_file():
        try:
            tokenizer = Tokenizer.from_file(str(entry / "tokenizer.json"))
            return tokenizer, json.loads((entry / "tokenizer_config.json").read_text())
        except Exception:  # a damaged entry is rebuilt below
            pass
    tokens = gguf.strings("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{gguf.path}: no tokenizer.ggml.tokens in the GGUF metadata")
    merges = gguf.strings("tokenizer.ggml.merges")
    tokenizer, tokenizer_config = build_tokenizer(gguf.metadata, tokens, merges, str(gguf.path))
    if use_cache:
        # A read-only cache only costs the next load a rebuild.
        with contextlib.suppress(OSError):
            _write_cache(entry, tokenizer, tokenizer_config)
    return tokenizer, tokenizer_config
