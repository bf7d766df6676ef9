"""The CPU kernel profile follows the CPU's flags and the override, and names what it picked."""

from __future__ import annotations

import os

import pytest
import torch

from turbospark.engine.cpu_info import cpu_flags
from turbospark.engine.cpu_kernels import (
    ENV_VAR,
    cpu_kernels,
    detect,
    free_cores,
    has_fbgemm_half,
    set_intra_op_threads,
)

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
SAPPHIRE_RAPIDS = AVX2 | {"avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"}
ZEN4 = AVX2 | {"avx512f", "avx512_vnni", "avx512_bf16"}


@pytest.mark.parametrize(
    ("flags", "dense"),
    [(AVX2, torch.float32), (SAPPHIRE_RAPIDS, torch.bfloat16), (ZEN4, torch.bfloat16)],
    ids=["avx2", "amx", "avx512-bf16"],
)
def test_dense_dtype_is_bf16_only_where_bf16_is_native(flags, dense) -> None:
    kernels = detect(flags, "auto")
    assert kernels.dense_dtype == dense
    assert kernels.native_bf16 == (dense == torch.bfloat16)
    assert kernels.source == "detected"


def test_packed_half_and_float32_activations_only_where_bf16_is_emulated() -> None:
    avx2 = detect(AVX2, "auto")
    assert avx2.packed_half == has_fbgemm_half() and avx2.activation_dtype == torch.float32
    assert "fp16-packed" in avx2.describe() or not has_fbgemm_half()
    amx = detect(SAPPHIRE_RAPIDS, "auto")
    assert not amx.packed_half and amx.activation_dtype == torch.bfloat16
    # "float32" keeps the expand-to-float32 path of before (no packed copy)
    plain = detect(AVX2, "float32")
    assert not plain.packed_half and plain.dense_dtype == torch.float32
    assert plain.activation_dtype == torch.float32 and "expanded to float32" in plain.describe()


def test_override_wins_and_is_named() -> None:
    assert detect(SAPPHIRE_RAPIDS, "avx2").dense_dtype == torch.float32
    forced = detect(AVX2, "bf16")
    assert forced.dense_dtype == torch.bfloat16 and ENV_VAR in forced.source
    assert "bfloat16" in forced.describe()


def test_bf16_native_pairs_bf16_many_row_matmuls_with_native_decode() -> None:
    mixed = detect(SAPPHIRE_RAPIDS, "bf16-native", native_rows=8)
    assert mixed.dense_dtype == torch.bfloat16 and not mixed.packed_half
    assert mixed.activation_dtype == torch.float32 and mixed.native_rows == 8
    # without the native kernels (no compiler, no AVX2) decode stays on torch's kernels, on bf16
    fallback = detect(SAPPHIRE_RAPIDS, "bf16-native", native_rows=0)
    assert fallback.activation_dtype == torch.bfloat16 and fallback.native_rows == 0


def test_avx512_bf16_without_amx_detects_bf16_prompts_and_native_decode() -> None:
    """Zen 4: bf16 prompt matmuls, decode steps on the native kernels where they build."""
    zen4 = detect(ZEN4, "auto", native_rows=8)
    assert zen4.dense_dtype == torch.bfloat16 and zen4.activation_dtype == torch.float32
    assert zen4.native_rows == 8 and zen4.source == "detected"
    assert detect(ZEN4, "auto", native_rows=0).activation_dtype == torch.bfloat16
    amx = detect(SAPPHIRE_RAPIDS, "auto", native_rows=8)  # rows given, but AMX keeps torch's
    assert amx.activation_dtype == torch.bfloat16


def test_override_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, "avx2")
    assert detect(SAPPHIRE_RAPIDS).dense_dtype == torch.float32
    monkeypatch.setenv(ENV_VAR, "fastest")
    with pytest.raises(ValueError, match=ENV_VAR):
        detect(AVX2)


def test_this_machine_gets_a_profile_naming_torch_capability() -> None:
    kernels = cpu_kernels()
    assert kernels.capability == torch.backends.cpu.get_cpu_capability()
    assert kernels.capability in kernels.describe()
    if "amx_bf16" not in cpu_flags() and "avx512_bf16" not in cpu_flags():
        assert kernels.dense_dtype == torch.float32


def test_pool_never_exceeds_the_cores_this_process_may_use(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        threads = set_intra_op_threads()
        assert 1 <= threads <= free_cores() == len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
