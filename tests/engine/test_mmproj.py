"""A SmolVLM held as llama.cpp ships it (a text GGUF plus an mmproj GGUF, `tiny_gguf_vlm`)
against the Hugging Face folder of the same weights, both loaded as `serve --model` loads them
(float32, CPU): the same checkpoint and image processor, the same vision-encoder output, merged
image embeddings, next-token logits and greedy tokens; the mmproj found beside the model file;
mmproj files that do not fit refused by name; a text GGUF alone still refusing images; and a
server on the GGUF pair answering an OpenAI image request as the folder's does."""

from __future__ import annotations

import base64
import logging
import threading
from pathlib import Path

import pytest
import torch
from tests.engine import tiny_gguf_vlm, tiny_vlm

from turbospark import cli
from turbospark.backend import BackendError, GenerationConfig, RequestImage
from turbospark.engine.backend import RealChatModel, load_backend
from turbospark.engine.loader import ModelLoadError, load_checkpoint
from turbospark.engine.runner import StepInputs
from turbospark.engine.vision import expand_prompt, step_embeds

pytest.importorskip("PIL")

PICTURE = tiny_vlm.png(100, 70, seed=21)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-smolvlm")
    tiny_vlm.save_folder(path)
    return path


@pytest.fixture(scope="module")
def pair(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_gguf_vlm.write_pair(folder, tmp_path_factory.mktemp("gguf"))


def _load(spec: Path, **kwargs: object) -> RealChatModel:
    return load_backend(
        str(spec),
        quant=None,
        dtype="float32",
        progress=False,
        kv_cache_gb=0.05,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def hf(folder: Path) -> RealChatModel:
    return _load(folder)


@pytest.fixture(scope="module")
def gguf(pair: tuple[Path, Path]) -> RealChatModel:
    text, proj = pair
    return _load(text, mmproj=str(proj))  # serve --model TEXT.gguf --mmproj MMPROJ.gguf


def _prompt(backend: RealChatModel, n_images: int = 1) -> list[int]:
    from turbospark.chat_template import render_chat_template

    content = [{"type": "image"}] * n_images + [{"type": "text", "text": "What is in the picture?"}]
    text = render_chat_template(
        backend.tokenizer.chat_template or "",
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
    )
    return backend.tokenizer.encode(text)


def test_the_gguf_pair_is_the_folders_checkpoint(folder: Path, pair: tuple[Path, Path]) -> None:
    text, proj = pair
    ours = load_checkpoint(str(text), progress=False, mmproj=proj)
    theirs = load_checkpoint(str(folder), progress=False)
    assert ours.config["model_type"] == "idefics3" and ours.mmproj == str(proj)
    assert set(ours.tensors) == set(theirs.tensors)
    for name, tensor in theirs.tensors.items():
        assert torch.equal(ours.tensors[name], tensor), name  # q/k rows un-permuted, conv kept
    for key in ("scale_factor", "image_token_id"):
        assert ours.config[key] == theirs.config[key]
    vision = {k: v for k, v in theirs.config["vision_config"].items() if k in ours.config["vision_config"]}
    assert ours.config["vision_config"] == vision | {"hidden_act": "gelu_pytorch_tanh"}
    assert ours.tokenizer_config["chat_template"] == theirs.tokenizer_config["chat_template"]
    assert ours.tokenizer_config["eos_token_ids"] == theirs.tokenizer_config["eos_token_ids"]


def test_same_image_processor_and_prompt_tokens(hf: RealChatModel, gguf: RealChatModel) -> None:
    assert hf._vision is not None and gguf._vision is not None
    # from the mmproj's metadata: tile 64, longest edge 128, mean/std, LANCZOS, splitting
    assert gguf._vision.processor == hf._vision.processor
    assert (gguf._vision.image_token_id, gguf._vision.seq_len) == (
        hf._vision.image_token_id,
        hf._vision.seq_len,
    )
    images = [RequestImage(PICTURE, "image/png"), RequestImage(tiny_vlm.png(40, 90, seed=22), "image/png")]
    ids_h, _ = expand_prompt(_prompt(hf, 2), images, hf._vision, hf.tokenizer)
    ids_g, _ = expand_prompt(_prompt(gguf, 2), images, gguf._vision, gguf.tokenizer)
    assert ids_g == ids_h


def _logits(backend: RealChatModel, ids: list[int], prompt, cut: int) -> torch.Tensor:
    runner = backend.runner
    model = runner.model
    table: list[int] = []
    assert runner.block_manager.grow(table, len(ids))
    logits = None
    for start, end in ((0, cut), (cut, len(ids))):  # a chunk boundary inside the image's tokens
        step = StepInputs(ids[start:end], [table], [start], [end - start], [0])
        step.embeds = step_embeds([prompt], [start], [end - start], model.encode_images, runner.device)  # type: ignore[attr-defined]
        logits = runner.run_step(step).logits[0]
    runner.block_manager.release(table)
    assert logits is not None
    return logits


def test_encoder_embeddings_and_logits_equal_the_folders(hf: RealChatModel, gguf: RealChatModel) -> None:
    images = [RequestImage(PICTURE, "image/png")]
    out = {}
    for key, backend in (("hf", hf), ("gguf", gguf)):
        assert backend._vision is not None
        ids, prompt = expand_prompt(_prompt(backend), images, backend._vision, backend.tokenizer)
        model = backend.runner.model
        with torch.no_grad():
            pixels = torch.cat([img.pixel_values for img in prompt.images])
            encoded = model.encode_images(pixels)  # type: ignore[attr-defined]
            rows = torch.tensor(prompt.images[0].positions)
            merged = model.model.embed_tokens(torch.tensor(ids))  # type: ignore[union-attr]
            merged.index_copy_(0, rows, encoded)
        positions = prompt.images[0].positions
        logits = _logits(backend, ids, prompt, positions[len(positions) // 2])
        out[key] = (ids, encoded, merged, logits)
    (ids_h, enc_h, merged_h, logits_h), (ids_g, enc_g, merged_g, logits_g) = out["hf"], out["gguf"]
    assert ids_g == ids_h
    assert enc_g.shape == (5 * tiny_vlm.SEQ_LEN, 64)  # 2x2 tiles and the global image
    torch.testing.assert_close(enc_g, enc_h, atol=0, rtol=0)
    torch.testing.assert_close(merged_g, merged_h, atol=0, rtol=0)
    torch.testing.assert_close(logits_g, logits_h, atol=1e-6, rtol=1e-6)


def _greedy(backend: RealChatModel, n: int = 8) -> list[int]:
    config = GenerationConfig(max_new_tokens=n, temperature=0.0)
    result = backend.run_completion(
        _prompt(backend), config, [RequestImage(PICTURE, "image/png")], threading.Event(), lambda _: None
    )
    return list(result.token_ids)


def test_greedy_tokens_equal_the_folders(hf: RealChatModel, gguf: RealChatModel) -> None:
    tokens = _greedy(gguf)
    assert tokens and tokens == _greedy(hf)


def test_f16_mmproj_loads_close_to_the_folder(folder: Path, tmp_path: Path, hf: RealChatModel) -> None:
    # the converter's default: 2-D weights F16, the patch / position embeddings kept F32
    text, _ = tiny_gguf_vlm.write_pair(folder, tmp_path, weight_type=tiny_gguf_vlm.F16)
    backend = _load(text)
    assert backend._vision is not None and hf._vision is not None
    pixels = hf._vision.processor.process(__import__("PIL.Image").Image.new("RGB", (64, 64))).pixel_values
    with torch.no_grad():
        ours = backend.runner.model.encode_images(pixels)  # type: ignore[attr-defined]
        theirs = hf.runner.model.encode_images(pixels)  # type: ignore[attr-defined]
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


def test_mmproj_beside_the_model_is_found_and_logged(
    pair: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    text, proj = pair
    with caplog.at_level(logging.INFO, logger="turbospark.engine"):
        ckpt = load_checkpoint(str(text), progress=False)
    assert ckpt.mmproj == str(proj) and ckpt.config["model_type"] == "idefics3"
    assert any(proj.name in r.getMessage() and "beside" in r.getMessage() for r in caplog.records)
    # the folder as the model spec: the mmproj is no second model
    assert load_checkpoint(str(text.parent), progress=False).mmproj == str(proj)
    # a draft model (or any caller that says so) skips the search
    assert load_checkpoint(str(text), progress=False, find_mmproj=False).config["model_type"] == "llama"


def test_several_mmproj_files_beside_the_model_are_refused_by_name(folder: Path, tmp_path: Path) -> None:
    text, proj = tiny_gguf_vlm.write_pair(folder, tmp_path)
    f32 = proj.rename(tmp_path / "mmproj-F32.gguf")  # named after their type only
    f16 = tmp_path / "mmproj-F16.gguf"
    tiny_gguf_vlm.write_mmproj(folder, f16, weight_type=tiny_gguf_vlm.F16)
    with pytest.raises(
        ModelLoadError,
        match=r"several mmproj files beside it \(mmproj-F16\.gguf, mmproj-F32\.gguf\).*--mmproj",
    ):
        load_checkpoint(str(text), progress=False)
    assert load_checkpoint(str(text), progress=False, mmproj=f16).mmproj == str(f16)
    # a flat folder of several models: the one named as the converter names it,
    # mmproj-<model file>, is the model's
    own = tmp_path / f"mmproj-{text.name}"
    tiny_gguf_vlm.write_mmproj(folder, own)
    assert load_checkpoint(str(text), progress=False).mmproj == str(own)
    assert f32.is_file()


def _refused(folder: Path, tmp_path: Path, **mmproj: object) -> str:
    text, proj = tiny_gguf_vlm.write_pair(folder, tmp_path, **mmproj)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError) as err:
        load_checkpoint(str(text), progress=False, mmproj=proj)
    message = str(err.value)
    assert str(proj) in message  # the file is named
    return message


def test_a_projector_for_another_text_width_is_refused_by_name(folder: Path, tmp_path: Path) -> None:
    # an mmproj made for a 48-wide text model (another SmolVLM size) beside this 64-wide one
    def narrower(name, values):
        return values[:48] if name == "mm.model.fc.weight" else values

    message = _refused(folder, tmp_path, metadata={"clip.vision.projection_dim": ("u32", 48)}, edit=narrower)
    assert "48-wide embeddings" in message and "takes 64" in message and "another model" in message
    assert "SmolVLM-tiny-F32.gguf takes 64" in message  # the text model is named too


def test_a_tower_whose_sizes_do_not_match_its_tensors_is_refused(folder: Path, tmp_path: Path) -> None:
    message = _refused(folder, tmp_path, metadata={"clip.vision.embedding_length": ("u32", 48)})
    assert "mm.model.fc.weight takes 128 inputs" in message and "embedding_length 48" in message


def test_other_projector_types_are_refused_by_name(folder: Path, tmp_path: Path) -> None:
    message = _refused(folder, tmp_path, projector_type="qwen2vl_merger")
    assert "'qwen2vl_merger' is not supported" in message and "idefics3" in message


def test_a_missing_required_key_is_refused_by_name(folder: Path, tmp_path: Path) -> None:
    message = _refused(folder, tmp_path, metadata={"clip.vision.patch_size": None})
    assert "clip.vision.patch_size" in message


def test_an_mmproj_given_as_the_model_is_refused_by_name(pair: tuple[Path, Path]) -> None:
    with pytest.raises(ModelLoadError, match=r"mmproj file .* not a model.*--mmproj"):
        load_checkpoint(str(pair[1]), progress=False)


def test_a_text_gguf_alone_refuses_images_by_name(pair: tuple[Path, Path], tmp_path: Path) -> None:
    alone = tmp_path / pair[0].name
    alone.write_bytes(pair[0].read_bytes())  # no mmproj beside it
    backend = _load(alone)
    assert backend.vision() is None
    with pytest.raises(BackendError, match="does not accept images: it has no vision tower"):
        _greedy(backend, 1)


def test_serve_flag_goes_with_the_first_model() -> None:
    args = cli.parser().parse_args(["serve", "--model", "a.gguf", "--model", "b.gguf", "--mmproj", "p.gguf"])
    assert cli.mmproj_for("a.gguf", args) == "p.gguf"
    assert cli.mmproj_for("b.gguf", args) is None
    assert cli.mmproj_for("a.gguf", cli.parser().parse_args(["serve", "--model", "a.gguf"])) is None


def test_model_dir_lists_no_mmproj_as_a_model(pair: tuple[Path, Path]) -> None:
    from turbospark.store import _dir_models

    names = [name for name, _ in _dir_models(pair[0].parent)]
    assert names == [pair[0].stem]


def test_a_server_on_the_gguf_pair_answers_as_on_the_folder(hf: RealChatModel, gguf: RealChatModel) -> None:
    import openai

    from turbospark.testing import LiveServer

    b64 = base64.b64encode(PICTURE).decode()

    def ask(backend: RealChatModel) -> str:
        with (
            LiveServer([backend]) as live,
            openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0) as client,
        ):
            reply = client.chat.completions.create(
                model=backend.model_id,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
                            {"type": "text", "text": "What is in the picture?"},
                        ],
                    }
                ],
                max_tokens=6,
                temperature=0,
            )
        return reply.choices[0].message.content or ""

    text = ask(gguf)
    assert text and text == ask(hf)


def test_the_disk_cache_fingerprint_names_the_mmproj(pair: tuple[Path, Path], tmp_path: Path) -> None:
    # image tokens' KV depends on the tower: another mmproj must not read this one's blocks
    from turbospark.engine.disk_cache import fingerprint

    text, proj = pair
    k = torch.zeros(2, 4, 16, 8)
    assert fingerprint(str(text), k, 16, (str(proj),)) != fingerprint(str(text), k, 16)
    backend = _load(text, mmproj=str(proj), disk_cache_gb=0.01, disk_cache_dir=str(tmp_path))
    kv = backend.runner.kv_cache
    assert (tmp_path / fingerprint(str(text), kv.k, kv.block_size, (str(proj),))).is_dir()
