"""`EmbeddingModel`: an encoder checkpoint (BERT) served for embeddings.

It is an `Embedder` (`turbospark.backend`): it has the model facts every backend has, so the
registry, /v1/models and the Ollama listings treat it like any model, and `encode`; it is no
`ChatModel` (an encoder cannot generate), so the listings show it as "embedding" only and a chat
request naming it is refused by the plan, by name.

Requests reach the model through one small batching queue: the API hands a request's inputs
to `submit` and awaits the future; a single worker thread takes every request waiting at that
moment, tokenizes all their texts in one call, checks each request's lengths (one request's
over-long input fails that request only), and runs every sequence through the encoder
together. Within a run, sequences are sorted by length and cut into groups of at most
`max_batch_tokens` padded tokens, so padding and peak memory stay small; the encoder itself is
packed (see `turbospark.engine.models.bert`), so the linears never compute for padding.

Pooling follows the checkpoint's sentence-transformers config (`modules.json` and the pooling
module's `config.json`: mean, CLS, max, mean/sqrt(len) or last token); a folder without one is
mean-pooled. Vectors are always L2-normalized: OpenAI's and Ollama's embeddings are unit
vectors, and the cosine similarity clients compute is then a dot product.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from prometheus_client import Counter
from tokenizers import Tokenizer as HFTokenizer

from turbospark import metrics
from turbospark.backend import BackendError, ModelDetails
from turbospark.engine.loader import ModelLoadError
from turbospark.tokenizer import Tokenizer

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len", "last")

EMBEDDING_REQUESTS = Counter(
    "turbospark_embedding_requests_total",
    "Embedding requests answered, by model and outcome",
    ["model", "outcome"],
    registry=metrics.REGISTRY,
)
EMBEDDING_INPUTS = Counter(
    "turbospark_embedding_inputs_total", "Inputs embedded, by model", ["model"], registry=metrics.REGISTRY
)
EMBEDDING_TOKENS = Counter(
    "turbospark_embedding_tokens_total",
    "Tokens run through an embedding model, by model",
    ["model"],
    registry=metrics.REGISTRY,
)
EMBEDDING_BATCHES = Counter(
    "turbospark_embedding_batches_total",
    "Encoder runs; inputs_total / batches_total is the mean number of inputs batched together",
    ["model"],
    registry=metrics.REGISTRY,
)


def read_pooling(folder: Path) -> str:
    """The pooling mode a sentence-transformers folder declares ("mean" when it declares none)."""
    pooling_dir = folder / "1_Pooling"
    modules_path = folder / "modules.json"
    if modules_path.is_file():
        try:
            modules = json.loads(modules_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{modules_path}: cannot read JSON ({e})") from e
        found = [m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")]
        if not found:
            return "mean"
        pooling_dir = folder / str(found[0].get("path", ""))
    config_path = pooling_dir / "config.json"
    if not config_path.is_file():
        return "mean"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{config_path}: cannot read JSON ({e})") from e
    if isinstance(config.get("pooling_mode"), str):  # newer sentence-transformers: one named mode
        named = {"lasttoken": "last", "mean_sqrt_len_tokens": "mean_sqrt_len"}
        mode = named.get(config["pooling_mode"], config["pooling_mode"])
        if mode not in POOLING_MODES:
            raise ModelLoadError(f"{config_path}: pooling mode {config['pooling_mode']!r} is not supported")
        return str(mode)
    flags = {
        "pooling_mode_cls_token": "cls",
        "pooling_mode_mean_tokens": "mean",
        "pooling_mode_max_tokens": "max",
        "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
        "pooling_mode_lasttoken": "last",
    }
    modes = [mode for key, mode in flags.items() if config.get(key)]
    unsupported = [k for k, v in config.items() if k.startswith("pooling_mode") and v and k not in flags]
    if unsupported or len(modes) != 1:
        raise ModelLoadError(
            f"{config_path}: pooling {', '.join(unsupported or modes or ['none'])} is not supported "
            "(exactly one of mean, cls, max, mean_sqrt_len, lasttoken)"
        )
    return modes[0]


def pool(hidden: torch.Tensor, seq_of_token: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """(num_seqs, hidden) vectors from packed token states (num_tokens, hidden), L2-normalized."""
    num_seqs = lengths.shape[0]
    ends = torch.cumsum(lengths, 0)
    if mode == "cls":
        pooled = hidden[ends - lengths]
    elif mode == "last":
        pooled = hidden[ends - 1]
    elif mode == "max":
        start = hidden.new_full((num_seqs, hidden.shape[1]), float("-inf"))
        index = seq_of_token[:, None].expand_as(hidden)
        pooled = start.scatter_reduce(0, index, hidden, "amax")
    else:
        sums = hidden.new_zeros(num_seqs, hidden.shape[1]).index_add_(0, seq_of_token, hidden)
        scale = lengths.to(hidden.dtype)[:, None]
        pooled = sums / (scale.sqrt() if mode == "mean_sqrt_len" else scale)
    return F.normalize(pooled.float(), p=2.0, dim=-1)


@dataclass(slots=True)
class EmbedResult:
    vectors: np.ndarray  # (num_inputs, dim) float32, unit length
    num_tokens: int  # every token run, special tokens included (the request's usage)


EmbedInput = str | Sequence[int]


@dataclass(slots=True)
class _Job:
    inputs: Sequence[EmbedInput]
    truncate: bool
    hint: str
    future: Future[EmbedResult] = field(default_factory=Future)


class EmbeddingModel:
    """An encoder served for embeddings; see the module docstring."""

    file_format = "safetensors"
    load_seconds = 0.0

    def __init__(
        self,
        model_id: str,
        model: Any,
        hf_tokenizer: HFTokenizer,
        tokenizer_config: dict[str, Any] | None = None,
        *,
        pooling: str = "mean",
        family: str = "bert",
        max_context: int | None = None,
        aliases: Sequence[str] = (),
        max_batch_tokens: int = 16384,
        max_waiting_inputs: int = 4096,
    ) -> None:
        if pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_MODES)}, not {pooling!r}")
        self.model_id = model_id
        self.model = model
        self.pooling = pooling
        self.family = family
        self.num_parameters = sum(p.numel() for p in model.parameters())
        self.size_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.dimensions: int = int(model.config.hidden_size)
        limit = int(model.max_positions)
        self._max_context = min(limit, max_context) if max_context else limit
        self._aliases = list(aliases)
        # Two copies of the tokenizer: one never truncates (to measure and refuse), one cuts at
        # the limit keeping the closing special token (for requests that ask for truncation).
        # tokenizer.json files often carry a training-time truncation/padding; both are cleared.
        self._hf = HFTokenizer.from_str(hf_tokenizer.to_str())
        self._hf.no_truncation()
        self._hf.no_padding()
        self._hf_cut = HFTokenizer.from_str(self._hf.to_str())
        self._hf_cut.enable_truncation(max_length=self._max_context)
        self._tokenizer = Tokenizer(self._hf, tokenizer_config)
        self._device = next(model.parameters()).device
        self.max_batch_tokens = max_batch_tokens
        self.max_waiting_inputs = max_waiting_inputs
        self._pending: deque[_Job] = deque()
        self._num_waiting = 0
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        for outcome in ("ok", "error"):
            EMBEDDING_REQUESTS.labels(model=model_id, outcome=outcome)  # shown at 0

    # ---------------------------------------------------------------- Backend facts

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_context(self) -> int:
        return self._max_context

    def aliases(self) -> list[str]:
        # No claude-turbospark-* alias: Claude Code would offer it as a chat model.
        return list(self._aliases)

    def details(self) -> ModelDetails:
        return ModelDetails(
            family=self.family,
            format=self.file_format,
            num_parameters=self.num_parameters,
            size_bytes=self.size_bytes,
            device=str(self._device),
        )

    def encode(self, texts: Sequence[str]) -> list[list[float]]:
        vectors: list[list[float]] = self.submit(list(texts)).result().vectors.tolist()
        return vectors

    # ---------------------------------------------------------------- embedding

    def submit(
        self, inputs: Sequence[EmbedInput], *, truncate: bool = False, hint: str = ""
    ) -> Future[EmbedResult]:
        """Queues one request's inputs (texts, or token id lists used as given); its future
        gets their vectors, or a `BackendError` (400 for a bad input, 429 when too many wait).
        `hint` is appended to the too-long message (how the caller's API asks for truncation)."""
        if not inputs:
            raise BackendError("no input to embed")
        job = _Job(list(inputs), truncate, hint)
        with self._cond:
            if self._num_waiting and self._num_waiting + len(job.inputs) > self.max_waiting_inputs:
                EMBEDDING_REQUESTS.labels(model=self.model_id, outcome="error").inc()
                raise BackendError(
                    f"model {self.model_id!r} has {self._num_waiting} inputs waiting to be embedded; "
                    "retry shortly",
                    status=429,
                )
            self._pending.append(job)
            self._num_waiting += len(job.inputs)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name=f"turbospark-embed-{self.model_id}", daemon=True
                )
                self._worker.start()
            self._cond.notify()
        return job.future

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                jobs = list(self._pending)
                self._pending.clear()
                self._num_waiting = 0
            self._run(jobs)

    def _run(self, jobs: list[_Job]) -> None:
        # a request whose client left (its future was cancelled) is dropped here
        jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not jobs:
            return
        try:
            token_ids = self._tokenize(jobs)
        except Exception as exc:  # a tokenizer failure fails every request of the batch
            for job in jobs:
                job.future.set_exception(exc)
            return
        runnable: list[tuple[_Job, list[list[int]]]] = []
        for job, ids in zip(jobs, token_ids, strict=True):
            if isinstance(ids, BackendError):
                EMBEDDING_REQUESTS.labels(model=self.model_id, outcome="error").inc()
                job.future.set_exception(ids)
            else:
                runnable.append((job, ids))
        if not runnable:
            return
        try:
            vectors = self.embed_ids([seq for _, ids in runnable for seq in ids])
        except Exception as exc:
            for job, _ in runnable:
                EMBEDDING_REQUESTS.labels(model=self.model_id, outcome="error").inc()
                job.future.set_exception(exc)
            return
        EMBEDDING_BATCHES.labels(model=self.model_id).inc()
        start = 0
        for job, ids in runnable:
            num_tokens = sum(len(seq) for seq in ids)
            EMBEDDING_REQUESTS.labels(model=self.model_id, outcome="ok").inc()
            EMBEDDING_INPUTS.labels(model=self.model_id).inc(len(ids))
            EMBEDDING_TOKENS.labels(model=self.model_id).inc(num_tokens)
            job.future.set_result(EmbedResult(vectors[start : start + len(ids)], num_tokens))
            start += len(ids)

    def _tokenize(self, jobs: list[_Job]) -> list[list[list[int]] | BackendError]:
        """Token ids per job (or the job's error), every text of one kind in one batch call."""
        texts: dict[bool, list[str]] = {False: [], True: []}
        for job in jobs:
            texts[job.truncate] += [x for x in job.inputs if isinstance(x, str)]
        encoded = {
            cut: iter(
                [e.ids for e in (self._hf_cut if cut else self._hf).encode_batch(batch)] if batch else []
            )
            for cut, batch in texts.items()
        }
        out: list[list[list[int]] | BackendError] = []
        for job in jobs:
            ids_list: list[list[int]] = []
            error: BackendError | None = None
            for index, item in enumerate(job.inputs):
                if isinstance(item, str):
                    ids = list(next(encoded[job.truncate]))
                else:
                    ids = list(item)
                    if job.truncate:
                        ids = ids[: self._max_context]
                if error is not None:
                    continue
                error = self._check(index, ids, len(job.inputs), job.hint)
                ids_list.append(ids)
            out.append(error if error is not None else ids_list)
        return out

    def _check(self, index: int, ids: list[int], count: int, hint: str) -> BackendError | None:
        where = f"input {index}" if count > 1 else "the input"
        if not ids:
            return BackendError(f"{where} is empty: there is nothing to embed")
        if len(ids) > self._max_context:
            return BackendError(
                f"{where} is {len(ids)} tokens, more than model {self.model_id!r} accepts "
                f"({self._max_context} tokens); shorten it{hint}"
            )
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            return BackendError(f"{where}: token ids must lie in [0, {self.vocab_size})")
        return None

    @torch.inference_mode()
    def embed_ids(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """Unit vectors (len(sequences), dim) for token id sequences, in their order."""
        from turbospark.engine.models.bert import Batch

        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out = np.empty((len(sequences), self.dimensions), dtype=np.float32)
        group: list[int] = []
        for position, index in enumerate(order):
            group.append(index)
            last = position == len(order) - 1
            # sorted by length: the next sequence is the longest if added
            if last or (len(group) + 1) * len(sequences[order[position + 1]]) > self.max_batch_tokens:
                batch = Batch.pack([sequences[i] for i in group], self._device)
                hidden = self.model(batch)
                vectors = pool(hidden, batch.seq_of_token, batch.lengths, self.pooling)
                out[group] = vectors.cpu().numpy()
                group = []
        return out


def is_encoder_spec(spec: str) -> bool:
    """True when a model spec names a Hugging Face folder of an encoder (embedding) family."""
    from turbospark.engine.loader import resolve_model_spec
    from turbospark.engine.models import is_encoder

    try:
        kind, path = resolve_model_spec(spec)
        if kind != "hf":
            return False
        model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (ModelLoadError, OSError, ValueError, AttributeError):
        return False  # the normal load path reports what is wrong
    return isinstance(model_type, str) and is_encoder(model_type)


def load_embedding_model(
    spec: str,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    max_context: int | None = None,
    progress: bool = True,
) -> EmbeddingModel:
    """Loads an encoder checkpoint (a folder, a hub-cache id or "all-minilm-l6-v2") for embeddings.

    Weights stay float32 unless a dtype is given: the encoder is small and its vectors are
    compared against the reference's to three decimals.
    """
    from turbospark.engine.backend import DTYPES
    from turbospark.engine.loader import EMBEDDING_MODEL, EMBEDDING_MODEL_NAMES, load_checkpoint
    from turbospark.engine.models import build_encoder

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    started = time.monotonic()
    ckpt = load_checkpoint(spec, progress=progress)
    model = build_encoder(ckpt.config, ckpt.tensors, device, DTYPES[dtype] if dtype else torch.float32)
    pooling = read_pooling(Path(ckpt.source))
    aliases = (
        [n for n in EMBEDDING_MODEL_NAMES if n != EMBEDDING_MODEL] if ckpt.name == EMBEDDING_MODEL else []
    )
    backend = EmbeddingModel(
        ckpt.name,
        model,
        ckpt.tokenizer,
        ckpt.tokenizer_config,
        pooling=pooling,
        family=str(ckpt.config["model_type"]),
        max_context=max_context,
        aliases=aliases,
    )
    backend.load_seconds = time.monotonic() - started
    return backend
