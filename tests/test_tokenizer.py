"""Incremental detokenizing and stop strings, on the byte-level tokenizer (worst case: one byte a token)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from turbospark.scripted import byte_tokenizer
from turbospark.tokenizer import IncrementalDecoder, StopMatcher

TEXTS = ["plain ascii", "Grüße, 日本語 and emoji 🎉👍🏽!", "<think>x</think> tags", "a\n\n  b\t", "€" * 5]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decode_reassembles_exactly(text: str) -> None:
    tok = byte_tokenizer()
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in tok.encode(text)]
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    assert "".join(pieces) + dec.flush() == text


def test_truncated_character_is_flushed_as_replacement() -> None:
    tok = byte_tokenizer()
    dec = IncrementalDecoder(tok)
    ids = tok.encode("ab🎉")[:-1]  # cut inside the emoji's 4 bytes
    out = "".join(dec.push(i) for i in ids)
    assert out == "ab"
    assert dec.flush() == "\ufffd"


def test_special_tokens_are_skipped_markup_is_kept() -> None:
    tok = byte_tokenizer()
    dec = IncrementalDecoder(tok)
    ids = tok.encode("<|im_start|>hi<tool_call>")
    assert "".join(dec.push(i) for i in ids) == "hi<tool_call>"


def feed_chars(matcher: StopMatcher, text: str) -> tuple[str, str | None]:
    out = []
    for ch in text:
        emitted, matched = matcher.push(ch)
        out.append(emitted)
        if matched:
            return "".join(out), matched
    return "".join(out) + matcher.flush(), None


@pytest.mark.parametrize(
    ("text", "stops", "expected", "matched"),
    [
        ("hello STOP world", ["STOP"], "hello ", "STOP"),
        ("hello world", ["STOP"], "hello world", None),
        ("almost STO", ["STOP"], "almost STO", None),  # held-back prefix is released at the end
        ("a##b###c", ["###"], "a##b", "###"),
        ("xyz end abc", ["abc", "end"], "xyz ", "end"),  # earliest match wins
        ("line\n\nnext", ["\n\n"], "line", "\n\n"),
    ],
)
def test_stop_strings_across_boundaries(
    text: str, stops: list[str], expected: str, matched: str | None
) -> None:
    assert feed_chars(StopMatcher(stops), text) == (expected, matched)
    # the same result when the text arrives in one piece
    whole = StopMatcher(stops)
    emitted, m = whole.push(text)
    assert (emitted + ("" if m else whole.flush()), m) == (expected, matched)


def test_stop_matcher_holds_only_possible_prefixes() -> None:
    m = StopMatcher(["<END>"])
    assert m.push("abc<E") == ("abc", None)
    assert m.push("x") == ("<Ex", None)


DISTINCT_PROMPTS_SCRIPT = """
import uuid
from turbospark.scripted import byte_tokenizer

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

tok = byte_tokenizer()
tok.encode("<|im_start|>user\\nwarm up<|im_end|>\\n")
before = rss_kib()
for _ in range(4000):
    tok.encode("<|im_start|>user\\n" + uuid.uuid4().hex * 7 + "<|im_end|>\\n<|im_start|>assistant\\n")
print((rss_kib() - before) / 1024)
"""


def test_scripted_tokenizer_keeps_no_past_prompts() -> None:
    """A long-running scripted server sees a new prompt each request. Its tokenizer has no regex
    split, so a BPE word cache would keep each stretch of prompt text between special tokens
    whole (about 32 bytes a byte, up to 10,000 words of under 256 bytes: ~30 MB for these 4,000
    229-byte ones); it keeps none. Own process, so the reading is this loop's alone."""
    out = subprocess.run(
        [sys.executable, "-c", DISTINCT_PROMPTS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    growth_mib = float(out.stdout.strip().splitlines()[-1])
    assert growth_mib < 4, f"RSS grew {growth_mib:.1f} MiB over 4,000 distinct prompts"
