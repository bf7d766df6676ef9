"""The one-call native decode step (`engine/native_decode.py`) against the layer-by-layer path.

Both run the same kernels (quantized matmuls, norms, rotary, attention) in the same order, so
their logits agree to float32 rounding; bounded at 1e-4 absolute on O(1) logits, like the model
tests. The sequences sit in scattered blocks, decode together at different lengths, and one
step mixes a prompt with decodes (whose prompt takes the layer-by-layer path). Both
paths read and write float32 and float16 caches alike.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, checkpoint

from turbospark.engine import native, row_kernels
from turbospark.engine.cpu_kernels import cpu_kernels
from turbospark.engine.models import build_model
from turbospark.engine.native_decode import NativeDecoder
from turbospark.engine.runner import ModelRunner, SequenceState

pytestmark = pytest.mark.skipif(
    native.kernels() is None or not cpu_kernels().native_rows,
    reason="the CPU profile does not run the native kernels here",
)
ATOL = 1e-4


def random_ids(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_logits(
    model: torch.nn.Module, kv_dtype: torch.dtype = torch.float32, *, native_step: bool = True
) -> torch.Tensor:
    """Logits of three sequences in gappy block tables: prompts, a mixed step, decode steps.
    `native_step` off: the runner never takes the one-call step (the layer-by-layer path)."""
    runner = ModelRunner(
        model, max_context=96, max_num_seqs=3, block_size=4, enable_prefix_caching=False, kv_dtype=kv_dtype
    )
    if not native_step:
        runner._native = None
    taken = runner.block_manager.allocate(6)
    runner.block_manager.release(taken[::2])  # the first sequence gets blocks 0, 2, 4
    seqs = [SequenceState() for _ in range(3)]
    prompts = [random_ids(n, seed=n) for n in (11, 5, 17)]
    out = [runner.forward([(seqs[0], prompts[0])]), runner.forward([(seqs[1], prompts[1])])]
    # a prompt and two decodes in one step
    out.append(runner.forward([(seqs[0], [3]), (seqs[1], [4]), (seqs[2], prompts[2])]))
    tokens = [[5], [6], [7]]
    for _ in range(6):
        logits = runner.forward(list(zip(seqs, tokens, strict=True)))
        out.append(logits)
        tokens = [[int(t)] for t in logits.argmax(-1)]
    out.append(runner.forward([(seqs[1], [8])]))  # one sequence alone
    return torch.cat(out)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("family", "quant"), [("llama", "int4"), ("llama3", "int8"), ("qwen2", "int8")])
def test_one_call_step_equals_the_layer_by_layer_path(
    family: str, quant: str, kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, tensors, _ = checkpoint(FAMILIES[family])
    model = build_model(cfg, tensors, "cpu", torch.float32, quant=quant)
    assert NativeDecoder.build(model) is not None
    calls: list[int] = []
    run = NativeDecoder.run

    def counted(self: NativeDecoder, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return run(self, x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(NativeDecoder, "run", counted)
    fused = decode_logits(model, kv_dtype)
    # every all-decode step, and the two decodes of the mixed step (run apart from its prompt,
    # `row_kernels`; all three in one layer-by-layer forward under $TURBOSPARK_FAST_NONDETERMINISTIC)
    assert calls == ([2] if row_kernels.reproducible() else []) + [3] * 6 + [1]
    layered = decode_logits(model, kv_dtype, native_step=False)
    assert len(calls) == 7 + row_kernels.reproducible()
    torch.testing.assert_close(fused, layered, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_float16_cache_stays_close_to_float32(family: str) -> None:
    """The float16 cache rounds each key and value to 11 significant bits: the tiny random
    models' logits move by 0.50-0.79% of their norm (measured, llama / qwen2 / qwen3), bounded at
    2% (a misread cache is off by ~100%), and every step picks the same token. qwen3 takes the
    layer-by-layer path. Real models: benchmarks/accuracy_cpu.py."""
    cfg, tensors, _ = checkpoint(FAMILIES[family])
    model = build_model(cfg, tensors, "cpu", torch.float32, quant="int8")
    half, full = decode_logits(model, torch.float16), decode_logits(model, torch.float32)
    assert float((half - full).norm() / full.norm()) < 0.02
    assert torch.equal(half.argmax(-1), full.argmax(-1))


def test_families_with_their_own_layer_code_keep_the_layer_path() -> None:
    cfg, tensors, _ = checkpoint(FAMILIES["qwen3"])  # q/k norms: not in the C step
    assert NativeDecoder.build(build_model(cfg, tensors, "cpu", torch.float32, quant="int8")) is None


def test_float_weights_keep_the_layer_path() -> None:
    cfg, tensors, _ = checkpoint(FAMILIES["llama"])
    assert NativeDecoder.build(build_model(cfg, tensors, "cpu", torch.float32)) is None


def test_greedy_steps_take_the_argmax_the_lm_head_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """An all-greedy decode step takes the ids the int8 lm_head found while writing the logits:
    numpy's argmax of those very logits, and the same reply as the sampler's path."""
    import threading

    from test_backend import greedy, word_tokenizer

    from turbospark.engine.backend import RealChatModel

    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=0, init_std=1.0)
    model = build_model(cfg, tensors, "cpu", torch.float32, quant="int4")
    backend = RealChatModel("tiny-llama", model, word_tokenizer(), max_context=200)
    found: list[list[int] | None] = []
    execute = ModelRunner.execute

    def checked(self: ModelRunner, batch, *, want_ids: bool = False):  # type: ignore[no-untyped-def]
        out = execute(self, batch, want_ids=want_ids)
        if out.token_ids is not None:
            assert out.token_ids == out.logits.numpy().argmax(axis=1).tolist()
        found.append(out.token_ids)
        return out

    monkeypatch.setattr(ModelRunner, "execute", checked)
    prompt = random_ids(9, seed=3)
    fused = backend.run_completion(prompt, greedy(16), None, threading.Event(), lambda _: None)
    assert len(fused.token_ids) == 16
    assert sum(ids is not None for ids in found) == 15  # every decode step; the prompt's is not
    found.clear()
    monkeypatch.setattr(  # the runner is never asked for ids: the engine samples from the logits
        ModelRunner, "execute", lambda self, batch, *, want_ids=False: checked(self, batch)
    )
    sampled = backend.run_completion(prompt, greedy(16), None, threading.Event(), lambda _: None)
    assert sampled.token_ids == fused.token_ids
    assert found == [None] * 16
    backend.engine.stop(wait=5)


def test_a_step_whose_helper_stalls_gives_the_same_logits() -> None:
    """Whole decode steps with the pool's helpers stopping 2 ms in every third chunk they take:
    the chunks are taken over, and the logits equal an undisturbed run's, bit for bit."""
    kernels = native.kernels()
    assert kernels is not None
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no helpers")
    cfg, tensors, _ = checkpoint(FAMILIES["qwen2"])
    model = build_model(cfg, tensors, "cpu", torch.float32, quant="int8")
    expected = decode_logits(model, torch.float16)
    before = kernels.lib.ts_pool_steals()
    kernels.lib.ts_pool_test_stall(2_000_000)
    try:
        stalled = decode_logits(model, torch.float16)
    finally:
        kernels.lib.ts_pool_test_stall(0)
    assert torch.equal(stalled, expected)
    assert kernels.lib.ts_pool_steals() > before
