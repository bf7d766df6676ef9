"""Command line: `turbospark serve`, `turbospark pull`, `turbospark chat`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from turbospark import metrics
from turbospark.backend import NO_SAMPLING_DEFAULTS, ChatModel, ReasoningEffort, SamplingDefaults
from turbospark.engine.scheduler import SchedulerConfig
from turbospark.limits import Limits
from turbospark.ratecontrol import RateControl, parse_thermal_steps, temperature_source
from turbospark.registry import ModelRegistry, ServedModel, model_kinds
from turbospark.scripted import DEMO_MAX_CONTEXT, DEMO_REPLY, ScriptedChatModel
from turbospark.toolcalls.guardrails import GuardrailConfig

log = logging.getLogger("turbospark")


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The scheduler settings the command line gives; the dataclass's defaults for the rest."""
    names = ("max_active", "max_waiting", "max_batched_tokens", "max_prefill_tokens")
    return SchedulerConfig(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})


def rate_control(args: argparse.Namespace) -> RateControl:
    """The process-wide cap every engine paces against."""
    steps = getattr(args, "thermal_steps", None)
    source = getattr(args, "thermal_source", None)
    return RateControl(
        getattr(args, "max_decode_rate", None),
        thermal_steps=parse_thermal_steps(steps) if steps else (),
        temperature=temperature_source(source or ("auto" if steps else None)),
    )


def load_model(spec: str, args: argparse.Namespace, rate: RateControl | None = None) -> ChatModel:
    if spec == "scripted" or spec.startswith("scripted:"):
        replies = None
        if spec.startswith("scripted:"):
            path = Path(spec.split(":", 1)[1])
            replies = [r for r in path.read_text(encoding="utf-8").split("\n---\n") if r]
        return ScriptedChatModel(
            replies or (DEMO_REPLY,),
            max_context=args.max_context or DEMO_MAX_CONTEXT,
            scheduler=scheduler_config(args),
            rate=rate,
        )
    from turbospark.engine.embedder import is_encoder_spec, load_embedding_model

    if is_encoder_spec(spec):  # an encoder (BERT) folder or the packaged all-minilm-l6-v2
        if getattr(args, "tensor_parallel", 1) > 1:
            log.info(
                "%s: embedding models run in one process; --tensor-parallel splits generating ones", spec
            )
        return load_embedding_model(spec, device=args.device, dtype=args.dtype, max_context=args.max_context)
    from turbospark.engine.backend import load_backend

    backend: ChatModel = load_backend(
        spec,
        device=args.device,
        dtype=args.dtype,
        max_context=args.max_context,
        quant=args.quant,
        kv_cache_gb=getattr(args, "kv_cache_gb", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
        scheduler=scheduler_config(args),
        rate=rate,
        tensor_parallel=getattr(args, "tensor_parallel", 1),
    )
    return backend


def model_specs(args: argparse.Namespace) -> list[str]:
    """--model as given; without it the embedded chat model plus the packaged embedding model
    (when its package is installed)."""
    if args.model:
        return list(args.model)
    from turbospark.engine.loader import EMBEDDING_MODEL, ModelNotFound, embedding_model_path

    try:
        embedding_model_path()
    except ModelNotFound as exc:
        log.warning("serving no embedding model: %s", exc)
        return ["smollm2"]
    return ["smollm2", EMBEDDING_MODEL]


def load_into(registry: ModelRegistry, args: argparse.Namespace) -> None:
    """Loads every --model into the registry; /health answers 503 until the last one is in."""
    system = args.system
    if args.system_file:
        system = Path(args.system_file).read_text(encoding="utf-8")
    rate = rate_control(args)
    metrics.watch_rate(rate)
    for spec in model_specs(args):
        try:
            backend = load_model(spec, args, rate)
        except Exception as exc:
            raise ModelLoadError(f"cannot load model {spec!r}: {type(exc).__name__}: {exc}") from exc
        served = registry.add(
            ServedModel(
                backend,
                guardrails=GuardrailConfig(enabled=not args.no_guardrails),
                default_system=system,
                default_reasoning=ReasoningEffort(args.reasoning or ReasoningEffort.OFF),
                # None: the model's own recommendation, else the built-in truncation
                sampling=NO_SAMPLING_DEFAULTS if args.sampling_defaults == "none" else None,
            )
        )
        registry.num_loading -= 1
        log.info("serving %s (aliases: %s)", backend.model_id, ", ".join(served.names()[1:]))
        if "completion" in model_kinds(backend):
            log.info(
                "%s: unset sampler settings default to %s",
                backend.model_id,
                describe(served.sampling_defaults),
            )


def describe(sampling: SamplingDefaults) -> str:
    """'temperature 0.7, top_p 0.8, ... (generation_config.json over built-in)' for the log."""
    values = (
        ("temperature", sampling.temperature),
        ("top_p", sampling.top_p),
        ("top_k", sampling.top_k),
        ("min_p", sampling.min_p),
        ("repetition_penalty", sampling.repetition_penalty),
    )
    shown = ", ".join(f"{name} {value:g}" for name, value in values if value is not None)
    return f"{shown} ({sampling.source})" if sampling.source else shown


class ModelLoadError(RuntimeError):
    """A --model that cannot be loaded; the message names the model and the reason."""


API_KEY_ENV = "TURBOSPARK_API_KEY"


def api_keys(args: argparse.Namespace) -> frozenset[str]:
    """Keys from --api-key, --api-key-file (one per line, '#' comments) and $TURBOSPARK_API_KEY."""
    keys = [k.strip() for k in args.api_key or []]
    if args.api_key_file:
        text = Path(args.api_key_file).read_text(encoding="utf-8")
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if os.environ.get(API_KEY_ENV, "").strip():
        keys.append(os.environ[API_KEY_ENV].strip())
    if any(not k for k in keys):
        raise ValueError("an API key may not be empty")
    return frozenset(keys)


LIMIT_FLAGS = (
    "max_body_bytes",
    "max_messages",
    "max_prompt_tokens",
    "max_output_tokens",
    "max_tools",
    "max_image_bytes",
    "max_image_pixels",
)


def limits_from(args: argparse.Namespace) -> Limits:
    given = {name: getattr(args, name) for name in LIMIT_FLAGS if getattr(args, name, None) is not None}
    return Limits(**given)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from turbospark.api.common import ServerState
    from turbospark.server import GracefulServer, create_app

    try:
        keys = api_keys(args)
    except (OSError, ValueError) as exc:
        log.error("API keys: %s", exc)
        return 2
    if args.system_file and not Path(args.system_file).is_file():
        log.error("--system-file %s: no such file", args.system_file)
        return 2
    if getattr(args, "fast_nondeterministic", False):
        from turbospark.engine import row_kernels

        os.environ[row_kernels.ENV_VAR] = "1"  # read per step; set before any model loads
    limits = limits_from(args)
    registry = ModelRegistry(fallback=args.fallback_model, limits=limits)
    args.model = model_specs(args)
    registry.num_loading = len(args.model)
    state = ServerState(registry=registry, api_keys=keys, max_body_bytes=limits.max_body_bytes)
    app = create_app(state, cors_origins=args.cors_origins or ())
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    server = GracefulServer(config, state.shutdown, grace_seconds=args.shutdown_timeout)

    def load() -> None:
        try:
            load_into(registry, args)
        except Exception as exc:  # a model that cannot load stops the server with its reason
            log.error("%s", exc)
            server.should_exit = True
            failed.append(exc)

    # The server answers (health: 503 "loading") while the weights load.
    failed: list[Exception] = []
    threading.Thread(target=load, name="turbospark-load", daemon=True).start()
    server.run()
    return 1 if failed else 0


def pull(args: argparse.Namespace) -> int:
    from turbospark.engine.pull import pull as pull_model

    path = pull_model(args.name, progress=True)
    print(path)
    return 0


def chat(args: argparse.Namespace) -> int:
    from turbospark.chat import run_chat

    backend = load_model(args.model or "smollm2", args)
    effort = ReasoningEffort(args.reasoning) if args.reasoning else None
    return run_chat(
        backend,
        system=args.system,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        reasoning=effort,
    )


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="turbospark", description="Local LLM inference server")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve models over the OpenAI, Anthropic and Ollama APIs")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--model",
        action="append",
        help="a GGUF path, a Hugging Face folder or cached id, a pulled name (qwen2.5-coder:0.5b), "
        "'scripted' (a demo backend with no weights), 'smollm2' (the embedded default) or "
        "'all-minilm-l6-v2' (the packaged embedding model); repeatable (default: both of those)",
    )
    s.add_argument("--fallback-model", help="serve requests for unknown model ids with this model")
    group = s.add_mutually_exclusive_group()
    group.add_argument("--system", help="default system prompt for requests that carry none")
    group.add_argument("--system-file", help="read the default system prompt from this file")
    s.add_argument("--reasoning", choices=[e.value for e in ReasoningEffort], help="default reasoning effort")
    s.add_argument(
        "--api-key",
        action="append",
        help=f"require this key (Bearer or x-api-key; /health stays open); repeatable; also read from "
        f"${API_KEY_ENV}",
    )
    s.add_argument("--api-key-file", help="read API keys from this file, one per line")
    s.add_argument(
        "--cors-origins",
        type=lambda v: [o.strip() for o in v.split(",") if o.strip()],
        help="comma-separated origins browsers may call from ('*' for any); default: CORS off",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running replies get to finish before they are ended (default 30)",
    )
    s.add_argument("--no-guardrails", action="store_true", help="turn tool-call repair and validation off")
    s.add_argument(
        "--sampling-defaults",
        choices=["model", "none"],
        default="model",
        help="sampler settings a request leaves unset: 'model' (default) takes the model's "
        "generation_config.json / GGUF general.sampling values, else top_k 40, top_p 0.95, "
        "min_p 0.05 (llama.cpp's); 'none' samples with temperature alone, nothing truncated",
    )
    s.add_argument("--max-decode-rate", type=float, help="cap decoded tokens per second, process-wide")
    s.add_argument(
        "--thermal-steps",
        help="lower the decode-rate cap as the temperature rises: TEMP:RATE,... (e.g. 70:20,80:5)",
    )
    s.add_argument(
        "--thermal-source",
        help="where temperatures come from: auto (default with --thermal-steps), linux, nvml, file:PATH",
    )
    sched = SchedulerConfig()
    s.add_argument(
        "--max-active", type=int, default=sched.max_active, help="sequences batched together per model"
    )
    s.add_argument(
        "--max-waiting",
        type=int,
        default=sched.max_waiting,
        help="requests waiting per model before 429",
    )
    s.add_argument(
        "--max-batched-tokens",
        type=int,
        default=sched.max_batched_tokens,
        help="tokens one engine step feeds (prompt chunks and decodes together)",
    )
    s.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=sched.max_prefill_tokens,
        help="tokens a step feeds when no sequence in it is decoding (a prompt alone: bigger chunks)",
    )
    s.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="KV-cache budget per model in GiB (default: a fifth of free memory, at most 8)",
    )
    s.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="KV-cache element type (auto: float16 on CPUs that run turbospark's AVX2 kernels, "
        "else the model's dtype)",
    )
    s.add_argument(
        "--fast-nondeterministic",
        action="store_true",
        help="CPU: pick kernels by a step's row count (faster mixed steps and large batches; a "
        "request's tokens may then depend on the batch, the prefix cache and the chunking)",
    )
    s.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    s.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="N",
        help="split each generating model over N processes (one GPU each on cuda, from --device's "
        "index on; the cores shared on cpu); heads and kv heads must divide by N (default 1)",
    )
    s.add_argument("--dtype", default=None, help="weight dtype (default: the engine's choice for the device)")
    s.add_argument("--max-context", type=int, default=None, help="cap the context length")
    s.add_argument(
        "--quant",
        choices=["auto", "int8", "int4", "none"],
        default="auto",
        help="weight-only quantization (auto: int4 for Q4 GGUF weights, else int8, on CPU)",
    )
    defaults = Limits()
    limits = s.add_argument_group("request limits (each refused with a 4xx that names it)")
    for flag, default, what in (
        ("--max-body-bytes", defaults.max_body_bytes, "request body size"),
        ("--max-messages", defaults.max_messages, "messages per request"),
        ("--max-prompt-tokens", None, "prompt tokens (default: the model's context)"),
        ("--max-output-tokens", defaults.max_output_tokens, "max_tokens a request may ask for"),
        ("--max-tools", defaults.max_tools, "tools per request"),
        ("--max-image-bytes", defaults.max_image_bytes, "bytes per image"),
        ("--max-image-pixels", defaults.max_image_pixels, "pixels per image (read from its header)"),
    ):
        shown = "" if default is None else f" (default {default})"
        limits.add_argument(flag, type=int, default=None, help=what + shown)
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=serve)

    pl = sub.add_parser("pull", help="assemble an optional model from its registry packages")
    pl.add_argument("name", help="qwen2.5-coder:0.5b or qwen2.5-coder:1.5b")
    pl.set_defaults(func=pull)

    c = sub.add_parser("chat", help="chat with a model in the terminal")
    c.add_argument("--model", help="as for serve (default: the embedded smollm2)")
    c.add_argument("--system", help="system prompt")
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--reasoning", choices=[e.value for e in ReasoningEffort])
    c.add_argument("--device", default="cpu")
    c.add_argument("--dtype", default=None)
    c.add_argument("--max-context", type=int, default=None)
    c.add_argument("--quant", choices=["auto", "int8", "int4", "none"], default="auto")
    c.set_defaults(func=chat, log_level="warning")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    level = getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
