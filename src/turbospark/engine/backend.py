"""`RealChatModel`: the `ChatModel` protocol over turbospark's own PyTorch engine.

One `Engine` (one model runner, one KV cache, one scheduler with its FIFO line) per loaded
model. `run_completion` submits to it and waits: concurrent requests are batched into the same
engine steps and share cached prompt prefixes. A vision family (`idefics3`, `qwen2_vl`,
`qwen2_5_vl`) gets a `VisionSpec`: a request's images are decoded, preprocessed and spliced into
its prompt on the request's worker thread (`submit_completion` returns None for them), encoded on
the engine thread when their tokens are first due (`turbospark.engine.vision`); other models
refuse images by name.

The context a model serves is its own (`max_position_embeddings`), bounded by the KV-cache budget
(`kv_cache_gb`; by default a share of free memory) and lowered by `max_context` when given.

Picking the numerics (`load_backend`): `device` is "cpu" or "cuda[:n]"; `quant` is "int8" or
"int4" (weight-only, CPU kernels), None or "none" for float weights, or "auto" (the default):
on CPU with no dtype given, int4 when the checkpoint's weights already lie on a 4-bit grid (a Q4
GGUF, so int4 loses nothing) and int8 otherwise; float weights on other devices or when a dtype
is given. `dtype` is the activation / float-weight dtype, by default for a quantized path the
CPU profile's (`turbospark.engine.cpu_kernels`: bfloat16 where it is native, float32 on AVX2),
float32 for a float path on CPU and bfloat16 on CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from turbospark.backend import (
    BackendError,
    CancelFlag,
    ChatModelDefaults,
    CompletionResult,
    GenerationConfig,
    ModelDetails,
    Outbox,
    ProgressCallback,
    RequestImage,
    SamplingDefaults,
    Submission,
    VisionInfo,
)
from turbospark.engine import row_kernels
from turbospark.engine.engine import Delivery, Engine, StepRunner
from turbospark.engine.memory import fix_mmap_threshold, release_freed_memory, weight_stats
from turbospark.engine.models import Model
from turbospark.engine.runner import ModelRunner
from turbospark.engine.scheduler import Scheduler, SchedulerConfig
from turbospark.engine.speculative import SpeculativeConfig, Speculator
from turbospark.ratecontrol import RateControl

if TYPE_CHECKING:
    from turbospark.engine.parallel import TensorParallelGroup
    from turbospark.engine.vision import ImagePrompt, VisionSpec
    from turbospark.tokenizer import Tokenizer

log = logging.getLogger("turbospark.engine")

DEFAULT_MAX_CONTEXT = 8192  # when a checkpoint does not say
BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RealChatModel(ChatModelDefaults):
    def __init__(
        self,
        model_id: str,
        model: Model,
        tokenizer: Tokenizer,
        *,
        max_context: int = DEFAULT_MAX_CONTEXT,
        device: torch.device | str = "cpu",
        num_kv_blocks: int | None = None,
        scheduler: SchedulerConfig | None = None,
        rate: RateControl | None = None,
        tensor_parallel: TensorParallelGroup | None = None,
        kv_dtype: torch.dtype | None = None,
        sampling: SamplingDefaults | None = None,
        vision: VisionSpec | None = None,
        speculative: SpeculativeConfig | None = None,
        piecewise_graphs: bool = True,
    ) -> None:
        """`vision`: how this model reads images (None: it refuses them). `num_kv_blocks` sizes
        the KV cache (default: one full context per running sequence,
        at most 4; its elements `kv_dtype`, default the model's); the context never exceeds what
        the cache holds. With `tensor_parallel`,
        `model` is rank 0's shard and every engine step runs on all ranks of the group (the
        runner's one-sequence reference path, `forward` / `generate`, is single-process only)."""
        self.model_id = model_id
        self._tokenizer = tokenizer
        self._vision = vision
        if vision is not None and tensor_parallel is not None:
            raise ValueError("a vision model runs in one process (no --tensor-parallel)")
        self._sampling = sampling or SamplingDefaults()
        scheduler = scheduler or SchedulerConfig()
        context = min(max_context, model.config.max_position_embeddings, model.max_positions)
        if num_kv_blocks is None:
            num_kv_blocks = -(-context // BLOCK_SIZE) * min(scheduler.max_active, 4)
        self._max_context = min(context, num_kv_blocks * BLOCK_SIZE)
        self._runner = ModelRunner(
            model,
            max_context=self._max_context,
            num_blocks=num_kv_blocks,
            block_size=BLOCK_SIZE,
            device=device,
            kv_dtype=kv_dtype,
            max_step_tokens=scheduler.max_batched_tokens if piecewise_graphs else 0,
        )
        self.tensor_parallel = tensor_parallel
        step_runner: StepRunner = self._runner
        if tensor_parallel is not None:
            from turbospark.engine.parallel import TensorParallelRunner

            job = tensor_parallel.job
            # the workers built their runners from the same numbers: the caches' blocks match
            assert (job.max_context, job.num_blocks, job.block_size) == (
                self._max_context,
                num_kv_blocks,
                BLOCK_SIZE,
            ), "tensor-parallel workers were sized differently from rank 0"
            step_runner = TensorParallelRunner(self._runner, tensor_parallel)
        speculator = None
        if speculative is not None:
            if tensor_parallel is not None:  # the workers' step message carries no draft logits
                log.info("%s: speculative decoding is off under tensor parallelism", model_id)
            else:
                if self._runner.device.type == "cpu" and speculative.max_rows is None:
                    speculative = dataclasses.replace(speculative, max_rows=row_kernels.DECODE_GROUP)
                speculator = Speculator(speculative, model=model_id)
        self.engine = Engine(
            step_runner,
            Scheduler(scheduler, self._runner.block_manager),
            max_context=self._max_context,
            rate=rate,
            name=model_id,
            speculator=speculator,
        )

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

    def vision(self) -> VisionInfo | None:
        spec = self._vision
        if spec is None:
            return None
        return VisionInfo(max_pixels=spec.processor.max_pixels, image_token=spec.image_token)

    def sampling_defaults(self) -> SamplingDefaults:
        """The sampler settings the checkpoint recommends (generation_config.json or GGUF metadata)."""
        return self._sampling

    def details(self) -> ModelDetails:
        """Family, size and weight format, read off the loaded model (weights as held in memory;
        with tensor parallelism, every rank's shard together)."""
        model = self._runner.model
        assert isinstance(model, torch.nn.Module)
        count, size, kinds = weight_stats(model)
        if self.tensor_parallel is not None:
            count += sum(s["num_parameters"] for s in self.tensor_parallel.worker_stats)
            size += sum(s["size_bytes"] for s in self.tensor_parallel.worker_stats)
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
        prompt_ids, state = self._with_images(prompt_ids, images)
        self._check(prompt_ids)
        return self.engine.run(prompt_ids, config, cancel, on_progress, runner_state=state)

    def submit_completion(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        images: Sequence[RequestImage] | None,
        cancel: CancelFlag,
        outbox: Outbox,
    ) -> Submission | None:
        if images:
            return None  # decoding and preprocessing run on the request's worker thread
        self._check(prompt_ids)
        return Delivery(self.engine, self.engine.submit(prompt_ids, config, cancel, outbox=outbox))

    def close(self) -> None:
        """Unloads the model: stops the engine (sequences still in it are cancelled) and the
        tensor-parallel workers; the weights and KV cache go once nothing else holds them."""
        self.engine.stop(wait=10.0)
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
            self.tensor_parallel = None

    def _with_images(
        self, prompt_ids: Sequence[int], images: Sequence[RequestImage] | None
    ) -> tuple[Sequence[int], ImagePrompt | None]:
        """The prompt with its images' tokens spliced in, and the images for the engine."""
        if not images:
            return prompt_ids, None
        if self._vision is None:
            raise BackendError(f"model {self.model_id!r} does not accept images: it has no vision tower")
        from turbospark.engine.vision import expand_prompt

        ids, state = expand_prompt(prompt_ids, images, self._vision, self._tokenizer)
        if len(ids) >= self._max_context:
            raise BackendError(
                f"with its images the prompt is {len(ids)} tokens, which does not fit model "
                f"{self.model_id!r}'s context of {self._max_context} tokens (at least one token must be "
                "left for the reply)"
            )
        return ids, state

    def _check(self, prompt_ids: Sequence[int]) -> None:
        if not prompt_ids:
            raise BackendError("the prompt is empty")
        if len(prompt_ids) > self._max_context:
            raise BackendError(
                f"the prompt has {len(prompt_ids)} tokens, more than model {self.model_id!r}'s context "
                f"of {self._max_context}"
            )
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise BackendError(f"prompt token ids must lie in [0, {self.vocab_size})")


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
        if not is_cpu:
            torch_dtype = torch.bfloat16
        elif quant is not None:
            # bf16 where the CPU has it natively; float32 where it is emulated (cpu_kernels)
            from turbospark.engine.cpu_kernels import cpu_kernels

            torch_dtype = cpu_kernels().activation_dtype
        else:
            torch_dtype = torch.float32
    elif dtype in DTYPES:
        torch_dtype = DTYPES[dtype]
    else:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return torch_dtype, quant


KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_kv_dtype(device: str, activation_dtype: torch.dtype, kv_dtype: str | None) -> torch.dtype:
    """The KV cache's dtype: `kv_dtype` when given, else ("auto") float16 on a CPU whose decode
    attention is the native kernel over float32 activations (half the bytes each decode step
    reads at long contexts, llama.cpp's default too), else the activations' dtype."""
    if kv_dtype not in (None, "auto"):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"unknown KV cache dtype {kv_dtype!r} (choose from auto, {', '.join(KV_DTYPES)})"
            )
        chosen = KV_DTYPES[kv_dtype]
        if torch.device(device).type != "cpu" and chosen != activation_dtype:
            raise ValueError(f"on {device} the KV cache is in the model's dtype ({activation_dtype})")
        return chosen
    if torch.device(device).type == "cpu" and activation_dtype == torch.float32:
        from turbospark.engine.cpu_kernels import native_kernels_for

        if native_kernels_for(torch.empty(1, 1)) is not None:
            return torch.float16
    return activation_dtype


def load_backend(
    spec: str,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    max_context: int | None = None,
    quant: str | None = "auto",
    progress: bool = True,
    kv_cache_gb: float | None = None,
    kv_cache_dtype: str | None = None,
    scheduler: SchedulerConfig | None = None,
    rate: RateControl | None = None,
    tensor_parallel: int = 1,
    speculative: SpeculativeConfig | None = None,
    disk_cache_gb: float = 0.0,
    disk_cache_dir: str | None = None,
    piecewise_graphs: bool = True,
    kv_sequences: int | None = None,
    mmproj: str | None = None,
    find_mmproj: bool = True,
) -> RealChatModel:
    """Loads a checkpoint (path, hub-cache id or bundled name) and returns its backend.

    `mmproj`: a GGUF model's llama.cpp vision projector file (`turbospark.engine.mmproj`); without
    it, and with `find_mmproj`, an `mmproj*.gguf` beside the model file is used.

    `disk_cache_gb` > 0 keeps the prefix cache's blocks on disk too, up to that size (under
    `disk_cache_dir`, default the cache folder's prefix-cache/), so a restarted server reads a
    prompt it computed before (`engine/disk_cache.py`; one process only). `piecewise_graphs`:
    on CUDA, steps that mix prefill and decode replay piecewise graphs too, not only decode
    steps (`engine/cuda_graphs.py`).

    The context is the model's own, bounded by the KV cache (`kv_cache_gb`, default
    `default_kv_cache_bytes`; `kv_cache_dtype` as `resolve_kv_dtype`) and by `max_context`
    when given. `tensor_parallel` > 1 splits the
    model over that many processes (`turbospark.engine.parallel`): this one is rank 0, the
    others are started here and stop when it does. On CPU the cores and the KV budget are shared
    by the ranks; on CUDA each rank has its own GPU, from `device`'s index on, and the budget is
    per GPU.
    """
    from turbospark.engine.loader import DEFAULT_MODEL, load_checkpoint
    from turbospark.engine.models import build_model
    from turbospark.tokenizer import Tokenizer

    torch_dtype, quant = resolve_numerics(device, dtype, quant)
    kv_dtype = resolve_kv_dtype(device, torch_dtype, kv_cache_dtype)
    if tensor_parallel != 1:
        from turbospark.engine.parallel import check_devices

        check_devices(device, tensor_parallel)
    fix_mmap_threshold()
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        from turbospark.engine.cpu_kernels import cpu_kernels, set_intra_op_threads

        threads = set_intra_op_threads()
        log.info("%s; %d intra-op threads", cpu_kernels().describe(), threads)
    load_kwargs: dict[str, Any] = {"progress": progress}
    if mmproj:
        load_kwargs["mmproj"] = mmproj
    if not find_mmproj:
        load_kwargs["find_mmproj"] = False
    load_dtype = torch.bfloat16 if quant is not None else torch_dtype
    if load_dtype != torch.float32 and "dtype" in inspect.signature(load_checkpoint).parameters:
        # a GGUF dequantizes straight to bf16 when the weights get quantized anyway (or when bf16
        # is the compute dtype): half the float32 peak
        load_kwargs["dtype"] = load_dtype
    ckpt = load_checkpoint(spec, **load_kwargs)
    release_freed_memory()  # the loader's dequantization scratch, before the model's own
    if tensor_parallel != 1:
        from turbospark.engine.tensor_parallel import check_tensor_parallel

        check_tensor_parallel(ckpt.config, tensor_parallel)
    sizes = ckpt.config.get("text_config") or ckpt.config  # a vision model: its text model's
    model_max = int(sizes.get("max_position_embeddings", DEFAULT_MAX_CONTEXT))
    per_token = _kv_bytes_per_token(sizes, kv_dtype)
    if torch.device(device).type == "cuda":
        per_token //= tensor_parallel  # each GPU holds its ranks' kv heads in its own memory
    if kv_cache_gb:
        budget = int(kv_cache_gb * 2**30)
    else:  # measured before the weights reach the device: their share is set aside
        weights = sum(t.numel() for t in ckpt.tensors.values()) * torch_dtype.itemsize // tensor_parallel
        budget = default_kv_cache_bytes(device, weights)
    if kv_sequences:  # room for that many full contexts, no more (a draft model's cache)
        budget = (
            per_token * -(-min(max_context or model_max, model_max) // BLOCK_SIZE) * BLOCK_SIZE * kv_sequences
        )
    num_kv_blocks = max(1, budget // (per_token * BLOCK_SIZE))
    context = min(max_context or model_max, model_max, num_kv_blocks * BLOCK_SIZE)
    if quant == "auto":
        from turbospark.engine.quant import auto_quant

        quant = auto_quant(ckpt.tensors)
    group = None
    if tensor_parallel > 1:
        from turbospark.engine import kernel_settings
        from turbospark.engine.parallel import CheckpointSource, TensorParallelGroup, WorkerJob

        job = WorkerJob(
            source=CheckpointSource(spec, {**load_kwargs, "progress": False}),
            device=device,
            dtype=torch_dtype,
            quant=quant,
            max_positions=context,
            max_context=context,
            num_blocks=num_kv_blocks,
            block_size=BLOCK_SIZE,
            threads=max(1, threads // tensor_parallel),
            kv_dtype=kv_dtype,
            kernel_settings=kernel_settings.current(),
        )
        group = TensorParallelGroup.launch(tensor_parallel, job)  # they load while this rank does
    tensors = dict(ckpt.tensors)
    ckpt.tensors = {}  # the model build consumes the weights one by one (a lower peak)
    try:
        model = build_model(
            ckpt.config,
            tensors,
            group.device if group else device,
            torch_dtype,
            quant=quant,
            max_positions=context,
            consume=True,
            shard=group.shard if group else None,
        )
        del tensors
        if group is not None:
            group.wait_ready()
        tokenizer = Tokenizer(ckpt.tokenizer, ckpt.tokenizer_config)
        # The embedded default is served as "smollm2", the name the README's requests use (and
        # "claude-turbospark-smollm2" for Claude Code), not as its display name SmolLM2-135M-Instruct.
        name = DEFAULT_MODEL if spec.strip() in ("", DEFAULT_MODEL) else ckpt.name
        sampling = ckpt.sampling
        source = ckpt.source
        extra_weights = (ckpt.mmproj,) if ckpt.mmproj else ()
        vision = _vision_spec(model, source, tokenizer, ckpt.preprocessor)
        del ckpt  # the float checkpoint tensors are no longer needed once the model holds its own
        release_freed_memory()
        backend = RealChatModel(
            name,
            model,
            tokenizer,
            max_context=context,
            device=group.device if group else device,
            num_kv_blocks=num_kv_blocks,
            scheduler=scheduler,
            rate=rate,
            tensor_parallel=group,
            kv_dtype=kv_dtype,
            sampling=sampling,
            vision=vision,
            speculative=speculative,
            piecewise_graphs=piecewise_graphs,
        )
        if speculative is not None and speculative.draft_model is not None:
            attach_draft(backend, speculative.draft_model, device=device, dtype=dtype, quant=quant)
        if disk_cache_gb > 0:
            attach_disk_cache(backend, source, disk_cache_gb, disk_cache_dir, extra_weights)
        return backend
    except BaseException:
        if group is not None:
            group.close()
        raise


DRAFT_PROBE = "def main() -> None:\n    print('hello, world')  # ünïcödé, 東京, 🙂\n"


def attach_draft(
    backend: RealChatModel, spec: str, *, device: str, dtype: str | None, quant: str | None
) -> None:
    """Loads the draft model of `--speculative draft:MODEL` (same device and numerics, a KV cache
    for the speculator's `max_batch` sequences) and makes it the engine speculator's proposer.
    A draft that does not tokenize as the target does is refused by name: its ids would mean
    other text."""
    from turbospark.engine.draft import DraftProposer

    speculator = backend.engine.speculator
    if speculator is None:  # tensor parallelism: no speculation
        return
    seqs = speculator.config.max_batch
    draft = load_backend(
        spec,
        device=device,
        dtype=dtype,
        quant=quant,
        progress=False,
        max_context=backend.max_context,
        kv_sequences=seqs,
        find_mmproj=False,  # a draft proposes text only
    )
    same = draft.vocab_size == backend.vocab_size and draft.tokenizer.encode(
        DRAFT_PROBE
    ) == backend.tokenizer.encode(DRAFT_PROBE)
    if not same:
        raise ValueError(
            f"draft model {spec!r} does not tokenize as {backend.model_id!r} does (vocabulary "
            f"{draft.vocab_size} vs {backend.vocab_size}): a draft model must share the target's tokenizer"
        )
    if draft.max_context < backend.max_context:
        log.info(
            "%s: the draft model %s drafts up to %d tokens of context",
            backend.model_id,
            spec,
            draft.max_context,
        )
    speculator.proposer = DraftProposer(draft.runner, max_seqs=seqs)
    log.info("%s: speculative drafts from %s", backend.model_id, draft.model_id)


def attach_disk_cache(
    backend: RealChatModel,
    source: str,
    size_gb: float,
    root: str | Path | None = None,
    extra_weights: tuple[str, ...] = (),
) -> None:
    """Gives the backend's prefix cache a disk store under `root` (see load_backend);
    `extra_weights`: weight files besides `source` (an mmproj) that its fingerprint names too."""
    if backend.tensor_parallel is not None:
        log.info("%s: the disk prefix cache is off under tensor parallelism", backend.model_id)
        return
    from turbospark.engine.checkpoint import cache_dir
    from turbospark.engine.disk_cache import DiskBlockStore, fingerprint

    kv = backend.runner.kv_cache
    base = Path(root).expanduser() if root else cache_dir() / "prefix-cache"
    folder = base / fingerprint(source, kv.k, kv.block_size, extra_weights)
    store = DiskBlockStore(folder, kv.k, kv.v, kv.block_size, int(size_gb * 2**30))
    backend.runner.block_manager.store = store
    log.info(
        "%s: prefix cache on disk in %s (%d blocks there, up to %.1f GB)",
        backend.model_id,
        folder,
        len(store),
        size_gb,
    )


def _vision_spec(
    model: Model, source: str, tokenizer: Tokenizer, preprocessor: dict[str, Any] | None = None
) -> VisionSpec | None:
    """How a vision family's checkpoint reads images (its folder's preprocessor_config.json, or
    `preprocessor` when the checkpoint brings its own, as a GGUF mmproj does, read by the
    family's image processor); None for a text model."""
    if not hasattr(model, "encode_images"):
        return None
    from pathlib import Path

    from turbospark.engine.models import qwen2_vl
    from turbospark.engine.vision import Idefics3ImageProcessor, Qwen2VLImageProcessor, VisionSpec

    path = Path(source)
    folder = path if path.is_dir() else path.parent
    if isinstance(model, qwen2_vl.CausalLM):  # Qwen2-VL and Qwen2.5-VL
        token = "<|image_pad|>"
        image_id = model.image_token_id
        if tokenizer.token_to_id(token) != image_id:
            raise ValueError(f"{source}: {token} in tokenizer.json is not image_token_id {image_id}")
        processor = (
            Qwen2VLImageProcessor.from_config(preprocessor)
            if preprocessor is not None
            else Qwen2VLImageProcessor.from_folder(folder)
        )
        merge = model.spatial_merge_size
        if processor.merge_size != merge:
            raise ValueError(
                f"{source}: preprocessor_config.json merges {processor.merge_size} patches per side, the "
                f"vision tower {merge}"
            )
        return VisionSpec(processor=processor, image_token=token, image_token_id=image_id)
    marker = tokenizer.token_to_id("<image>")
    if marker is None:
        raise ValueError(f"{source}: the tokenizer has no <image> token")
    return VisionSpec(
        processor=Idefics3ImageProcessor.from_config(preprocessor)
        if preprocessor is not None
        else Idefics3ImageProcessor.from_folder(folder),
        image_token="<image>",
        image_token_id=marker,
        seq_len=int(model.image_seq_len),  # type: ignore[attr-defined]
    )


def _kv_bytes_per_token(config: dict[str, Any], dtype: torch.dtype) -> int:
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * dtype.itemsize


def default_kv_cache_bytes(device: str, weight_bytes: int = 0) -> int:
    """A fifth of the memory free now (at most 8 GiB) on CPU; on a GPU 85% of the device memory
    free once the model's weights (`weight_bytes`, not loaded yet) are on it, at least 1 GiB.

    On CPU the cache is allocated untouched, so only blocks that hold tokens become resident.
    """
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return max(int((free - weight_bytes) * 0.85), 2**30)
    available = 4 * 2**30
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    return min(available // 5, 8 * 2**30)
