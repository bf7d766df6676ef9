"""turbospark's own AVX2 kernels (`engine/native.py`, `engine/csrc/qgemv.c`) against torch.

The quantized matmuls quantize each activation row to int8 in blocks of 32, so they differ from
the float product of the same weight by that rounding: measured at 0.52-0.57% of the output's
norm on Gaussian rows, bounded at 1.5% (a wrong block layout or scale is off by 30-100%). The
other kernels do float32 arithmetic in another order than torch: bounded at 1e-5 relative.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F

from turbospark.engine import native
from turbospark.engine.cpu_kernels import cpu_kernels, detect
from turbospark.engine.layers import Linear
from turbospark.engine.ops import REFERENCE, NativeCpuOps
from turbospark.engine.quant import Int4Linear, Int8Linear, quantize_int4, quantize_int8

kernels = native.kernels()
pytestmark = pytest.mark.skipif(
    kernels is None, reason=f"no native kernels here: {native.unavailable_reason()}"
)
QUANT_BOUND = 0.015


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("rows", [1, 3, native.MAX_ROWS])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group"), [(96, 64, 32), (40, 256, 128), (7, 576, 32)]
)
def test_q4_matmul_is_the_dequantized_product(
    rows: int, out_features: int, in_features: int, group: int
) -> None:
    assert kernels is not None
    torch.manual_seed(rows)
    w = torch.randn(out_features, in_features) * 0.05
    codes, sz = quantize_int4(w, group, torch.bfloat16)
    sz = sz.float().transpose(0, 1)  # (out, groups, 2)
    scales, offsets = sz[..., 0], sz[..., 1] - 8 * sz[..., 0]
    blocks = native.pack_q4(codes, scales, offsets, group)
    groups = -(-out_features // native.Q4_COLS)  # 7 columns -> one group, padded to 8
    assert blocks.codes.shape == (groups, in_features // 32, 128)
    assert blocks.scales.shape == blocks.offsets.shape == (groups, in_features // 32, native.Q4_COLS)
    assert blocks.out_features == out_features
    # fp16 scales and offsets, as the blocks hold them
    s16, o16 = scales.half().float(), offsets.half().float()
    weight = (codes.view(out_features, -1, group).float() * s16[..., None] + o16[..., None]).view(w.shape)
    x = torch.randn(rows, in_features)
    bias = torch.randn(out_features)
    expected = x @ weight.T + bias
    got = kernels.q4_matmul(x, blocks, bias)
    assert relative_error(got, expected) < QUANT_BOUND


@pytest.mark.parametrize("rows", [1, 5, native.MAX_ROWS])
def test_q8_matmul_is_the_dequantized_product(rows: int) -> None:
    assert kernels is not None
    torch.manual_seed(rows)
    w = torch.randn(200, 320) * 0.05
    q, scales = quantize_int8(w)
    q[0, :32] = 127  # extremes of the code range: |w| * sign(x, w) must not overflow
    q[1, :32] = -127
    x = torch.randn(rows, 320)
    expected = x @ (q.float() * scales[:, None]).T
    packed = native.pack_q8(q, scales)
    assert torch.equal(packed.unpack(), q)  # the layout keeps every code
    got = kernels.q8_matmul(x, packed, None)
    assert relative_error(got, expected) < QUANT_BOUND


@pytest.mark.parametrize("rows", [1, 4, native.MAX_ROWS])
def test_q8_matmul_finds_numpys_argmax_as_it_writes(rows: int) -> None:
    """The fused argmax equals numpy's over the very logits returned, ties (the first maximum)
    and NaNs (the first NaN) included, across chunk boundaries and a partial last chunk."""
    assert kernels is not None
    torch.manual_seed(rows)
    n = 32 * 9 + 13  # nine full chunks and a partial one
    w = torch.randn(n, 64) * 0.05
    q, scales = quantize_int8(w)
    q[200], scales[200] = q[37], scales[37]  # two columns equal to each other for every row
    w8 = native.pack_q8(q, scales)
    x = torch.randn(rows, 64)
    bias = torch.zeros(n)
    y, ids = kernels.q8_matmul_argmax(x, w8, bias)
    assert torch.equal(y, kernels.q8_matmul(x, w8, bias))
    assert ids.tolist() == y.numpy().argmax(axis=1).tolist()
    # make both tied columns the maximum of row 0: the earlier one wins, as in numpy
    bias[37] = bias[200] = 1e4
    y, ids = kernels.q8_matmul_argmax(x, w8, bias)
    assert ids.tolist() == y.numpy().argmax(axis=1).tolist()
    assert ids[0] == 37
    bias[250] = float("nan")  # a NaN column: numpy's argmax picks it
    bias[300] = float("nan")
    y, ids = kernels.q8_matmul_argmax(x, w8, bias)
    assert ids.tolist() == y.numpy().argmax(axis=1).tolist() == [250] * rows
    bias.fill_(float("-inf"))  # nothing above -inf: the first column
    y, ids = kernels.q8_matmul_argmax(x, w8, bias)
    assert ids.tolist() == y.numpy().argmax(axis=1).tolist() == [0] * rows


def test_quantized_linears_take_decode_rows_natively_and_agree_with_their_other_paths() -> None:
    torch.manual_seed(0)
    lin = Linear(256, 96, bias=True)
    lin.weight.data = torch.randn(96, 256) * 0.05
    assert lin.bias is not None
    lin.bias.data = torch.randn(96)
    x = torch.randn(native.MAX_ROWS + 24, 256)
    for native_layer, torch_layer in [
        (
            Int4Linear(lin, torch.float32, 32, native_rows=native.MAX_ROWS),
            Int4Linear(lin, torch.float32, 32, native_rows=0),
        ),
        (
            Int8Linear(lin, torch.float32, native_rows=native.MAX_ROWS),
            Int8Linear(lin, torch.float32, native_rows=0),
        ),
    ]:
        assert native_layer.native_rows == native.MAX_ROWS
        few = x[: native.MAX_ROWS]
        assert relative_error(native_layer(few), torch_layer(few)) < QUANT_BOUND
        # one row at a time equals the same rows together: a row's result does not depend on its batch
        one_by_one = torch.cat([native_layer(few[i : i + 1]) for i in range(few.shape[0])])
        assert torch.equal(one_by_one, native_layer(few))
        # past the limit the layer leaves the native kernel: the packed / expanded path, same weight
        torch.testing.assert_close(native_layer(x), torch_layer(x))


def test_two_callers_at_once_get_their_own_results() -> None:
    """Two engines (two served models) call the kernels from two threads at once: the pool
    serves one, the other computes on its own thread; neither sees the other's work."""
    assert kernels is not None
    torch.manual_seed(1)
    # sized so that the calls overlap: the pool before this test crashed the process here
    weights = [native.pack_q8(*quantize_int8(torch.randn(2048, 1024) * 0.05)) for _ in range(2)]
    xs = [torch.randn(2, 1024) for _ in range(2)]
    expected = [kernels.q8_matmul(x, w, None) for x, w in zip(xs, weights, strict=True)]
    mismatches: list[int] = []

    def hammer(i: int) -> None:
        for _ in range(400):
            if not torch.equal(kernels.q8_matmul(xs[i], weights[i], None), expected[i]):
                mismatches.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not mismatches


def test_rms_norm_with_and_without_the_residual() -> None:
    assert kernels is not None
    x, residual, w = torch.randn(3, 576), torch.randn(3, 576), torch.randn(576)
    y, summed = kernels.rms_norm(x, w, 1e-5)
    assert summed is None
    torch.testing.assert_close(y, F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    y, summed = kernels.rms_norm(x, w, 1e-6, residual)
    assert summed is not None
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(y, F.rms_norm(x + residual, (576,), w, 1e-6), rtol=1e-5, atol=1e-5)


def test_silu_mul() -> None:
    assert kernels is not None
    gate_up = torch.randn(2, 2 * 203) * 6  # a width that is not a multiple of 8: the scalar tail too
    expected = F.silu(gate_up[:, :203]) * gate_up[:, 203:]
    torch.testing.assert_close(kernels.silu_mul(gate_up, 203), expected, rtol=1e-5, atol=1e-5)


def test_rotary_on_a_slice_of_the_fused_projection() -> None:
    """q and k rotate as a view into the q/k/v rows (token stride wider than the heads)."""
    assert kernels is not None
    qkv = torch.randn(4, 9 + 3 + 3, 64)
    cos, sin = torch.randn(4, 1, 64), torch.randn(4, 1, 64)
    qk = qkv[:, :12]
    expected = torch.addcmul(qk * cos, qk.roll(32, dims=-1), sin)
    torch.testing.assert_close(kernels.rotary(qk, cos, sin), expected)
    torch.testing.assert_close(NativeCpuOps(kernels).rotary(qk, cos, sin), expected)  # the layers' way in
    torch.testing.assert_close(REFERENCE.rotary(qk, cos, sin), expected)


@pytest.mark.parametrize(("heads", "kv_heads", "hd"), [(9, 3, 64), (14, 2, 64), (4, 4, 128), (6, 2, 36)])
def test_decode_attention_over_paged_slots(heads: int, kv_heads: int, hd: int) -> None:
    """Three sequences of different lengths, each reading scattered cache slots; the longest is
    split into parts of 256 slots that are merged afterwards."""
    assert kernels is not None
    torch.manual_seed(heads)
    num_slots = 900
    k_cache, v_cache = torch.randn(kv_heads, num_slots, hd), torch.randn(kv_heads, num_slots, hd) * 3
    lengths = [1, 37, 600]
    perm = torch.randperm(num_slots)
    slot_lists = [perm[:1], perm[1:38], perm[38:638]]
    assert [len(s) for s in slot_lists] == lengths
    q = torch.randn(len(lengths), heads, hd) * 2  # peaked softmaxes: the merge's rescaling matters
    ids = torch.cat(slot_lists)
    offsets = torch.tensor([0, 1, 38, 638])
    got = kernels.decode_attention(q, k_cache, v_cache, ids, offsets, hd**-0.5)
    for s, slots in enumerate(slot_lists):
        ks, vs = k_cache[:, slots], v_cache[:, slots]  # (kv_heads, len, hd)
        expected = F.scaled_dot_product_attention(
            q[s][:, None], ks, vs, scale=hd**-0.5, enable_gqa=True
        )  # (heads, 1, hd)
        torch.testing.assert_close(got[s], expected[:, 0], rtol=1e-5, atol=1e-5)


def test_the_profile_uses_them_except_where_the_cpu_has_amx(monkeypatch) -> None:
    """Measured: faster than torch's kernels on an AVX2 EPYC and for decode on a Zen 4 EPYC
    (AVX-512 BF16), slower on an AMX Xeon (bf16)."""
    monkeypatch.delenv(native.ENV_VAR, raising=False)
    if cpu_kernels().amx:
        assert detect().native_rows == 0
    else:
        assert detect().native_rows == native.MAX_ROWS
    monkeypatch.setenv(native.ENV_VAR, "0")
    assert native.mode() == "off" and native.unavailable_reason() is not None
    monkeypatch.setenv(native.ENV_VAR, "1")
    assert native.mode() == "on"
    assert detect(override="bf16").native_rows == native.MAX_ROWS  # forced on: wherever they run
    monkeypatch.setenv(native.ENV_VAR, "auto")
    assert detect(override="bf16").native_rows == 0


_VNNI_PROBE = """
import sys, torch
from turbospark.engine import native
from turbospark.engine.quant import quantize_int4, quantize_int8
torch.manual_seed(0)
k = native.kernels()
w = torch.randn(96, 256) * 0.05
codes, sz = quantize_int4(w, 32, torch.bfloat16)
sz = sz.float().transpose(0, 1)
blocks = native.pack_q4(codes, sz[..., 0], sz[..., 1] - 8 * sz[..., 0], 32)
q8, s8 = quantize_int8(w)
x = torch.randn(native.MAX_ROWS, 256) * 3
torch.save({"vnni": k.vnni, "q4": k.q4_matmul(x, blocks, None),
            "q8": k.q8_matmul(x, native.pack_q8(q8, s8), None)}, sys.argv[1])
"""


@pytest.mark.skipif(not native.uses_vnni(), reason="the CPU has no AVX-512 VNNI")
def test_vnni_dot_products_equal_avx2s(tmp_path, monkeypatch) -> None:
    """The VNNI build sums the same integer products as the AVX2 build: outputs bit for bit."""
    import subprocess
    import sys

    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path / "cache"))  # both builds compiled here
    results = {}
    for setting in ("1", "0"):
        out = tmp_path / f"vnni-{setting}.pt"
        env = {**os.environ, native.VNNI_ENV_VAR: setting}
        subprocess.run([sys.executable, "-c", _VNNI_PROBE, str(out)], env=env, check=True, timeout=300)
        results[setting] = torch.load(out)
    assert results["1"]["vnni"] and not results["0"]["vnni"]
    for name in ("q4", "q8"):
        assert torch.equal(results["1"][name], results["0"][name]), name


def test_a_compiler_without_the_vnni_flags_still_builds_avx2s(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "uses_vnni", lambda flags=None: True)
    monkeypatch.setattr(native, "VNNI_FLAGS", ("-mno-such-instruction-set",))
    built = native.kernels.__wrapped__()  # uncached: a fresh build into tmp_path
    assert built is not None and not built.vnni
    assert built.path.parent == tmp_path / "kernels"


def test_chunks_a_stalled_helper_holds_are_taken_over_with_the_same_results() -> None:
    """A helper stopped in the middle of a chunk (descheduled on a busy machine) no longer holds
    the call: the caller runs that chunk itself and the helper drops it. Here helpers sleep 3 ms
    in every third chunk they take; every result equals the undisturbed pool's, bit for bit."""
    assert kernels is not None
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no helpers")
    torch.manual_seed(2)
    q8 = native.pack_q8(*quantize_int8(torch.randn(2048, 512) * 0.05))
    lin = Linear(512, 1024, bias=True)
    lin.weight.data = torch.randn(1024, 512) * 0.05
    assert lin.bias is not None
    lin.bias.data = torch.randn(1024)
    q4 = Int4Linear(lin, torch.float32, 32, native_rows=native.MAX_ROWS)
    x = torch.randn(3, 512)
    k_cache, v_cache = torch.randn(2, 2000, 64), torch.randn(2, 2000, 64)
    q = torch.randn(2, 14, 64)
    ids, offsets = torch.randperm(2000)[:1500], torch.tensor([0, 700, 1500])

    def results() -> list[torch.Tensor]:
        return [
            kernels.q8_matmul(x, q8, None),
            *kernels.q8_matmul_argmax(x, q8, torch.zeros(2048)),
            q4(x),
            kernels.decode_attention(q, k_cache, v_cache, ids, offsets, 0.125),
        ]

    expected = results()
    before = kernels.lib.ts_pool_steals()
    kernels.lib.ts_pool_test_stall(3_000_000)
    try:
        # at least 10 rounds, and on until a helper has been taken over: whether a helper wins a
        # chunk before the caller has claimed them all is up to the scheduler (a CI run once
        # saw none in 10 rounds)
        for rounds in range(1, 301):
            for got, want in zip(results(), expected, strict=True):
                assert torch.equal(got, want)
            if rounds >= 10 and kernels.lib.ts_pool_steals() > before:
                break
    finally:
        kernels.lib.ts_pool_test_stall(0)
    assert kernels.lib.ts_pool_steals() > before
    for got, want in zip(results(), expected, strict=True):  # the pool as before afterwards
        assert torch.equal(got, want)
    # turned off, the caller waits for the sleeping helper instead
    assert kernels.lib.ts_pool_set_stealing(0) == 1
    before = kernels.lib.ts_pool_steals()
    kernels.lib.ts_pool_test_stall(1_000_000)
    try:
        for got, want in zip(results(), expected, strict=True):
            assert torch.equal(got, want)
    finally:
        kernels.lib.ts_pool_test_stall(0)
        kernels.lib.ts_pool_set_stealing(1)
    assert kernels.lib.ts_pool_steals() == before


def test_taking_over_chunks_can_be_turned_off() -> None:
    script = """
import torch
from turbospark.engine import native
from turbospark.engine.quant import quantize_int8
k = native.kernels()
torch.set_num_threads(2)
w = native.pack_q8(*quantize_int8(torch.randn(2048, 512)))
x = torch.randn(2, 512)
want = k.q8_matmul(x, w, None)
k.lib.ts_pool_test_stall(1_000_000)
assert all(torch.equal(k.q8_matmul(x, w, None), want) for _ in range(3))
print(k.lib.ts_pool_steals())
"""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TURBOSPARK_POOL_STEAL": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0"  # the caller waited for the sleeping helper instead


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_expansion_is_codes_times_scales(dtype: torch.dtype) -> None:
    """The many-row path's weight, widened from the native layout in one pass, equals torch's
    widening of the same codes (bfloat16 rounded to nearest even, as torch rounds)."""
    assert kernels is not None
    torch.manual_seed(3)
    q, scales = quantize_int8(torch.randn(37, 96) * 0.05)  # a partial last group of columns
    got = kernels.q8_expand(native.pack_q8(q, scales), dtype)
    assert torch.equal(got, (q.float() * scales[:, None]).to(dtype))
