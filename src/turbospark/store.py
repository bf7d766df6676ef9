"""The model store: every model this machine can serve by name, loaded or not.

Entries come from (first name wins):
  - the models `serve --model` was given (their spec as given, under the id they loaded as);
  - the packaged models (`smollm2`, `all-minilm-l6-v2`) whose packages are installed;
  - the pulled models (`turbospark pull` / `/api/pull`), once a verified file is there;
  - every `--model-dir DIR`: each `*.gguf` file (named by its stem), each sub-folder holding a
    Hugging Face checkpoint (config.json) or one GGUF file (named by the folder); llama.cpp
    `mmproj*.gguf` files are no models of their own (the model beside one loads it);
  - copies (`/api/copy`, `turbospark cp`): another name for an entry, kept in `aliases.json`
    under the cache directory, so they outlive the server.
Models that can be pulled but are not yet are `pullable()`, not entries: a request for one is a
404 that says to pull it first, as Ollama answers.

The store only reads the disk; loading is the registry's (`turbospark.registry`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from turbospark.engine import pull
from turbospark.engine.checkpoint import ModelNotFound, cache_dir

log = logging.getLogger("turbospark.store")


@dataclass(frozen=True, slots=True)
class StoreEntry:
    name: str  # what clients send (Ollama's ":latest" optional)
    spec: str  # what the loader loads (`engine.loader.resolve_model_spec`)
    source: str  # "given", "packaged", "pulled", "model-dir" or "copy"
    path: Path | None  # the file or folder on disk, where known
    size: int  # bytes on disk (0 where unknown)
    modified: float  # mtime, seconds since the epoch
    format: str  # "gguf" or "safetensors"
    family: str = ""  # a Hugging Face folder's model_type (read without loading); "" unknown
    target: str = ""  # a copy's original name ("" for the others)

    @property
    def model(self) -> str:
        """The name of the model this entry loads: a copy's original, else its own."""
        return self.target or self.name

    @property
    def kinds(self) -> list[str]:
        """What it serves, as far as the files say without loading it."""
        return ["embedding"] if self.family == "bert" else ["completion"]

    def digest(self) -> str:
        """A stable identity for listings: hashing a GB file per listing would be too slow, so
        the digest covers the name, size and modification time (a pulled file's verified
        sha256 where recorded)."""
        if self.source == "pulled" and self.path is not None:
            marker = self.path.with_name(self.path.name + ".sha256")
            if marker.is_file():
                return marker.read_text().strip()
        return hashlib.sha256(f"{self.spec}\0{self.size}\0{self.modified}".encode()).hexdigest()


def base_name(name: str) -> str:
    """`name` without Ollama's default tag."""
    return name[: -len(":latest")] if name.endswith(":latest") else name


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _entry(name: str, spec: str, source: str, path: Path | None) -> StoreEntry:
    if path is None or not path.exists():
        return StoreEntry(name, spec, source, path, 0, 0.0, "gguf")
    gguf = path.suffix == ".gguf" or (path.is_dir() and not (path / "config.json").is_file())
    family = ""
    if not gguf:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            family = str(json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type", ""))
    return StoreEntry(
        name,
        spec,
        source,
        path,
        _disk_size(path),
        path.stat().st_mtime,
        "gguf" if gguf else "safetensors",
        family,
    )


def _dir_models(folder: Path) -> Iterable[tuple[str, Path]]:
    if not folder.is_dir():
        log.warning("--model-dir %s: not a folder", folder)
        return
    from turbospark.engine.mmproj import is_mmproj_name

    for item in sorted(folder.iterdir()):
        if item.is_file() and item.suffix == ".gguf":
            if not is_mmproj_name(item):  # a vision projector goes with the model beside it
                yield item.stem, item
        elif item.is_dir() and (
            (item / "config.json").is_file()
            or len([p for p in item.glob("*.gguf") if not is_mmproj_name(p)]) == 1
        ):
            yield item.name, item


def _spec_path(spec: str) -> Path | None:
    from turbospark.engine.loader import ModelLoadError, resolve_model_spec

    try:
        return resolve_model_spec(spec)[1]
    except (ModelLoadError, OSError):
        return None


class ModelStore:
    def __init__(self, model_dirs: Iterable[Path | str] = (), *, packaged: bool = True) -> None:
        self.model_dirs = [Path(d).expanduser() for d in model_dirs]
        self.packaged = packaged
        self._given: dict[str, str] = {}  # id -> spec of the models serve was given
        self._lock = threading.RLock()

    # ---- what is there
    def remember(self, name: str, spec: str) -> None:
        """A model loaded from `spec` under the id `name` (serve --model): reloadable by name."""
        with self._lock:
            self._given[base_name(name)] = spec

    def entries(self) -> list[StoreEntry]:
        found: dict[str, StoreEntry] = {}

        def add(entry: StoreEntry) -> None:
            found.setdefault(base_name(entry.name), entry)

        with self._lock:
            given = dict(self._given)
        for name, spec in given.items():
            add(_entry(name, spec, "given", _spec_path(spec)))
        if self.packaged:
            from turbospark.engine.loader import DEFAULT_MODEL, EMBEDDING_MODEL

            for name in (DEFAULT_MODEL, EMBEDDING_MODEL):
                path = self._packaged_path(name)
                if path is not None:
                    add(_entry(name, name, "packaged", path))
        for name in pull.PULLABLE:
            pulled = pull.pulled_path(name)
            if pulled is not None:
                add(_entry(name, name, "pulled", pulled))
        for folder in self.model_dirs:
            for name, path in _dir_models(folder):
                add(_entry(name, str(path), "model-dir", path))
        for alias, target in self.aliases().items():
            original = found.get(base_name(target))
            if original is not None:
                add(
                    StoreEntry(
                        alias,
                        original.spec,
                        "copy",
                        original.path,
                        original.size,
                        original.modified,
                        original.format,
                        original.family,
                        target=original.name,
                    )
                )
        return list(found.values())

    @staticmethod
    def _packaged_path(spec: str) -> Path | None:
        from turbospark.engine.loader import (
            DEFAULT_MODEL,
            EMBEDDING_MODEL_NAMES,
            default_model_path,
            embedding_model_path,
        )

        try:
            if spec in ("", DEFAULT_MODEL):
                return default_model_path()
            if spec in EMBEDDING_MODEL_NAMES:
                return embedding_model_path()
        except ModelNotFound:
            return None
        return None

    def find(self, name: str) -> StoreEntry | None:
        wanted = base_name(name)
        return next((e for e in self.entries() if base_name(e.name) == wanted), None)

    def pullable(self) -> list[str]:
        """Names `pull` can fetch that are not pulled yet."""
        return [n for n in pull.PULLABLE if pull.pulled_path(n) is None]

    def not_found(self, name: str) -> str:
        """Why `name` is not in the store, for a 404's message."""
        if base_name(name) in pull.PULLABLE:
            return (
                f"model {name!r} is not pulled yet: pull it first (`turbospark pull {base_name(name)}` "
                "or POST /api/pull)"
            )
        known = ", ".join(sorted(e.name for e in self.entries())) or "none"
        return f"model {name!r} not found; models here: {known}"

    # ---- copies
    def _aliases_file(self) -> Path:
        return cache_dir() / "aliases.json"

    def aliases(self) -> dict[str, str]:
        path = self._aliases_file()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _write_aliases(self, aliases: dict[str, str]) -> None:
        path = self._aliases_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(aliases, indent=1, sort_keys=True), encoding="utf-8")
        partial.replace(path)

    def copy(self, source: str, destination: str) -> StoreEntry:
        """Serves `source` under `destination` too. Raises KeyError (no such source) or
        ValueError (the destination names another model)."""
        with self._lock:
            entry = self.find(source)
            if entry is None:
                raise KeyError(self.not_found(source))
            dest = base_name(destination)
            taken = self.find(dest)
            if taken is not None and taken.source != "copy":
                raise ValueError(f"{destination!r} already names a model ({taken.source})")
            aliases = self.aliases()
            aliases[dest] = (
                base_name(entry.name) if entry.source != "copy" else aliases[base_name(entry.name)]
            )
            self._write_aliases(aliases)
        found = self.find(dest)
        assert found is not None
        return found

    def delete(self, name: str) -> StoreEntry:
        """Removes a copy, or a pulled model's file (and the copies naming it). Raises KeyError
        (no such model) or PermissionError (a packaged, given or --model-dir model, which the
        store does not own)."""
        with self._lock:
            entry = self.find(name)
            if entry is None:
                raise KeyError(self.not_found(name))
            aliases = self.aliases()
            if entry.source == "copy":
                del aliases[base_name(entry.name)]
                self._write_aliases(aliases)
                return entry
            if entry.source != "pulled":
                where = {
                    "packaged": "it ships in a Python package (pip uninstall it)",
                    "given": "it was given to `serve --model`",
                    "model-dir": f"it is a file in a --model-dir folder ({entry.path}); delete the file",
                }[entry.source]
                raise PermissionError(f"model {entry.name!r} cannot be deleted here: {where}")
            assert entry.path is not None
            entry.path.unlink(missing_ok=True)
            entry.path.with_name(entry.path.name + ".sha256").unlink(missing_ok=True)
            kept = {a: t for a, t in aliases.items() if base_name(t) != base_name(entry.name)}
            if kept != aliases:
                self._write_aliases(kept)
            return entry
