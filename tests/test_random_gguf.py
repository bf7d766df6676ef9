"""`benchmarks/random_gguf.py`: a random-weight GGUF shaped like a real one, for machines the real
file cannot reach. The skeleton of the embedded SmolLM2 file, built back into a GGUF, must read as
the same model (metadata, tensor names, shapes and types) and load with finite weights of about
the size trained ones have."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from gguf import GGUFReader

from turbospark.engine.loader import default_model_path, load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "benchmarks" / "random_gguf.py"


def run_tool(*args: str) -> None:
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_skeleton_builds_back_to_the_same_model_with_random_weights(tmp_path: Path) -> None:
    real = default_model_path()
    skeleton, built = tmp_path / "skel.json.gz", tmp_path / "random.gguf"
    run_tool("skeleton", str(real), str(skeleton))
    assert skeleton.stat().st_size < real.stat().st_size // 50  # metadata travels, weights do not
    run_tool("build", str(skeleton), str(built))

    a, b = GGUFReader(real), GGUFReader(built)
    assert {k: f.contents() for k, f in a.fields.items()} == {k: f.contents() for k, f in b.fields.items()}
    assert [(t.name, list(t.shape), t.tensor_type) for t in a.tensors] == [
        (t.name, list(t.shape), t.tensor_type) for t in b.tensors
    ]
    assert built.stat().st_size == real.stat().st_size
    q_real = next(t for t in a.tensors if t.name == "blk.0.attn_q.weight").data
    q_built = next(t for t in b.tensors if t.name == "blk.0.attn_q.weight").data
    assert not (q_real == q_built).all()  # the weights are new

    ckpt = load_checkpoint(str(built), progress=False)
    weights = ckpt.tensors["model.layers.0.mlp.down_proj.weight"]
    assert torch.isfinite(weights).all()
    assert 0.001 < float(weights.std()) < 0.1  # about the size trained weights have
    assert ckpt.config["num_hidden_layers"] == 30
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("Hello there").ids) == "Hello there"
