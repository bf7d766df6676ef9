"""Command line: `turbospark serve`, `pull`, `list`, `ps`, `rm`, `cp`, `launch` and `chat`."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from turbospark import metrics
from turbospark.backend import (
    NO_SAMPLING_DEFAULTS,
    Backend,
    ChatModel,
    Embedder,
    ReasoningEffort,
    SamplingDefaults,
)
from turbospark.engine import kernel_settings
from turbospark.engine.scheduler import SchedulerConfig
from turbospark.engine.speculative import SpeculativeConfig, default_method, parse_speculative
from turbospark.launch import AGENTS, DEFAULT_DISK_CACHE_GB
from turbospark.limits import Limits
from turbospark.plan import AGENT_CORE_TOOLS
from turbospark.ratecontrol import RateControl, parse_thermal_steps, temperature_source
from turbospark.registry import DEFAULT_KEEP_ALIVE, DEFAULT_LOOP_GUARD, ModelRegistry, ServedModel
from turbospark.scripted import DEMO_MAX_CONTEXT, DEMO_REPLY, ScriptedChatModel
from turbospark.toolcalls.guardrails import GuardrailConfig

log = logging.getLogger("turbospark")
# CUDA steps that mix prefill and decode replay piecewise graphs (engine/cuda_graphs.py)
PIECEWISE_GRAPHS = True


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The scheduler settings the command line gives; the dataclass's defaults for the rest."""
    names = ("max_active", "max_waiting", "max_batched_tokens", "max_prefill_tokens")
    return SchedulerConfig(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """--speculative and --num-speculative-tokens (`engine.speculative`); None: off. Raises
    ValueError naming a method that does not exist."""
    return parse_speculative(
        getattr(args, "speculative", None) or default_method(getattr(args, "device", None) or "cpu"),
        getattr(args, "num_speculative_tokens", None),
    )


def rate_control(args: argparse.Namespace) -> RateControl:
    """The process-wide cap every engine paces against."""
    steps = getattr(args, "thermal_steps", None)
    source = getattr(args, "thermal_source", None)
    return RateControl(
        getattr(args, "max_decode_rate", None),
        thermal_steps=parse_thermal_steps(steps) if steps else (),
        temperature=temperature_source(source or ("auto" if steps else None)),
    )


def load_model(spec: str, args: argparse.Namespace, rate: RateControl | None = None) -> Backend:
    if spec == "scripted" or spec.startswith("scripted:"):
        replies = None
        if spec.startswith("scripted:"):
            path = Path(spec.split(":", 1)[1])
            replies = [r for r in path.read_text(encoding="utf-8").split("\n---\n") if r]
        scripted: ChatModel = ScriptedChatModel(
            replies or (DEMO_REPLY,),
            max_context=args.max_context or DEMO_MAX_CONTEXT,
            scheduler=scheduler_config(args),
            rate=rate,
        )
        enable_step_profile(scripted, args)
        return scripted
    from turbospark.engine.embedder import is_encoder_spec, load_embedding_model

    if is_encoder_spec(spec):  # an encoder (BERT) folder or the packaged all-minilm-l6-v2
        if getattr(args, "tensor_parallel", 1) > 1:
            log.info(
                "%s: embedding models run in one process; --tensor-parallel splits generating ones", spec
            )
        embedder: Embedder = load_embedding_model(
            spec, device=args.device, dtype=args.dtype, max_context=args.max_context
        )
        return embedder
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
        speculative=speculative_config(args),
        disk_cache_gb=disk_cache_gb(args),
        disk_cache_dir=getattr(args, "prefix_cache_dir", None),
        piecewise_graphs=getattr(args, "piecewise_graphs", PIECEWISE_GRAPHS),
        mmproj=mmproj_for(spec, args),
    )
    enable_step_profile(backend, args)
    return backend


def mmproj_for(spec: str, args: argparse.Namespace) -> str | None:
    """--mmproj goes with the first --model (other GGUF models find an mmproj*.gguf beside them)."""
    mmproj = getattr(args, "mmproj", None)
    models = getattr(args, "model", None) or []
    if not mmproj:
        return None
    first = models[0] if isinstance(models, list) and models else models
    return str(mmproj) if spec == first else None


def enable_step_profile(backend: Backend, args: argparse.Namespace) -> None:
    """--profile-steps N: the backend's engine logs the split of its steps' time every N steps
    (`turbospark.engine.profile`), shown whatever --log-level says."""
    every = getattr(args, "profile_steps", None)
    if not every:
        return
    from turbospark.engine.engine import Engine
    from turbospark.engine.profile import log as profile_log

    engine = getattr(backend, "engine", None)
    if isinstance(engine, Engine):
        engine.enable_profile(every)
        profile_log.setLevel(logging.INFO)
    else:
        log.info("%s: --profile-steps profiles engine steps; this model runs none", backend.model_id)


def disk_cache_gb(args: argparse.Namespace) -> float:
    """The disk prefix cache's bound: --disk-cache-gb, else 8 GiB when only its folder is given."""
    size = float(getattr(args, "disk_cache_gb", 0.0) or 0.0)
    if size <= 0 and getattr(args, "prefix_cache_dir", None):
        return DEFAULT_DISK_CACHE_GB
    return size


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


# `--tool-descriptions auto`: models with fewer parameters read tool descriptions brief. With
# Qwen2.5's tokenizer Claude Code's first request drops from 18,755 to 7,089 tokens; on
# qwen2.5-coder:0.5b the first turn came about 3x sooner on a CPU with the same task score
# (benchmarks/RESULTS.md). Larger models, which can follow the long descriptions, read them whole.
BRIEF_TOOLS_BELOW = 4_000_000_000


def _small(backend: Backend) -> bool:
    """Under `BRIEF_TOOLS_BELOW` parameters: what the `auto` of the tool options looks at (a model
    that does not say its size is not small)."""
    return 0 < backend.details().num_parameters < BRIEF_TOOLS_BELOW


def brief_tools(choice: str, backend: Backend) -> bool:
    """`--tool-descriptions` for one loaded model: brief, full, or auto (brief for `_small`)."""
    if choice != "auto":
        return choice == "brief"
    return _small(backend)


def focus_tools(choice: str, backend: Backend) -> tuple[str, ...]:
    """`--tool-focus` for one loaded model: off, a comma-separated list of tool names, or auto
    (`plan.AGENT_CORE_TOOLS` for `_small` models, else off)."""
    if choice == "off":
        return ()
    if choice == "auto":
        return AGENT_CORE_TOOLS if _small(backend) else ()
    return tuple(name.strip() for name in choice.split(",") if name.strip())


def served_model(spec: str, args: argparse.Namespace, rate: RateControl | None) -> ServedModel:
    """`spec` loaded and wrapped in the server's policy (guardrails, system prompt, reasoning,
    sampling defaults): what serve preloads and what the registry loads on demand."""
    system = args.system
    if args.system_file:
        system = Path(args.system_file).read_text(encoding="utf-8")
    try:
        backend = load_model(spec, args, rate)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {type(exc).__name__}: {exc}") from exc
    served = ServedModel(
        backend,
        guardrails=GuardrailConfig(
            enabled=not args.no_guardrails, constrain_calls=not args.no_constrained_calls
        ),
        default_seed=args.seed,
        loop_guard=args.loop_guard,
        default_system=system,
        tool_prompt=getattr(args, "tool_prompt", None) or None,
        brief_tools=brief_tools(getattr(args, "tool_descriptions", "auto"), backend),
        focus_tools=focus_tools(getattr(args, "tool_focus", "auto"), backend),
        default_reasoning=ReasoningEffort(args.reasoning or ReasoningEffort.OFF),
        # None: the model's own recommendation, else the built-in truncation
        sampling=NO_SAMPLING_DEFAULTS if args.sampling_defaults == "none" else None,
    )
    if isinstance(backend, ChatModel):
        log.info(
            "%s: unset sampler settings default to %s",
            backend.model_id,
            describe(served.sampling_defaults),
        )
    return served


def serving_registry(args: argparse.Namespace) -> ModelRegistry:
    """The registry `serve` serves for `args`, before its --model list is loaded (`load_into`);
    `benchmarks/bench_serving.py --offline` builds the same one, with no HTTP server over it."""
    if getattr(args, "fast_nondeterministic", False):
        from turbospark.engine import row_kernels

        os.environ[row_kernels.ENV_VAR] = "1"  # read per step; set before any model loads
    args.model = model_specs(args)
    registry = build_registry(args)
    registry.num_loading = len(args.model)
    return registry


def build_registry(args: argparse.Namespace) -> ModelRegistry:
    """The server's registry: its store (packaged, pulled and --model-dir models) and a loader
    that builds any of them on a request's demand, under --max-loaded-models and --keep-alive."""
    from turbospark.store import ModelStore

    rate = rate_control(args)
    metrics.watch_rate(rate)
    num_given = len(args.model or ())
    return ModelRegistry(
        fallback=args.fallback_model,
        limits=limits_from(args),
        store=ModelStore(args.model_dir or ()),
        loader=lambda spec: served_model(spec, args, rate),
        max_loaded=args.max_loaded_models or max(3, num_given + 1),
        keep_alive=args.keep_alive,
    )


def load_into(registry: ModelRegistry, args: argparse.Namespace) -> None:
    """Loads every --model into the registry, pinned; /health answers 503 until the last one is
    in. Other models in the store load on a request's demand (`registry.loader`)."""
    assert registry.loader is not None
    for spec in model_specs(args):
        served = registry.load_pinned(spec)
        if registry.store is not None:
            registry.store.remember(served.model_id, spec)
        registry.num_loading -= 1
        log.info("serving %s (aliases: %s)", served.model_id, ", ".join(served.names()[1:]))


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
    try:
        speculative_config(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    try:
        configure_kernels(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    # `kill -USR1 PID` prints every thread's Python stack to the log: what a stuck server is doing
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    limits = limits_from(args)
    registry = serving_registry(args)
    state = ServerState(registry=registry, api_keys=keys, max_body_bytes=limits.max_body_bytes)
    app = create_app(state, cors_origins=args.cors_origins or (), web_ui=not args.no_webui)
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
    from turbospark.engine.checkpoint import ModelLoadError as PullError
    from turbospark.engine.pull import pull as pull_model

    try:
        path = pull_model(args.name.removesuffix(":latest"), progress=True)
    except PullError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _size(num: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num >= scale:
            return f"{num / scale:.1f} {unit}"
    return f"{num} B"


def _ago(timestamp: float) -> str:
    import time

    seconds = max(0.0, time.time() - timestamp)
    for unit, scale in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= scale:
            return f"{int(seconds // scale)} {unit} ago"
    return "just now"


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def list_models(args: argparse.Namespace) -> int:
    """The store as `serve` would see it (the same code), and what can still be pulled."""
    from turbospark.store import ModelStore

    store = ModelStore(args.model_dir or ())
    rows: list[tuple[str, ...]] = [("NAME", "SIZE", "MODIFIED", "FROM")]
    for entry in store.entries():
        rows.append((entry.name, _size(entry.size), _ago(entry.modified), entry.source))
    for name in store.pullable():
        rows.append((name, "-", "-", "pullable: turbospark pull " + name))
    _table(rows)
    return 0


def server_url(host: str) -> str:
    return host if "://" in host else f"http://{host}"


def ps(args: argparse.Namespace) -> int:
    """The running server's loaded models (its /api/ps)."""
    import datetime

    import httpx

    try:
        reply = httpx.get(server_url(args.host) + "/api/ps", timeout=10)
        reply.raise_for_status()
    except httpx.HTTPError as exc:
        print(f"error: no turbospark server answers at {args.host}: {exc}", file=sys.stderr)
        return 1
    rows: list[tuple[str, ...]] = [("NAME", "SIZE", "CONTEXT", "UNTIL")]
    for model in reply.json().get("models", []):
        until = datetime.datetime.fromisoformat(model["expires_at"].replace("Z", "+00:00"))
        left = (until - datetime.datetime.now(datetime.UTC)).total_seconds()
        shown = "forever" if left > 10 * 365 * 86400 else f"{max(0, int(left // 60))} minutes from now"
        rows.append(
            (model["name"], _size(int(model.get("size") or 0)), str(model.get("context_length", "")), shown)
        )
    _table(rows)
    return 0


def rm(args: argparse.Namespace) -> int:
    """Deletes a pulled model or a copy (the store's code, as /api/delete runs it)."""
    from turbospark.store import ModelStore

    store = ModelStore(args.model_dir or ())
    status = 0
    for name in args.names:
        try:
            entry = store.delete(name)
        except (KeyError, PermissionError) as exc:
            print(f"error: {exc.args[0]}", file=sys.stderr)
            status = 1
            continue
        print(f"deleted '{entry.name}'")
    return status


def cp(args: argparse.Namespace) -> int:
    from turbospark.store import ModelStore

    try:
        ModelStore(args.model_dir or ()).copy(args.source, args.destination)
    except (KeyError, ValueError) as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 1
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0


def launch(args: argparse.Namespace) -> int:
    from turbospark.launch import LaunchError
    from turbospark.launch import launch as run_agent

    try:
        return run_agent(
            args.agent,
            model=args.model,
            host=args.host,
            port=args.port,
            agent_args=args.agent_args,
            model_dirs=args.model_dir or (),
        )
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 127 if "not on PATH" in str(exc) else 1


def chat(args: argparse.Namespace) -> int:
    from turbospark.chat import run_chat

    try:
        configure_kernels(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    backend = load_model(args.model or "smollm2", args)
    if not isinstance(backend, ChatModel):
        print(f"error: model {backend.model_id!r} is an embedding model and cannot chat", file=sys.stderr)
        return 2
    effort = ReasoningEffort(args.reasoning) if args.reasoning else None
    return run_chat(
        backend,
        system=args.system,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        reasoning=effort,
    )


def configure_kernels(args: argparse.Namespace) -> kernel_settings.KernelSettings:
    """The process's kernel settings from the kernel options given (`add_kernel_options`) over
    the environment's; set before any model loads. Raises ValueError for a bad variable."""
    given = {name: getattr(args, name, None) for name in kernel_settings.FIELDS}
    return kernel_settings.configure(**given)


def add_kernel_options(p: argparse.ArgumentParser) -> None:
    """The kernel switches (`engine/kernel_settings.py`) as options; each left out keeps its
    environment variable's value, else its default."""
    env = kernel_settings.ENV_VARS
    group = p.add_argument_group(
        "CPU kernels (an option given overrides its environment variable, which overrides the default)"
    )
    group.add_argument(
        "--cpu-kernels",
        choices=kernel_settings.CPU_KERNEL_CHOICES,
        default=None,
        help="the CPU profile: auto (detected from the CPU's flags), avx2, float32, bf16 or "
        f"bf16-native (${env['cpu_kernels']}; default auto)",
    )
    group.add_argument(
        "--native-kernels",
        choices=kernel_settings.NATIVE_KERNEL_CHOICES,
        default=None,
        help="turbospark's own AVX2 decode kernels: auto (where the CPU profile runs them), on "
        f"(wherever they can run) or off (${env['native_kernels']}; default auto)",
    )
    switches = (
        (
            "--native-vnni",
            "native_vnni",
            "build the native kernels' dot products with AVX-512 VNNI where the CPU has it",
            "on",
        ),
        (
            "--hugepages",
            "hugepages",
            "move a CPU model's weights into one mapping of transparent huge pages where the "
            "system offers them",
            "on",
        ),
        (
            "--fast-nondeterministic",
            "fast_nondeterministic",
            "CPU: pick kernels by a step's row count (faster mixed steps and large batches; a "
            "request's tokens may then depend on the batch, the prefix cache and the chunking)",
            "off",
        ),
        (
            "--pool-steal",
            "pool_steal",
            "the native kernels' caller takes over the work of a helper thread the OS has not scheduled",
            "on",
        ),
    )
    for flag, name, what, default in switches:
        group.add_argument(
            flag,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"{what} (${env[name]}; default {default})",
        )


def keep_alive_arg(value: str) -> float | None:
    """Seconds (None: for ever) from a number or a duration, as Ollama's keep_alive."""
    from turbospark.api.ollama import parse_keep_alive
    from turbospark.errors import ApiError

    try:
        seconds = parse_keep_alive(value)
    except ApiError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a number of seconds or a duration like 5m"
        ) from None
    return None if seconds is None or seconds < 0 else seconds


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
    s.add_argument(
        "--mmproj",
        metavar="FILE",
        help="the llama.cpp vision projector (mmproj GGUF) of the first --model GGUF, so it reads "
        "images; without it an mmproj*.gguf beside a model's GGUF is used",
    )
    s.add_argument("--fallback-model", help="serve requests for unknown model ids with this model")
    s.add_argument(
        "--model-dir",
        action="append",
        help="a folder of GGUF files and Hugging Face checkpoint folders, each served by its name "
        "and loaded on its first request; repeatable",
    )
    s.add_argument(
        "--max-loaded-models",
        type=positive_int,
        default=None,
        help="models loaded at once; loading another unloads the least recently used idle one "
        "(default: 3, or one more than the --model count)",
    )
    s.add_argument(
        "--keep-alive",
        type=keep_alive_arg,
        default=DEFAULT_KEEP_ALIVE,
        help="how long a model loaded on demand stays loaded after its last request: seconds or a "
        "duration (5m, 1h), negative for ever (default 5m); --model ones stay loaded",
    )
    group = s.add_mutually_exclusive_group()
    group.add_argument("--system", help="default system prompt for requests that carry none")
    group.add_argument("--system-file", help="read the default system prompt from this file")
    s.add_argument(
        "--tool-prompt",
        metavar="TEXT",
        help="append TEXT to the system prompt of every request that declares tools (a short "
        "tool-use instruction for small models; benchmarks/bench_agent_tasks.py measures it)",
    )
    s.add_argument(
        "--tool-descriptions",
        choices=("auto", "full", "brief"),
        default="auto",
        help="brief: the model reads each declared tool's description and parameter descriptions cut "
        "to their first sentences (Claude Code's 24 tools are ~17,000 tokens in full); calls are still "
        "held to the whole schema. auto (default): brief for models under 4B parameters",
    )
    s.add_argument(
        "--tool-focus",
        metavar="auto|off|NAME,...",
        default="auto",
        help="of a request declaring more than 8 tools, the model reads and may start calls to only "
        "these (calls to the others it writes anyway are still read as calls). auto (default): the "
        "shell and file tools of Claude Code, Codex and OpenCode, for models under 4B parameters. "
        "A focused request is also rendered for a small model (plan.focused_messages: the hidden "
        "tools' system messages and <system-reminder> blocks left out, Read's line numbers dropped, "
        "the request repeated after the last tool result) and sampled at temperature 0.2 unless it "
        "sets one",
    )
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
        "--no-webui", action="store_true", help="do not serve the chat page (at /chat, and at / for browsers)"
    )
    s.add_argument(
        "--no-constrained-calls",
        action="store_true",
        help="under tool_choice auto, leave a tool call the model starts unconstrained (default: the "
        "rest of the call is held to a declared tool's name and schema by a grammar)",
    )
    s.add_argument(
        "--loop-guard",
        type=int,
        default=DEFAULT_LOOP_GUARD,
        metavar="TOKENS",
        help="when a reply has repeated one block of up to 128 tokens for this many tokens, mask the "
        "token that would repeat it again, so the model leaves the loop (small models get stuck "
        f"in them, inside tool-call arguments too); 0: off (default {DEFAULT_LOOP_GUARD})",
    )
    s.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed for requests that carry none (Claude Code sends none): the same prompt "
        "then gives the same reply; default: a fresh random seed per request",
    )
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
        "--disk-cache-gb",
        type=float,
        default=0.0,
        help="also keep the prefix cache on disk, up to this many GiB per model, so a restarted "
        "server reads prompts it computed before instead of prefilling them (default 0: off, "
        "unless --prefix-cache-dir is given; `launch` turns it on for the server it starts)",
    )
    s.add_argument(
        "--prefix-cache-dir",
        help="where the disk prefix cache lives (default: prefix-cache/ in the cache folder); "
        "giving it turns the disk cache on (8 GiB unless --disk-cache-gb says)",
    )
    s.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="KV-cache element type (auto: float16 on CPUs that run turbospark's AVX2 kernels, "
        "else the model's dtype)",
    )
    s.add_argument(
        "--speculative",
        metavar="ngram|suffix|draft:MODEL|off",
        default=None,
        help="speculative decoding: drafts from n-grams of the sequence's own context (ngram), "
        "also from earlier responses (suffix), from a smaller model of the same tokenizer "
        "(draft:MODEL, as draft:qwen2.5-coder:0.5b), or off (default: ngram on cpu, off on cuda; see "
        "benchmarks/RESULTS.md); greedy output is unchanged, seeded sampled requests never speculate",
    )
    s.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=None,
        metavar="K",
        help=f"most draft tokens verified per sequence and step (default {SpeculativeConfig().num_tokens})",
    )
    s.add_argument(
        "--profile-steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="every N engine steps, log where a step's milliseconds went, averaged over those N "
        "and split by step kind (decode, mixed, prefill, verify): schedule, inputs, forward, "
        "sample, post, pace, idle, and tokens per step. On CUDA a profiled step synchronizes the "
        "device after the forward and after sampling (so the forward's time is the GPU's), which "
        "slows steps slightly. Default: off, at no cost",
    )
    s.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    s.add_argument(
        "--piecewise-graphs",
        action=argparse.BooleanOptionalAction,
        default=PIECEWISE_GRAPHS,
        help="CUDA: replay each layer's work around its attention from CUDA graphs in steps that "
        "mix prefill chunks and decodes (off: such steps run eagerly; decode steps replay whole "
        f"graphs either way). Default: {'on' if PIECEWISE_GRAPHS else 'off'}",
    )
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
    add_kernel_options(s)
    s.add_argument("--log-level", default="info")
    s.set_defaults(func=serve)

    pl = sub.add_parser("pull", help="assemble an optional model from its registry packages")
    pl.add_argument("name", help="qwen2.5-coder:0.5b or qwen2.5-coder:1.5b")
    pl.set_defaults(func=pull)

    ls = sub.add_parser("list", aliases=["ls"], help="list the models serve can load, and those to pull")
    ls.add_argument("--model-dir", action="append", help="also list this folder's models, as serve does")
    ls.set_defaults(func=list_models)

    pp = sub.add_parser("ps", help="list the models a running server has loaded")
    pp.add_argument("--host", default=os.environ.get("TURBOSPARK_HOST", "127.0.0.1:8000"))
    pp.set_defaults(func=ps)

    rr = sub.add_parser("rm", help="delete pulled models or copies")
    rr.add_argument("names", nargs="+", metavar="name")
    rr.add_argument("--model-dir", action="append", help=argparse.SUPPRESS)
    rr.set_defaults(func=rm)

    cc = sub.add_parser("cp", help="serve a model under another name too")
    cc.add_argument("source")
    cc.add_argument("destination")
    cc.add_argument("--model-dir", action="append", help="the folders serve is given, to find the source")
    cc.set_defaults(func=cp)

    la = sub.add_parser(
        "launch",
        help="run an agent (claude, codex) on a local model: starts a server if none answers",
        usage="turbospark launch claude|codex [--model M] [--host H] [--port P] [-- AGENT ARGS]",
    )
    la.add_argument("agent", choices=list(AGENTS))
    la.add_argument("--model", help="default: the smallest model whose context holds the agent's prompt")
    la.add_argument("--host", default="127.0.0.1")
    la.add_argument("--port", type=int, default=8000)
    la.add_argument("--model-dir", action="append", help="as for serve")
    la.set_defaults(func=launch, agent_args=[])

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
    add_kernel_options(c)
    c.set_defaults(func=chat, log_level="warning")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if given[:1] == ["launch"] and "--" in given:  # what follows `--` goes to the agent
        cut = given.index("--")
        given, rest = given[:cut], given[cut + 1 :]
    args = parser().parse_args(given)
    if rest:
        args.agent_args = rest
    level = getattr(logging, str(getattr(args, "log_level", "info")).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
