"""The tokenizer built from GGUF metadata encodes and decodes like transformers' GGUF tokenizer.

The reference is `AutoTokenizer.from_pretrained(folder, gguf_file=name)` on the same file, over a
corpus of ASCII, code, multibyte UTF-8, emoji, special tokens inside text, whitespace runs and
digits.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf import GGUFWriter

from turbospark.engine.gguf_file import GGUFFile
from turbospark.engine.gguf_tokenizer import load_gguf_tokenizer
from turbospark.engine.loader import default_model_path

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 2024; we've won 1,234,567 dollars.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "    \t  leading whitespace and   runs   of    spaces\n\n\n\ttabs\r\nCRLF",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский текст, 日本語のテキスト, 中文字符, 한국어",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 and ✓ ✗ → ← ∑ ∫ √",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    'special <|endoftext|>inside<|im_end|>text and <tool_call>{"name": "f"}</tool_call>',
    "digits 0 1 12 123 1234 12345 3.14159 1e-10 0xFF 007",
    "I'M SHOUTING, YOU'RE RIGHT, THEY'LL SEE, SHE'D GO, it's, we'll",
    "   ",
    "",
    "\n",
    "a\u0301 e\u0301 (decomposed accents) and \u00e9 precomposed",
    "URL: https://example.com/path?q=1&r=two#frag and email a.b@c.de",
    "SELECT * FROM t WHERE x >= 10 AND y != 'z'; -- comment\n/* block */",
    '{"key": [1, 2, {"nested": null}], "b": true}',
    "mixed\u00a0nbsp\u2009thin\u3000ideographic space",
    "zero\u200bwidth\u200djoiner and \ufeffBOM",
    "<|im_start|><|im_start|> double and <|im_sta rt|> broken",
]


def assert_same_as_transformers(folder: Path, name: str, tokenizer, corpus=CORPUS) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for text in corpus:
        ids = tokenizer.encode(text).ids
        assert ids == reference.encode(text), text
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def smollm2_folder(tmp_path) -> tuple[Path, str]:
    source = default_model_path()
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / source.name).symlink_to(source)
    return folder, source.name


def test_smollm2_tokenizer_matches_transformers(smollm2_folder):
    folder, name = smollm2_folder
    tokenizer, config = load_gguf_tokenizer(GGUFFile(folder / name))
    assert tokenizer.get_vocab_size() == 49152
    assert_same_as_transformers(folder, name, tokenizer)
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["chat_template"].startswith("{% for message in messages %}")


def test_smollm2_splits_every_digit_like_llama_cpp(smollm2_folder):
    # tokenizer.ggml.pre "smollm": llama.cpp (and SmolLM2's own tokenizer.json, a Digits
    # pre-tokenizer) isolate every \p{N} before the GPT-2 split. transformers' GGUF reader ignores
    # this pre type; on ASCII digits the vocabulary makes no difference (corpus test above), on
    # other scripts' digits we follow llama.cpp.
    folder, name = smollm2_folder
    tokenizer, _ = load_gguf_tokenizer(GGUFFile(folder / name))
    encoding = tokenizer.encode(" ١٢٣ 42")
    assert encoding.tokens[:3] == ["Ġ", "Ù", "¡"]
    assert encoding.tokens[-3:] == ["Ġ", "4", "2"]
    assert tokenizer.decode(encoding.ids) == " ١٢٣ 42"


def _pulled_qwen() -> Path | None:
    # Looked up in the real cache (the fixture above only redirects it during each test).
    from turbospark.engine.pull import pulled_path

    return pulled_path("qwen2.5-coder:0.5b")


PULLED_QWEN = _pulled_qwen()


@pytest.mark.slow
@pytest.mark.skipif(
    PULLED_QWEN is None and not os.environ.get("TURBOSPARK_REQUIRE_MODELS"),
    reason="run `python -m turbospark.engine.pull qwen2.5-coder:0.5b` first",
)
def test_qwen25_tokenizer_matches_transformers(tmp_path):
    assert PULLED_QWEN is not None
    (tmp_path / PULLED_QWEN.name).symlink_to(PULLED_QWEN)
    tokenizer, config = load_gguf_tokenizer(GGUFFile(tmp_path / PULLED_QWEN.name))
    assert_same_as_transformers(tmp_path, PULLED_QWEN.name, tokenizer)
    assert config["eos_token_ids"] == [151645, 151643]  # <|im_end|>, <|endoftext|>
    assert tokenizer.encode("<tool_call>").ids == [151657]


def test_tokenizer_cache_skips_the_vocabulary_on_the_second_load(smollm2_folder, monkeypatch):
    folder, name = smollm2_folder
    first, first_config = load_gguf_tokenizer(GGUFFile(folder / name))
    entries = list((Path(os.environ["TURBOSPARK_CACHE"]) / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()

    def no_vocabulary_reads(self, key):
        raise AssertionError(f"read {key} despite the cache")

    monkeypatch.setattr(GGUFFile, "strings", no_vocabulary_reads)
    second, second_config = load_gguf_tokenizer(GGUFFile(folder / name))
    assert second_config == first_config
    for text in CORPUS:
        assert second.encode(text).ids == first.encode(text).ids


def test_tokenizer_cache_is_keyed_by_file_identity(tmp_path, smollm2_folder):
    folder, name = smollm2_folder
    copy = tmp_path / "copy.gguf"
    copy.write_bytes((folder / name).read_bytes())
    load_gguf_tokenizer(GGUFFile(copy))
    os.utime(copy, ns=(1_000_000_000, 1_000_000_000))  # a changed file gets a new entry
    load_gguf_tokenizer(GGUFFile(copy))
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2


# --------------------------------------------------------------------------- SentencePiece ("llama")

SPM_PIECES = [
    "▁t", "he", "▁the", "in", "▁a", "er", "an", "on", "▁an", "nd", "▁and", "ing", "▁w", "or", "▁wor",
    "ld", "▁world", "▁he", "ll", "▁hell", "▁hello", "▁i", "▁in", "▁is", "es", "▁s", "at", "▁c", "ode",
]  # fmt: skip
SPM_CHARS = list("▁abcdefghijklmnopqrstuvwxyzHTW,.!?'0123456789")


def write_spm_gguf(path: Path) -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for i, piece in enumerate(SPM_PIECES):  # merged pieces: earlier learned = higher score
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i))
    for i, char in enumerate(SPM_CHARS):
        tokens.append(char)
        types.append(1)
        scores.append(-1000.0 - i)
    tokens.append("<|user|>")
    types.append(4)
    scores.append(0.0)
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_vocabulary_matches_transformers(tmp_path):
    path = tmp_path / "spm.gguf"
    write_spm_gguf(path)
    tokenizer, config = load_gguf_tokenizer(GGUFFile(path))
    assert config["add_bos_token"] is True and config["bos_token"] == "<s>"
    assert tokenizer.encode("hello").ids[0] == 1  # BOS added, as the file asks
    corpus = [
        "hello world",
        "the world is and code",
        "  leading spaces and trailing  ",
        "Hello World! What's 42?",
        "bytes: é ü 日本 😀",
        "<s>inline</s> and <|user|>turn",
        "",
        "\n\ttab",
    ]
    assert_same_as_transformers(tmp_path, path.name, tokenizer, corpus)
