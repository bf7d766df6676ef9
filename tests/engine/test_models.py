"""Model code against the transformers implementation on the same random weights (fp32).

Tolerance: logits agree within atol 1e-4 (rtol 0); they are O(1), so that is ~1e-4 relative.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, checkpoint

from turbospark.backend import NEVER_CANCEL
from turbospark.engine.layers import rope_inv_freq
from turbospark.engine.models import build_model, supported_model_types
from turbospark.engine.runner import ModelRunner, SequenceState

ATOL = 1e-4


def reference_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]  # (num_tokens, vocab)


def random_ids(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_runner(family: str, **kwargs) -> tuple[ModelRunner, object]:
    cfg, tensors, ref = checkpoint(FAMILIES[family])
    model = build_model(cfg, tensors, "cpu", torch.float32)
    return ModelRunner(model, max_context=256, **kwargs), ref


def test_registry_lists_the_families() -> None:
    assert {"llama", "qwen2", "qwen3"} <= set(supported_model_types())
    with pytest.raises(ValueError, match="not supported"):
        build_model({"model_type": "gpt2"}, {})


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logits_match_transformers(family: str) -> None:
    runner, ref = make_runner(family)
    ids = random_ids(90, seed=1)
    logits = runner.forward([(SequenceState(), ids)])[0]
    torch.testing.assert_close(logits, reference_logits(ref, ids)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_matches_full_forward(family: str) -> None:
    runner, ref = make_runner(family)
    ids = random_ids(40, seed=2)
    expected = reference_logits(ref, ids)  # (40, vocab)
    seq = SequenceState()
    got = [runner.forward([(seq, ids[:25])])[0]]
    got += [runner.forward([(seq, [t])])[0] for t in ids[25:]]
    torch.testing.assert_close(torch.stack(got), expected[24:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_matches_one_shot(family: str) -> None:
    runner, ref = make_runner(family, prefill_chunk_size=7)
    ids = random_ids(30, seed=3)
    logits = runner.prefill(SequenceState(), ids, NEVER_CANCEL)
    assert logits is not None
    torch.testing.assert_close(logits, reference_logits(ref, ids)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_two_sequences_equals_each_alone(family: str) -> None:
    runner, ref = make_runner(family, max_num_seqs=2)
    a_ids, b_ids = random_ids(23, seed=4), random_ids(12, seed=5)
    a, b = SequenceState(), SequenceState()
    runner.forward([(b, b_ids[:11])])
    # one step mixing a whole prompt (23 tokens at positions 0..22) and a decode token (position 11)
    both = runner.forward([(a, a_ids), (b, b_ids[11:])])
    torch.testing.assert_close(both[0], reference_logits(ref, a_ids)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(both[1], reference_logits(ref, b_ids)[-1], atol=ATOL, rtol=0)
    # and then both decode together, each at its own position
    a_next, b_next = 7, 9
    both = runner.forward([(a, [a_next]), (b, [b_next])])
    torch.testing.assert_close(both[0], reference_logits(ref, [*a_ids, a_next])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(both[1], reference_logits(ref, [*b_ids, b_next])[-1], atol=ATOL, rtol=0)


def test_scattered_blocks_read_like_contiguous_ones() -> None:
    runner, ref = make_runner("llama", block_size=4, max_num_seqs=4)
    blocks = runner.block_manager
    taken = blocks.allocate(6)
    blocks.release(taken[::2])  # free blocks 0, 2, 4: the next sequence gets a gappy table
    seq = SequenceState()
    ids = random_ids(18, seed=6)
    runner.forward([(seq, ids[:10])])
    assert seq.block_table[:3] == [0, 2, 4]
    got = [runner.forward([(seq, ids[10:14])])[0]] + [runner.forward([(seq, [t])])[0] for t in ids[14:]]
    torch.testing.assert_close(torch.stack(got), reference_logits(ref, ids)[13:], atol=ATOL, rtol=0)


def test_llama3_rope_scaling_matches_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from turbospark.engine.models.llama import ModelConfig

    raw = FAMILIES["llama3"]
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**raw), "cpu")
    got = rope_inv_freq(ModelConfig.from_dict(raw))
    torch.testing.assert_close(got, expected, atol=0, rtol=1e-6)
    # the scaling changes the low frequencies (otherwise the test above proves nothing)
    assert not torch.allclose(got, rope_inv_freq(ModelConfig.from_dict({**raw, "rope_scaling": None})))


def test_rope_parameters_dict_of_newer_configs() -> None:
    from turbospark.engine.models.llama import ModelConfig

    old = ModelConfig.from_dict(FAMILIES["llama3"])
    new_style = {k: v for k, v in FAMILIES["llama3"].items() if k not in ("rope_theta", "rope_scaling")}
    new_style["rope_parameters"] = {**FAMILIES["llama3"]["rope_scaling"], "rope_theta": 500000.0}
    new = ModelConfig.from_dict(new_style)
    assert new.rope_theta == old.rope_theta
    torch.testing.assert_close(rope_inv_freq(new), rope_inv_freq(old), atol=0, rtol=0)


def test_missing_or_misshapen_weights_are_named() -> None:
    cfg, tensors, _ = checkpoint(FAMILIES["qwen2"])
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        build_model(cfg, tensors)
    cfg, tensors, _ = checkpoint(FAMILIES["qwen2"])
    tensors["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        build_model(cfg, tensors)


def test_bfloat16_path_stays_close_to_float32() -> None:
    cfg, tensors, ref = checkpoint(FAMILIES["llama"])
    model = build_model(cfg, tensors, "cpu", torch.bfloat16)
    ids = random_ids(50, seed=7)
    logits = ModelRunner(model, max_context=128).forward([(SequenceState(), ids)])[0]
    expected = reference_logits(ref, ids)[-1]
    # bf16 keeps 8 mantissa bits: a few 1e-2 on O(1) logits through two layers
    assert (logits - expected).abs().max() < 5e-2
