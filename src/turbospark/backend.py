"""The backend protocols a request is served from, and what crosses them.

A backend is what the registry serves under a model's names. Every one is a `Backend`: the
model facts the registry and the listings read (id, tokenizer, vocabulary, context, aliases,
`details()`). What it does on top says which requests it answers: the registry, the listings,
the plan and the embedding routes decide by that kind (`isinstance` against these
runtime-checkable protocols; there is no capability flag to keep in step with it):

- a `ChatModel` generates: it turns prompt token ids into generated token ids
  (`run_completion`, `submit_completion`), and says whether it reads images (`vision()`) and
  which sampler settings it recommends (`sampling_defaults()`). It knows nothing of HTTP, chat
  messages, stop strings, reasoning or tool calls: those live above it (see `turbospark.output`).
  Two ship: `turbospark.scripted.ScriptedChatModel` (replays fixed logits, so tests can prove
  envelopes byte for byte) and the PyTorch engine's `turbospark.engine.backend.RealChatModel`.
- an `Embedder` turns texts into vectors (`encode`): `turbospark.engine.embedder.EmbeddingModel`.

A chat request for an embedder is a 400 from the plan; an embeddings request for a chat model a
400 from the embedding routes; both name the model.

The completion signature is written once (`Completion`): `run_completion` and
`submit_completion` differ only in where the tokens go and what comes back. `run_completion` is
blocking and is called from a worker thread, never from the event loop. A backend whose engine
has its own thread (the PyTorch engine) also offers a real `submit_completion`: the same
generation queued without a waiting thread, its tokens posted to the event loop; it returns None
where it has no such path (`ChatModelDefaults`' answer), and the caller then runs
`run_completion` on a thread. Images, their encoding and the decode happen inside that one call
(never two locked steps), so a second request cannot slip between a picture's injection and its
decode.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import torch

    from turbospark.tokenizer import Tokenizer


class ReasoningEffort(StrEnum):
    OFF = "off"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class FinishReason(StrEnum):
    STOP = "stop"  # an EOS id, or a stop string matched above the backend
    LENGTH = "length"  # max_new_tokens or the context ran out
    CANCELLED = "cancelled"  # the cancel flag was set (client gone, or a stop string matched)


class LogitsProcessor(Protocol):
    """Edits one sequence's next-token logits in place before sampling.

    Grammar masks and the thinking budget are processors. `generated_ids` is every token this
    sequence produced so far (not the prompt); a stateful processor advances on the new tail.
    """

    def __call__(self, generated_ids: Sequence[int], logits: torch.Tensor) -> None: ...


@dataclass(slots=True)
class GenerationConfig:
    """Everything the decode loop needs, in token ids. Built by `turbospark.plan`."""

    max_new_tokens: int  # as the request asked: `budget` caps it to the context
    stop_token_ids: frozenset[int] = frozenset()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    num_top_logprobs: int | None = None  # None: no logprobs; 0: only the chosen token's
    processors: list[LogitsProcessor] = field(default_factory=list)
    # The loop guard (`sampling.loop_continuation`): when the last `loop_window` generated tokens
    # repeat one short block, the token that would go round once more is masked. 0: off.
    loop_window: int = 0
    # Prefix-cache isolation: only sequences with the same salt share cached KV blocks (None is
    # one shared salt). From the body's `cache_salt` and, where keys are configured, the API key.
    cache_salt: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def budget(self, num_prompt_tokens: int, max_context: int) -> int:
        """How many tokens this generation may make after a prompt of `num_prompt_tokens`:
        `max_new_tokens`, capped to the room the prompt leaves in a context of `max_context` (0
        when it fills it). The one place max_tokens meets the context: both token loops (the
        engine's `Engine.submit`, the sequential `decode.run_decode_loop`) take their bound from
        here, on the prompt they actually run (images spliced in), and the plan passes a request's
        max_tokens through. Running into this bound is finish reason "length", never a silent stop.
        """
        return min(self.max_new_tokens, max_context - num_prompt_tokens)


@dataclass(slots=True, frozen=True)
class SamplingDefaults:
    """Sampler settings a request gets for each one it leaves unset (None: this source says
    nothing about it). A model's own (`ChatModel.sampling_defaults`: its generation_config.json
    or GGUF `general.sampling.*`) are laid over `BUILTIN_SAMPLING` by the registry; the plan
    fills a request's unset fields from the result."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 = off
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str = ""  # where these values were read, for logs and listings

    def over(self, base: SamplingDefaults) -> SamplingDefaults:
        """These values where set, `base`'s elsewhere."""
        return SamplingDefaults(
            temperature=base.temperature if self.temperature is None else self.temperature,
            top_p=base.top_p if self.top_p is None else self.top_p,
            top_k=base.top_k if self.top_k is None else self.top_k,
            min_p=base.min_p if self.min_p is None else self.min_p,
            repetition_penalty=(
                base.repetition_penalty if self.repetition_penalty is None else self.repetition_penalty
            ),
            source=" over ".join(s for s in (self.source, base.source) if s),
        )

    def is_empty(self) -> bool:
        return all(
            v is None for v in (self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty)
        )


# When neither the request nor the model says: llama.cpp's server defaults for the truncation
# samplers (top-k 40, top-p 0.95, min-p 0.05), which keep a small model out of the long tail,
# and temperature 1.0, the default the OpenAI and Anthropic APIs document (see ARCHITECTURE.md).
BUILTIN_SAMPLING = SamplingDefaults(
    temperature=1.0, top_p=0.95, top_k=40, min_p=0.05, repetition_penalty=1.0, source="built-in"
)
# `--sampling-defaults none`: plain temperature sampling, nothing truncated.
NO_SAMPLING_DEFAULTS = SamplingDefaults(
    temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, source="none"
)


@dataclass(slots=True)
class TokenEvent:
    """One decoded token, handed to `on_progress` as soon as it is sampled."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class CompletionResult:
    token_ids: list[int]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


class CancelFlag(Protocol):
    def is_set(self) -> bool: ...


NEVER_CANCEL: CancelFlag = threading.Event()

ProgressCallback = Callable[[TokenEvent], None]


class Outbox(Protocol):
    """Where a submitted generation's items go, from the engine's thread: each `TokenEvent` as it
    is sampled, then one `CompletionResult` or one failure."""

    def put(self, item: object, /) -> None: ...


class Submission(Protocol):
    """A generation submitted with `ChatModel.submit_completion`. Its owner passes every item the
    outbox received, in order, to `take`, on one thread: `take` returns the token to hand on
    (None once the cancel flag is set: the result then holds exactly the tokens handed on), the
    final `CompletionResult`, or raises the generation's error. `alive` turns False if what makes
    the items stopped before this generation's last one (its thread died): the owner then fails the
    request instead of waiting for items that will never come."""

    def take(self, item: object) -> TokenEvent | CompletionResult | None: ...

    def alive(self) -> bool: ...


@dataclass(slots=True)
class VisionInfo:
    """A model's vision tower: its pixel budget and the ids its template uses for a picture."""

    max_pixels: int
    image_token: str


@dataclass(slots=True)
class RequestImage:
    data: bytes  # the decoded file (PNG, JPEG, ...)
    media_type: str
    where: str = ""  # the content part it came from, for errors ("messages[0].content[1].image_url")


@dataclass(slots=True, frozen=True)
class ModelDetails:
    """What a model is, for clients that list models (Ollama's /api/tags and /api/show).

    Empty values mean unknown; a backend fills in what it knows.
    """

    family: str = ""  # the architecture (Hugging Face model_type), e.g. "qwen2", "llama"
    format: str = ""  # how the weights were stored, e.g. "gguf", "safetensors"
    num_parameters: int = 0
    quantization: str = ""  # how the weights are held, e.g. "int8", "int4", "BF16"
    size_bytes: int = 0  # the weights' size
    device: str = "cpu"  # where the weights are held ("cpu", "cuda:0", ...)


class BackendError(Exception):
    """A generation failed for a reason the caller should hear about (a 4xx by default)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class EngineOverloaded(Exception):
    """The waiting line is full: the caller answers 429 / 529 / 503 with Retry-After."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


_Sink = TypeVar("_Sink", contravariant=True)
_Result = TypeVar("_Result", covariant=True)


class Completion(Protocol[_Sink, _Result]):
    """The one completion signature: the prompt's token ids, its `GenerationConfig`, its images
    (None: text only; a model without a vision tower refuses them by name), the cancel flag, and
    where its tokens go (`_Sink`). `RunCompletion` and `SubmitCompletion` fill in the last two."""

    def __call__(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        images: Sequence[RequestImage] | None,
        cancel: CancelFlag,
        sink: _Sink,
        /,
    ) -> _Result: ...


# Blocking: each token goes to the callback as it is sampled, then the result is returned.
RunCompletion = Completion[ProgressCallback, CompletionResult]
# Queues the generation and returns at once (raising what `run_completion` would raise before
# its first token), its items going to the outbox; None: no such path, run `run_completion`.
SubmitCompletion = Completion[Outbox, Submission | None]


@runtime_checkable
class Backend(Protocol):
    """What the registry serves, whatever the model does: the facts every listing reads."""

    @property
    def model_id(self) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def aliases(self) -> list[str]: ...

    def details(self) -> ModelDetails: ...


@runtime_checkable
class ChatModel(Backend, Protocol):
    """A backend that generates. See the module docstring for the contract."""

    def vision(self) -> VisionInfo | None: ...

    def sampling_defaults(self) -> SamplingDefaults: ...

    # Read-only members of the one `Completion` type, so the signature is not repeated here: a
    # backend implements each as an ordinary method.
    @property
    def run_completion(self) -> RunCompletion: ...

    @property
    def submit_completion(self) -> SubmitCompletion: ...


@runtime_checkable
class Embedder(Backend, Protocol):
    """A backend that makes embeddings: one vector per text. The embedding routes use more of
    it where it offers more (`api.embeddings.BatchEmbedder`: token-id inputs, truncation)."""

    def encode(self, texts: Sequence[str]) -> list[list[float]]: ...


class BackendDefaults:
    """Mixin with `Backend`'s defaults, so a backend only writes what differs."""

    def aliases(self) -> list[str]:
        return []

    def details(self) -> ModelDetails:
        return ModelDetails()


class ChatModelDefaults(BackendDefaults):
    """Mixin with `ChatModel`'s defaults: no vision tower, no sampler recommendation, and no
    `submit_completion` path (generations run `run_completion` on a thread)."""

    def vision(self) -> VisionInfo | None:
        return None

    def sampling_defaults(self) -> SamplingDefaults:
        """The model's own recommended sampler settings; none unless its files carry some."""
        return SamplingDefaults()

    @property
    def submit_completion(self) -> SubmitCompletion:
        """No direct path: a `SubmitCompletion` that answers None to every generation. A backend
        with one overrides this with an ordinary method."""
        return _no_submission


def _no_submission(*args: object) -> None:
    return None
