"""The kernel seam (`engine/ops.py`): which ops a model gets, that every module that runs kernels
gets them, and that the layer code's fused branches compute what its unfused ones do (run here
through the reference fusions, which compose the single ops in the same order: bit for bit)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from tiny_models import FAMILIES, checkpoint

from turbospark.engine import cpu_kernels
from turbospark.engine.layers import Linear, RMSNorm
from turbospark.engine.models import base, build_model
from turbospark.engine.ops import REFERENCE, CpuOps, CudaOps, NativeCpuOps, Norm, Ops, ops_for, use_ops, users
from turbospark.engine.runner import ModelRunner, SequenceState


def random_ids(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_ops_by_device() -> None:
    assert type(ops_for("cuda")) is CudaOps
    assert ops_for("meta") is REFERENCE
    cpu = ops_for("cpu")
    if cpu_kernels.native_kernels() is None:
        assert type(cpu) is CpuOps
    else:
        assert isinstance(cpu, NativeCpuOps) and cpu.kernels is cpu_kernels.native_kernels()
    assert copy.deepcopy(cpu) is cpu  # a copied model shares its ops (and their loaded library)


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_build_model_hands_every_kernel_user_the_devices_ops(family: str, quant: str | None) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES[family])
    model = build_model(cfg, tensors, "cpu", torch.float32, quant=quant)
    expected = ops_for("cpu")
    kinds = set()
    for module in users(model):
        assert type(module.ops) is type(expected), type(module).__name__
        kinds.add(type(module))
    assert {base.CausalLM, base.DecoderLayer, base.Attention, base.MLP, RMSNorm} <= {
        c for k in kinds for c in k.__mro__
    }
    assert (Linear in kinds) == (quant is None)  # quantized linears keep their own kernels


def fusing(ops: Ops) -> Any:
    """A copy of `ops` that takes every fusion (run by the reference fusions over `ops`' single
    ops), so the CPU runs the layers' fused branches; `calls` counts them."""
    kind = type(ops)

    class Fusing(kind):
        def fuses_norm(self, hidden: int, weight: torch.Tensor) -> bool:
            return True

        def takes_qkv_rotary(self, x: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
            return True

        def takes_gate_up_silu(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
            return True

        def qkv_rotary(self, x: torch.Tensor, weight: torch.Tensor, *args: Any) -> Any:
            norm = args[4]
            self.calls["qkv"] += 1
            self.calls["norm"] += norm is not None
            return Ops.qkv_rotary(self, x, weight, *args)

        def gate_up_silu(
            self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: Norm | None
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            self.calls["gate_up"] += 1
            self.calls["norm"] += norm is not None
            return Ops.gate_up_silu(self, x, weight, bias, norm)

    fused = copy.copy(ops)
    fused.__class__ = Fusing
    fused.calls = {"qkv": 0, "gate_up": 0, "norm": 0}
    return fused


@pytest.mark.parametrize("kind", ["reference", "cpu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_branches_equal_the_unfused_layers(family: str, kind: str) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES[family])
    model = build_model(cfg, tensors, "cpu", torch.float32)
    layers = cfg["num_hidden_layers"]

    def run(ops: Ops) -> torch.Tensor:
        use_ops(model, ops)
        runner = ModelRunner(model, max_context=64, max_num_seqs=2)
        a, b = SequenceState(), SequenceState()
        ids = random_ids(13, seed=1)
        prompts = runner.forward([(a, ids), (b, ids[:5])])  # a prompt and a shorter one together
        decodes = runner.forward([(a, [7]), (b, [9])])  # then a decode of each
        return torch.cat([prompts, decodes])

    ops = REFERENCE if kind == "reference" else ops_for("cpu")
    plain = run(ops)
    fused_ops = fusing(ops)
    fused = run(fused_ops)
    assert torch.equal(fused, plain)
    # Qwen3's q/k norms keep its q/k/v unfused; every layer's gate/up fuses, each with its norm
    qkv_calls = 0 if family == "qwen3" else 2 * layers
    assert fused_ops.calls == {"qkv": qkv_calls, "gate_up": 2 * layers, "norm": qkv_calls + 2 * layers}


def test_reference_fusions_with_a_residual() -> None:
    torch.manual_seed(0)
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    weight, norm_w = torch.randn(2 * 48, 64), torch.rand(64) + 0.5
    act, summed = REFERENCE.gate_up_silu(x, weight, None, Norm(norm_w, 1e-6, residual))
    assert summed is not None and torch.equal(summed, x + residual)
    normed = REFERENCE.rms_norm(x + residual, norm_w, 1e-6)
    assert torch.equal(act, REFERENCE.silu_mul(normed @ weight.T, 48))
