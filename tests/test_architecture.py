"""ARCHITECTURE.md's invariants that the import graph and the syntax tree can show."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "turbospark"

# Modules under api/ that serve no API of their own: what the API modules share.
API_SHARED = {"common", "fields", "kit", "parsing", "envelopes"}
# The app's assembly: it mounts every API.
ASSEMBLY = {"server", "cli", "testing"}
# Below the plan: token ids only.
TOKEN_LAYER = {"backend", "scripted", "decode", "sampling"}
ABOVE_TOKENS = ("turbospark.api", "turbospark.request", "turbospark.plan", "turbospark.events")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def imports_of(name: str, trees: dict[str, ast.Module] = TREES, known: set[str] | None = None) -> set[str]:
    """Every turbospark module `name` imports, at any level (TYPE_CHECKING and late imports too)."""
    found: set[str] = set()
    for node in ast.walk(trees[name]):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    # importing a.b.c runs a/__init__ and a/b/__init__ first (one's own packages are running already)
    found |= {p for m in found for p in parents(m) if p not in parents(name)}
    return {m for m in found if m in (MODULES if known is None else known)}


def parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


API_MODULES = [n for n in MODULES if n.startswith("turbospark.api.") and short(n) not in API_SHARED]


def test_the_api_modules_are_found() -> None:
    assert {"turbospark.api.openai", "turbospark.api.anthropic", "turbospark.api.models"} <= set(API_MODULES)


@pytest.mark.parametrize("name", API_MODULES)
def test_no_api_module_imports_another(name: str) -> None:
    others = {m for m in imports_of(name) if m in API_MODULES and m != name}
    assert not others, f"{name} imports {others}; move what they share into api/{{kit,parsing,...}}"


@pytest.mark.parametrize("name", [n for n in MODULES if not n.startswith("turbospark.api")])
def test_nothing_past_the_edge_imports_from_api(name: str) -> None:
    if short(name) in ASSEMBLY:
        return
    assert not {m for m in imports_of(name) if m.startswith("turbospark.api")}


@pytest.mark.parametrize(
    "name", [n for n in MODULES if n.startswith("turbospark.engine") or short(n) in TOKEN_LAYER]
)
def test_the_backend_side_sees_token_ids_only(name: str) -> None:
    assert not {m for m in imports_of(name) if m.startswith(ABOVE_TOKENS)}


# The layers and the model families: they run kernels through the ops object their model gets at
# load (`engine/ops.py`) and choose none themselves.
MODEL_CODE = [n for n in MODULES if n.startswith("turbospark.engine.models")] + ["turbospark.engine.layers"]
# Where kernels are chosen or their availability known; model code reaches them only through ops.
KERNEL_CHOOSERS = {
    "turbospark.engine.cuda_ops",
    "turbospark.engine.triton_kernels",
    "turbospark.engine.cuda_attention",
    "turbospark.engine.native",
    "turbospark.engine.cpu_kernels",
    "turbospark.engine.row_kernels",
    "turbospark.handoff",
}


def test_the_model_code_is_found() -> None:
    assert {"turbospark.engine.models.base", "turbospark.engine.models.llama"} <= set(MODEL_CODE)
    assert set(MODULES) >= KERNEL_CHOOSERS


@pytest.mark.parametrize("name", MODEL_CODE)
def test_model_code_chooses_no_kernel(name: str) -> None:
    """No model file (nor `layers.py`) imports a kernel module or asks a tensor's device: a
    kernel is a method of the device's ops (`engine/ops.py`), picked once when the model is built."""
    assert not imports_of(name) & KERNEL_CHOOSERS, f"{name} imports {imports_of(name) & KERNEL_CHOOSERS}"
    device_tests = {n.attr for n in ast.walk(TREES[name]) if isinstance(n, ast.Attribute)} & {
        "is_cuda",
        "is_cpu",
    }
    assert not device_tests, f"{name} reads {device_tests}: ask its ops instead"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (module -> the modules it imports), as a path back to its start."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            # A package's __init__ imported by its own submodules is how packages work.
            if nxt not in graph or node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def import_graph(trees: dict[str, ast.Module], known: Iterable[str]) -> dict[str, set[str]]:
    return {name: imports_of(name, trees, set(known)) - {name} for name in trees}


def test_no_import_cycles_anywhere() -> None:
    """No two modules of the package import each other, directly or around a circle, the engine
    included.

    Every import counts, wherever it is written: at module level, under `if TYPE_CHECKING:`, or
    inside a function. So a function-level import cannot hide a circle: lifted to module level it
    would close one, and here it already does. A function-level import is fine only where it
    closes no circle, for a dependency that is heavy or optional at start-up (torch.distributed
    and the tensor-parallel workers, triton / CUDA modules on a CPU machine, the server from the
    CLI). Where two modules need one piece, the piece moves to a module both import."""
    cycle = find_cycle(import_graph(TREES, MODULES))
    assert cycle is None, " -> ".join(cycle or [])


def test_a_function_level_import_closes_a_cycle_too() -> None:
    """The checker sees a circle that a late import (or a TYPE_CHECKING one) tries to hide."""
    sources = {
        "pkg.a": "from pkg.b import helper\n",
        "pkg.b": "def helper():\n    from pkg.a import thing\n    return thing\n",
        "pkg.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import thing\n",
    }
    trees = {name: ast.parse(text) for name, text in sources.items()}
    assert find_cycle(import_graph(trees, sources)) == ["pkg.a", "pkg.b", "pkg.a"]
    del trees["pkg.b"]
    trees["pkg.a"] = ast.parse("import pkg.c\n")
    assert find_cycle(import_graph(trees, ["pkg.a", "pkg.c"])) == ["pkg.a", "pkg.c", "pkg.a"]
    trees["pkg.a"] = ast.parse("import json\n")
    assert find_cycle(import_graph(trees, ["pkg.a", "pkg.c"])) is None


def test_importing_a_submodule_runs_its_package_first() -> None:
    """`from pkg.sub.y import f` runs pkg/sub/__init__ too: a circle through it is a circle."""
    sources = {"pkg.sub": "import pkg.x\n", "pkg.sub.y": "f = 1\n", "pkg.x": "from pkg.sub.y import f\n"}
    trees = {name: ast.parse(text) for name, text in sources.items()}
    assert find_cycle(import_graph(trees, sources)) == ["pkg.sub", "pkg.x", "pkg.sub"]


def attribute_readers(attr: str) -> set[str]:
    return {
        name
        for name, tree in TREES.items()
        if any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(tree))
    }


def test_only_the_plan_reads_the_served_models_defaults() -> None:
    assert attribute_readers("default_system") <= {"turbospark.plan"}
    assert attribute_readers("default_reasoning") <= {"turbospark.plan"}
    assert attribute_readers("tool_prompt") <= {"turbospark.plan"}


def test_no_api_module_makes_reasoning_events() -> None:
    """Reasoning is routed by the output pipeline only, so no API can leak or invent it."""
    for name in API_MODULES + [f"turbospark.api.{m}" for m in API_SHARED]:
        calls = [n for n in ast.walk(TREES[name]) if isinstance(n, ast.Call)]
        assert not any(isinstance(c.func, ast.Name) and c.func.id == "ReasoningDelta" for c in calls), name


def test_the_engine_step_fits_one_screen() -> None:
    """`Engine.step` reads as the step (schedule -> run -> sample -> post -> pace) in at most 30
    lines; what each part does, and the step's accounting and profile, live in methods of their
    own."""
    engine = next(
        n
        for n in ast.walk(TREES["turbospark.engine.engine"])
        if isinstance(n, ast.ClassDef) and n.name == "Engine"
    )
    step = next(n for n in engine.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno is not None
    assert step.end_lineno - step.lineno + 1 <= 30
