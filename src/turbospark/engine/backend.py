"""`RealChatModel`: the `ChatModel` protocol over turbospark's own PyTorch engine.

One `ModelRunner` (one KV cache) per loaded model. `run_completion` takes a lock, so
concurrent requests run one after another until the batching scheduler lands; the runner
itself already steps many sequences at once. Images are refused by name: none of the families
here has a vision tower.

Picking the numerics (`load_backend`): `device` is "cpu" or "cuda[:n]"; `quant` is "int8" or
"int4" (weight-only, CPU kernels), None or "none" for float weights, or "auto" (the default):
on CPU with no dtype given, int4 when the checkpoint's weights already lie on a 4-bit grid (a Q4
GGUF, so int4 loses nothing) and int8 otherwise; float weights on other devices or when a dtype
is given. `dtype` is the activation / float-weight dtype, by default bfloat16 with a quantized
path (the fast one for those kernels), float32 for a float path on CPU and bfloat16 on CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import inspect
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from turbospark.backend import (
    BackendDefaults,
    BackendError,
    CancelFlag,
    CompletionResult,
    GenerationConfig,
    ModelDetails,
    ProgressCallback,
    RequestImage,
)
from turbospark.engine.models import Model
from turbospark.engine.runner import ModelRunner

if TYPE_CHECKING:
    from turbospark.tokenizer import Tokenizer

DEFAULT_MAX_CONTEXT = 8192
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RealChatModel(BackendDefaults):
    def __init__(
        self,
        model_id: str,
        model: Model,
        tokenizer: Tokenizer,
        *,
        max_context: int = DEFAULT_MAX_CONTEXT,
        device: torch.device | str = "cpu",
        prefill_chunk_size: int = 256,
    ) -> None:
        self.model_id = model_id
        self._tokenizer = tokenizer
        self._max_context = min(max_context, model.config.max_position_embeddings, model.max_positions)
        self._runner = ModelRunner(
            model, max_context=self._max_context, device=device, prefill_chunk_size=prefill_chunk_size
        )
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._runner.vocab_size

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    def details(self) -> ModelDetails:
        """Family, size and weight format, read off the loaded model (weights as held in memory)."""
        from turbospark.engine.quant import Int4Linear, Int8Linear

        model = self._runner.model
        assert isinstance(model, torch.nn.Module)
        params = {id(p): p for p in model.parameters()}  # tied weights once
        count = sum(p.numel() for p in params.values())
        size = sum(p.numel() * p.element_size() for p in params.values())
        kinds = set()
        for m in model.modules():
            if isinstance(m, Int8Linear | Int4Linear):
                kinds.add("int4" if isinstance(m, Int4Linear) else "int8")
                count += m.in_features * m.out_features
                size += sum(b.numel() * b.element_size() for b in m.buffers())
        held = "int4" if "int4" in kinds else "int8" if kinds else str(self._runner.model.dtype)
        float_names = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}
        return ModelDetails(
            family=type(model).__module__.rsplit(".", 1)[-1],  # the family module is the model_type
            num_parameters=count,
            quantization=float_names.get(held, held),
            size_bytes=size,
            device=str(next(model.parameters()).device),
        )

    def run_completion(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        images: Sequence[RequestImage] | None,
        cancel: CancelFlag,
        on_progress: ProgressCallback,
    ) -> CompletionResult:
        if images:
            raise BackendError(f"model {self.model_id!r} does not accept images: it has no vision tower")
        if not prompt_ids:
            raise BackendError("the prompt is empty")
        if len(prompt_ids) > self._max_context:
            raise BackendError(
                f"the prompt has {len(prompt_ids)} tokens, more than model {self.model_id!r}'s context "
                f"of {self._max_context}"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise BackendError(f"prompt token ids must lie in [0, {self.vocab_size})")
        with self._lock:
            return self._runner.generate(prompt_ids, config, cancel, on_progress)


def resolve_numerics(device: str, dtype: str | None, quant: str | None) -> tuple[torch.dtype, str | None]:
    """The (activation dtype, quant mode) `load_backend` uses; "auto" stays "auto" on CPU (it
    is settled by the weights, see `turbospark.engine.quant.auto_quant`)."""
    is_cpu = torch.device(device).type == "cpu"
    if quant == "none":
        quant = None
    if quant == "auto" and (not is_cpu or dtype is not None):
        quant = None  # an explicit dtype asks for float weights of that dtype
    if quant is not None and not is_cpu:
        raise ValueError(f"quantization {quant!r} runs on CPU only for now")
    if dtype is None:
        torch_dtype = torch.bfloat16 if (quant is not None or not is_cpu) else torch.float32
    elif dtype in DTYPES:
        torch_dtype = DTYPES[dtype]
    else:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return torch_dtype, quant


def load_backend(
    spec: str,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    max_context: int | None = None,
    quant: str | None = "auto",
    progress: bool = True,
) -> RealChatModel:
    """Loads a checkpoint (path, hub-cache id or bundled name) and returns its backend."""
    from turbospark.engine.loader import DEFAULT_MODEL, load_checkpoint
    from turbospark.engine.models import build_model
    from turbospark.tokenizer import Tokenizer

    torch_dtype, quant = resolve_numerics(device, dtype, quant)
    load_kwargs: dict[str, Any] = {"progress": progress}
    if torch_dtype != torch.float32 and "dtype" in inspect.signature(load_checkpoint).parameters:
        # a quantized GGUF dequantizes straight to the compute dtype: half the float32 peak
        load_kwargs["dtype"] = torch_dtype
    ckpt = load_checkpoint(spec, **load_kwargs)
    _release_freed_memory()  # the loader's dequantization scratch, before the model's own
    model_max = int(ckpt.config.get("max_position_embeddings", DEFAULT_MAX_CONTEXT))
    context = min(max_context or DEFAULT_MAX_CONTEXT, model_max)
    if quant == "auto":
        from turbospark.engine.quant import auto_quant

        quant = auto_quant(ckpt.tensors)
    model = build_model(ckpt.config, ckpt.tensors, device, torch_dtype, quant=quant, max_positions=context)
    tokenizer = Tokenizer(ckpt.tokenizer, ckpt.tokenizer_config)
    # The embedded default is served as "smollm2", the name the README's requests use (and
    # "claude-turbospark-smollm2" for Claude Code), not as its display name SmolLM2-135M-Instruct.
    name = DEFAULT_MODEL if spec.strip() in ("", DEFAULT_MODEL) else ckpt.name
    del ckpt  # the float checkpoint tensors are no longer needed once the model holds its own
    _release_freed_memory()
    return RealChatModel(name, model, tokenizer, max_context=context, device=device)


def _release_freed_memory() -> None:
    """Hands the loader's freed buffers back to the OS.

    glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold in the heap, so
    after loading, resident memory stays at the checkpoint's size until trimmed: on SmolLM2,
    843 MB before and 399 MB after.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
