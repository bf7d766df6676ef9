"""Weight-only int8 / int4 against the float path.

Bounds, measured on these tiny models and stated here: int8 logits stay within 2% (3% with
bf16 activations) of the float path's logit range, int4 within 10%; where greedy decoding is
stable (see `successor_checkpoint`) int8 gives the same 20 greedy tokens as the float path.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, checkpoint

from turbospark.engine.cpu_kernels import cpu_kernels
from turbospark.engine.layers import Linear
from turbospark.engine.models import build_model
from turbospark.engine.quant import (
    LM_HEAD_MAX_PADDING,
    MIN_ROWS_PACKED,
    MIN_ROWS_TO_DEQUANTIZE,
    Int4Linear,
    Int8Linear,
    auto_quant,
    is_on_int4_grid,
    pack_half,
    quantize_int4,
    quantize_int8,
    quantize_linear,
)
from turbospark.engine.runner import ModelRunner, SequenceState


def float_linear(out_features: int, in_features: int, bias: bool = False) -> Linear:
    torch.manual_seed(0)
    lin = Linear(in_features, out_features, bias=bias)
    lin.weight.data = torch.randn(out_features, in_features) * 0.05
    if lin.bias is not None:
        lin.bias.data = torch.randn(out_features)
    return lin


def test_int8_kernel_equals_the_dequantized_matmul() -> None:
    lin = float_linear(96, 64, bias=True)
    q, scales = quantize_int8(lin.weight.data)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    dequant = q.float() * scales[:, None]
    assert (dequant - lin.weight).abs().max() <= scales.max() / 2 + 1e-7  # round to nearest
    x = torch.randn(5, 64)
    torch.testing.assert_close(
        Int8Linear(lin, torch.float32, kernel_dtype=torch.float32)(x),
        x @ dequant.T + lin.bias,
        atol=1e-4,
        rtol=1e-4,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_prefill_path_equals_the_kernel_path(dtype: torch.dtype) -> None:
    lin = Int8Linear(float_linear(96, 64, bias=True), dtype, dense_dtype=dtype, kernel_dtype=dtype)
    x = torch.randn(MIN_ROWS_TO_DEQUANTIZE + 8, 64).to(dtype)
    dense = lin(x)  # dequantized weight, dense matmul
    rows = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])])  # the int8 kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the weight is rounded after scaling
    torch.testing.assert_close(dense.float(), rows.float(), atol=tol * float(rows.abs().max()), rtol=0)


def test_int4_prefill_path_equals_the_kernel_path() -> None:
    lin = Int4Linear(float_linear(96, 128, bias=True), torch.bfloat16, 32)
    x = torch.randn(MIN_ROWS_TO_DEQUANTIZE + 8, 128).bfloat16()
    dense = lin(x).float()  # nibbles -> bf16 weight, dense matmul
    rows = torch.cat([lin(x[i : i + 1]) for i in range(x.shape[0])]).float()  # the int4 kernel
    torch.testing.assert_close(dense, rows, atol=2e-2 * float(rows.abs().max()), rtol=0)


def test_int4_kernel_equals_the_dequantized_matmul() -> None:
    lin = float_linear(64, 128)
    codes, scales_and_zeros = quantize_int4(lin.weight.data, 32)
    assert codes.min() >= 0 and codes.max() <= 15
    sz = scales_and_zeros.transpose(0, 1)  # (out, groups, 2)
    dequant = ((codes.view(64, -1, 32).float() - 8) * sz[..., :1] + sz[..., 1:]).view(64, 128)
    assert (dequant - lin.weight).abs().max() <= sz[..., 0].max() / 2 + 1e-6
    x = torch.randn(3, 128).bfloat16()
    got = Int4Linear(lin, torch.bfloat16, 32)(x).float()
    # the kernel keeps scales and zeros in bf16: compare with the bf16-rounded dequantization
    sz16 = sz.bfloat16().float()
    dequant16 = ((codes.view(64, -1, 32).float() - 8) * sz16[..., :1] + sz16[..., 1:]).view(64, 128)
    expected = x.float() @ dequant16.T
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


needs_packed = pytest.mark.skipif(
    not cpu_kernels().packed_half, reason="this CPU's profile does not use fbgemm's packed fp16 GEMM"
)


@needs_packed
@pytest.mark.parametrize("rows", [MIN_ROWS_PACKED, 8, 300])
def test_packed_int4_path_computes_with_the_kernels_weight(rows: int) -> None:
    """Many rows of an int4 linear go through the packed fp16 copy of the very weight the int4
    kernel holds (codes and bf16 scales / zeros): equal to that weight's float32 product."""
    lin = float_linear(64, 128, bias=True)
    layer = Int4Linear(lin, torch.float32, 32, native_rows=0)  # rows that the native kernels leave
    assert layer.packed is not None and layer.nibbles is None  # the packed copy replaced them
    codes, sz = quantize_int4(lin.weight.data, 32, torch.bfloat16)
    sz = sz.float().transpose(0, 1)  # (out, groups, 2)
    weight = ((codes.view(64, -1, 32).float() - 8) * sz[..., :1] + sz[..., 1:]).view(64, 128)
    x = torch.randn(rows, 128)
    expected = x @ weight.T + lin.bias
    # fp16 holds code * scale + zero to 11 bits: 1e-3 of the output's size bounds the difference
    torch.testing.assert_close(layer(x), expected, atol=1e-3 * float(expected.abs().max()), rtol=0)


@needs_packed
def test_packed_int8_path_is_exact_and_agrees_with_the_kernel() -> None:
    lin = float_linear(64, 96, bias=True)
    layer = Int8Linear(lin, torch.float32, native_rows=0)  # rows that the native kernels leave
    q, scales = quantize_int8(lin.weight.data)
    x = torch.randn(16, 96)
    # the int8 codes are exact in fp16 and the scales are applied in float32 afterwards
    torch.testing.assert_close(layer(x), x @ (q.float() * scales[:, None]).T + lin.bias, atol=1e-4, rtol=1e-4)
    one_row = torch.cat([layer(x[i : i + 1]) for i in range(16)])  # the int8 kernel, bf16 input
    torch.testing.assert_close(one_row, layer(x), atol=2e-2 * float(one_row.abs().max()), rtol=0)


@needs_packed
@pytest.mark.parametrize(("in_features", "split"), [(576, 512), (896, 896), (1536, 1536), (1100, 1024)])
def test_packed_copy_splits_off_a_small_remainder_and_computes_the_same(in_features: int, split: int) -> None:
    """An input width a little past a multiple of 512 (SmolLM2's 576) keeps its last columns
    unpadded beside the packed part; the product is the fp16-rounded weight's either way."""
    weight, bias = torch.randn(48, in_features), torch.randn(48)
    packed = pack_half(weight, bias)
    assert packed is not None and packed.split == split
    assert (packed.tail is None) == (split == in_features)
    x = torch.randn(20, in_features)
    expected = x @ weight.half().float().T + bias
    torch.testing.assert_close(packed.matmul(x), expected, atol=1e-3 * float(expected.abs().max()), rtol=0)


@needs_packed
def test_lm_head_is_packed_only_where_fbgemm_pads_it_little() -> None:
    assert pack_half(torch.randn(8, 896), None, LM_HEAD_MAX_PADDING) is not None  # 896 -> 1,024
    assert pack_half(torch.randn(8, 576), None, LM_HEAD_MAX_PADDING) is None  # 576 -> 1,024
    assert pack_half(torch.randn(8, 576), None) is not None  # other linears: always
    head = quantize_linear(float_linear(32, 576), "lm_head", mode="int4", dtype=torch.float32)
    assert isinstance(head, Int8Linear) and head.packed is None
    x = torch.randn(4, 576)  # without a packed copy, few rows run the int8 kernel
    assert head(x).shape == (4, 32) and head(x).dtype == torch.float32


def logits_range(logits: torch.Tensor) -> float:
    return float(logits.max() - logits.min())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    ("quant", "dtype", "bound"),
    [("int8", torch.float32, 0.02), ("int8", torch.bfloat16, 0.03), ("int4", torch.bfloat16, 0.10)],
)
def test_quantized_logits_stay_close(family: str, quant: str, dtype: torch.dtype, bound: float) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES[family])
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = ModelRunner(build_model(cfg, tensors), max_context=64).forward([(SequenceState(), ids)])[0]
    model = build_model(cfg, tensors, "cpu", dtype, quant=quant)
    assert not any(isinstance(m, Linear) for m in model.modules())  # type: ignore[attr-defined]
    got = ModelRunner(model, max_context=64).forward([(SequenceState(), ids)])[0]
    err = float((got - reference).abs().max())
    assert err < bound * logits_range(reference), (err, logits_range(reference))


def greedy_path(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy tokens and the smallest top-1 / top-2 logit margin met on the way."""
    runner = ModelRunner(model, max_context=128)
    seq = SequenceState()
    logits = runner.forward([(seq, prompt)])[0]
    tokens, margins = [], []
    for _ in range(n):
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        tokens.append(int(logits.argmax()))
        logits = runner.forward([(seq, [tokens[-1]])])[0]
    return tokens, min(margins)


def successor_checkpoint(family: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Random layers over an embedding / lm_head pair that maps each token to a fixed successor.

    Random tiny models are chaotic: most meet a top-2 margin of a few hundredths within 20
    steps, which any rounding flips. Here the residual stream is dominated by the current
    token's embedding and lm_head row perm[i] is embedding i, so the next token is perm[current]
    with margins of tens of logits, while every layer (and its quantization noise) still runs.
    """
    cfg, tensors, _ = checkpoint(FAMILIES[family])
    assert not cfg["tie_word_embeddings"]
    gen = torch.Generator().manual_seed(11)
    embed = torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=gen)
    perm = torch.randperm(cfg["vocab_size"], generator=gen)
    lm_head = torch.empty_like(embed)
    lm_head[perm] = embed
    return cfg, {**tensors, "model.embed_tokens.weight": embed, "lm_head.weight": lm_head}


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_int8_greedy_equals_float_greedy(family: str) -> None:
    cfg, tensors = successor_checkpoint(family)
    prompt = [5, 17, 99, 230, 41, 8]
    expected, margin = greedy_path(build_model(cfg, tensors), prompt, 20)
    assert margin > 5.0 and len(set(expected)) == 20  # stable, and a real sequence
    for dtype in (torch.float32, torch.bfloat16):
        got, _ = greedy_path(build_model(cfg, tensors, "cpu", dtype, quant="int8"), prompt, 20)
        assert got == expected, dtype


def test_auto_picks_int4_only_for_weights_on_a_4bit_grid() -> None:
    cfg, tensors, _ = checkpoint(FAMILIES["llama"])
    assert auto_quant(tensors) == "int8"  # float weights: 32 distinct values per group
    on_grid = dict(tensors)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        codes, sz = quantize_int4(tensors[name], 32, torch.float32)  # what a Q4_1 file dequantizes to
        sz = sz.transpose(0, 1)
        out_features = codes.shape[0]
        on_grid[name] = ((codes.view(out_features, -1, 32) - 8) * sz[..., :1] + sz[..., 1:]).view(codes.shape)
        assert is_on_int4_grid(on_grid[name])
    assert auto_quant(on_grid) == "int4"
    model = build_model(cfg, on_grid, "cpu", torch.bfloat16, quant="int4")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Int4Linear)  # type: ignore[attr-defined]
    assert isinstance(model.lm_head, Int8Linear)  # type: ignore[attr-defined]


def test_unknown_quant_mode_is_refused() -> None:
    cfg, tensors, _ = checkpoint(FAMILIES["llama"])
    with pytest.raises(ValueError, match="unknown quantization"):
        build_model(cfg, tensors, quant="int3")
