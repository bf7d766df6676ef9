"""The BERT encoder and the embedding backend on a tiny random-weight checkpoint.

The reference is transformers' BertModel on the same weights; pooling is recomputed here from
its last hidden states as sentence-transformers defines it. Tolerance: fp32, atol 1e-5 on unit
vectors and O(1) hidden states.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from embedding_models import TINY_BERT, bert_tokenizer, reference_bert, write_bert_folder
from turbospark.backend import BackendError, ChatModel, Embedder
from turbospark.engine.embedder import EmbeddingModel, is_encoder_spec, load_embedding_model, read_pooling
from turbospark.engine.loader import ModelLoadError
from turbospark.engine.models import build_encoder, build_model, is_encoder
from turbospark.engine.models.bert import Batch
from turbospark.registry import model_kinds

ATOL = 1e-5
TEXTS = [
    "the cat sat on the mat",
    "a dog",
    "quick brown fox jumps over the lazy dog and the cat was eating food on the red mat",
    "stocks",
    "the market price of stocks is red",
]


def token_ids(texts: list[str]) -> list[list[int]]:
    tok = bert_tokenizer()
    tok.no_truncation()
    tok.no_padding()
    return [e.ids for e in tok.encode_batch(texts)]


def reference_vector(ref, ids: list[int], mode: str) -> np.ndarray:
    with torch.no_grad():
        h = ref(torch.tensor([ids])).last_hidden_state[0]
    pooled = {
        "mean": h.mean(0),
        "cls": h[0],
        "max": h.max(0).values,
        "mean_sqrt_len": h.sum(0) / len(ids) ** 0.5,
    }[mode]
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


@pytest.fixture(scope="module")
def ref():
    return reference_bert()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bert_folder(tmp_path_factory.mktemp("bert") / "tiny-bert")


def test_hidden_states_match_transformers_in_a_mixed_batch(ref) -> None:
    tensors = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    model = build_encoder(TINY_BERT, tensors)
    ids = token_ids(TEXTS)
    assert len({len(s) for s in ids}) > 2  # lengths really differ, so padding is exercised
    batch = Batch.pack(ids, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(batch)
    for i, seq in enumerate(ids):
        with torch.no_grad():
            expected = ref(torch.tensor([seq])).last_hidden_state[0]
        torch.testing.assert_close(hidden[batch.seq_of_token == i], expected, atol=ATOL, rtol=0)


def test_task_model_prefix_loads_and_decoder_path_refuses_bert(ref) -> None:
    prefixed = {f"bert.{k}": v.detach().clone() for k, v in ref.state_dict().items()}
    prefixed["cls.predictions.bias"] = torch.zeros(TINY_BERT["vocab_size"])
    model = build_encoder(TINY_BERT, prefixed)
    ids = token_ids(["the cat"])
    with torch.inference_mode():
        hidden = model(Batch.pack(ids, torch.device("cpu")))
    with torch.no_grad():
        expected = ref(torch.tensor(ids)).last_hidden_state[0]
    torch.testing.assert_close(hidden, expected, atol=ATOL, rtol=0)
    assert is_encoder("bert") and not is_encoder("llama") and not is_encoder("gpt2")
    with pytest.raises(ValueError, match="encoder"):
        build_model(TINY_BERT, prefixed)
    with pytest.raises(ValueError, match="decoder"):
        build_encoder({"model_type": "llama"}, {})


@pytest.mark.parametrize("mode", ["mean", "cls", "max", "mean_sqrt_len"])
def test_pooling_follows_the_folder_config(tmp_path: Path, ref, mode: str) -> None:
    model = load_embedding_model(str(write_bert_folder(tmp_path / mode, pooling=mode)), progress=False)
    assert model.pooling == mode and model.model_id == mode
    ids = token_ids(TEXTS)
    got = model.embed_ids(ids)
    for i, seq in enumerate(ids):
        np.testing.assert_allclose(got[i], reference_vector(ref, seq, mode), atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_mixed_batch_equals_each_input_alone(folder: Path) -> None:
    model = load_embedding_model(str(folder), progress=False)
    together = np.array(model.encode(TEXTS))
    alone = np.array([model.encode([t])[0] for t in TEXTS])
    np.testing.assert_allclose(together, alone, atol=ATOL, rtol=0)
    # groups cut by max_batch_tokens give the same vectors as one big group
    model.max_batch_tokens = 24
    np.testing.assert_allclose(model.embed_ids(token_ids(TEXTS)), together, atol=ATOL, rtol=0)


def test_tokenizer_json_truncation_and_padding_are_not_applied(folder: Path, ref) -> None:
    model = load_embedding_model(str(folder), progress=False)
    long_text = TEXTS[2]
    ids = token_ids([long_text])[0]
    assert len(ids) > 8  # the saved tokenizer.json truncates and pads to 8
    result = model.submit([long_text]).result(timeout=30)
    assert result.num_tokens == len(ids)
    np.testing.assert_allclose(result.vectors[0], reference_vector(ref, ids, "mean"), atol=ATOL, rtol=0)


def test_limits_and_truncation(folder: Path, ref) -> None:
    model = load_embedding_model(str(folder), progress=False, max_context=10)
    assert model.max_context == 10
    long_text = TEXTS[2]
    with pytest.raises(
        BackendError, match=r"the input is \d+ tokens, more than model 'tiny-bert' accepts \(10"
    ):
        model.submit([long_text]).result(timeout=30)
    cut = model.submit([long_text], truncate=True).result(timeout=30)
    full = token_ids([long_text])[0]
    kept = [*full[:9], full[-1]]  # cut to the limit, the closing [SEP] kept
    assert cut.num_tokens == 10
    np.testing.assert_allclose(cut.vectors[0], reference_vector(ref, kept, "mean"), atol=ATOL, rtol=0)
    with pytest.raises(BackendError, match=r"token ids must lie in \[0, "):
        model.submit([[2, 9999, 3]]).result(timeout=30)
    with pytest.raises(BackendError, match="input 1 is empty"):
        model.submit(["cat", []]).result(timeout=30)


def test_embedding_model_is_an_embedder_and_no_chat_model(folder: Path) -> None:
    model = load_embedding_model(str(folder), progress=False)
    # it has no completion path at all: a chat request naming it is refused by the plan
    # (test_embeddings_api.py checks the 400 in each API's envelope)
    assert isinstance(model, Embedder) and not isinstance(model, ChatModel)
    assert not hasattr(model, "run_completion") and not hasattr(model, "submit_completion")
    assert model_kinds(model) == ["embedding"]
    assert model.aliases() == []  # no claude-turbospark-* alias: it is no chat model
    assert model.dimensions == TINY_BERT["hidden_size"] and model.max_context == 64
    assert is_encoder_spec(str(folder)) and not is_encoder_spec(str(folder / "missing"))


class GatedModel(EmbeddingModel):
    """Holds its first encoder run until `gate` opens, so later requests queue behind it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.runs: list[int] = []

    def embed_ids(self, sequences):
        self.runs.append(len(sequences))
        assert self.gate.wait(30)
        return super().embed_ids(sequences)


def test_requests_that_arrive_together_run_as_one_batch(folder: Path) -> None:
    plain = load_embedding_model(str(folder), progress=False)
    gated = GatedModel("gated", plain.model, bert_tokenizer(), pooling="mean")
    first = gated.submit(["the cat"])
    while not gated.runs:  # the worker has taken the first request and is held
        time.sleep(0.01)
    later = [gated.submit([TEXTS[i], TEXTS[i + 1]]) for i in range(3)]
    fourth = gated.submit([TEXTS[2]])
    gated.gate.set()
    results = [f.result(timeout=30) for f in later]
    assert gated.runs == [1, 7]  # the four requests that waited together ran as one
    assert first.result(timeout=30).vectors.shape == (1, TINY_BERT["hidden_size"])
    assert fourth.result(timeout=30).vectors.shape == (1, TINY_BERT["hidden_size"])
    for i, result in enumerate(results):
        np.testing.assert_allclose(result.vectors, plain.embed_ids(token_ids(TEXTS[i : i + 2])), atol=ATOL)


def test_one_bad_request_in_a_batch_fails_alone(folder: Path) -> None:
    plain = load_embedding_model(str(folder), progress=False)
    gated = GatedModel("gated", plain.model, bert_tokenizer(), pooling="mean", max_context=10)
    gated.submit(["cat"])
    while not gated.runs:
        time.sleep(0.01)
    good = gated.submit(["the cat sat"])
    too_long = gated.submit([TEXTS[2]], hint="; or ask for truncation")
    gated.gate.set()
    assert good.result(timeout=30).num_tokens == 5
    with pytest.raises(BackendError, match="accepts \\(10 tokens\\); shorten it; or ask for truncation"):
        too_long.result(timeout=30)
    assert gated.runs == [1, 1]


def test_read_pooling_formats(tmp_path: Path) -> None:
    assert read_pooling(tmp_path) == "mean"  # no sentence-transformers config: mean
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    assert read_pooling(tmp_path) == "cls"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    assert read_pooling(tmp_path) == "last"
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_weightedmean_tokens": True})
    )
    with pytest.raises(ModelLoadError, match="pooling_mode_weightedmean_tokens is not supported"):
        read_pooling(tmp_path)
