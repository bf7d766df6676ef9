"""llama.cpp `mmproj` files: a vision-language model's vision tower and projector, kept in a GGUF
of their own beside the text model's GGUF.

Contract: `find_mmproj(model_gguf) -> Path | None` (an `mmproj*.gguf` beside the model) and
`attach_mmproj(text_checkpoint, mmproj_path) -> LoadedCheckpoint`: the text GGUF's checkpoint
turned into the vision family's, as a Hugging Face folder of the same model loads (config with
`text_config` / `vision_config`, HF tensor names, and a preprocessor_config.json-style dict for the
image processor), so the model code and the engine see no difference. A file whose projector
type or sizes do not fit the text model is refused by name (`ModelLoadError`).

The format, as llama.cpp's converter writes it and its `clip` loader reads it:
  - `general.architecture` is "clip"; `clip.has_vision_encoder` is true; the projector type is
    `clip.projector_type` (or `clip.vision.projector_type` in files with audio too).
  - The tower's sizes: `clip.vision.{image_size, patch_size, embedding_length,
    feed_forward_length, block_count, attention.head_count, attention.layer_norm_epsilon}`, all
    required (llama.cpp refuses a file without them); `clip.vision.projection_dim` is the text
    model's hidden size; `clip.vision.image_mean` / `image_std` the normalization; `clip.use_gelu`
    the tower's activation (ggml's tanh-approximated GELU, SigLIP's gelu_pytorch_tanh).
  - Tensors: `v.patch_embd.{weight,bias}` (the patch convolution, stored as the HF conv weight:
    GGUF dims [p, p, 3, hidden] are torch's (hidden, 3, p, p)), `v.position_embd.weight`,
    per block `v.blk.N.{attn_q, attn_k, attn_v, attn_out, ln1, ln2, ffn_up, ffn_down}`,
    `v.post_ln`, and the projector's own tensors. The converter renames only: the tower has no
    rotary embedding, so unlike the llama text model no q/k rows are permuted.

Families (projector types) read here:
  - "idefics3" (SmolVLM / Idefics3, text model "llama"): SigLIP tower, pixel shuffle by
    `clip.vision.projector.scale_factor`, then `mm.model.fc.weight` (no bias), the HF
    `model.connector.modality_projection.proj.weight`. The image processor is transformers'
    Idefics3 one (`vision.Idefics3ImageProcessor`), which llama.cpp's idefics3 preprocessor
    follows: tiles of `image_size`, the longest edge first resized to
    `clip.vision.preproc_image_size` (the folder's size.longest_edge), LANCZOS, always split into
    tiles plus the global image (the format has no switch for splitting, and llama.cpp always
    splits), rescaled by 1/255 (no key; the value every SmolVLM uses) and normalized by the
    file's mean/std. The image tokens (`<image>`, `<fake_token_around_image>`, `<global-img>`,
    `<row_r_col_c>`) and the chat template come from the text GGUF's vocabulary and
    `tokenizer.chat_template`, as llama.cpp's mtmd reads them.
Other projector types (Qwen2-VL's "qwen2vl_merger", ...) are refused by name.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from turbospark.engine.checkpoint import LoadedCheckpoint, ModelLoadError

if TYPE_CHECKING:
    import tokenizers
    import torch

    from turbospark.engine.gguf_file import GGUFFile

log = logging.getLogger("turbospark.engine")

MMPROJ_ARCHITECTURE = "clip"  # general.architecture of every mmproj file
MMPROJ_PREFIX = "mmproj"  # llama.cpp's file naming: mmproj-<model>-<type>.gguf
SUPPORTED_PROJECTORS = ("idefics3",)

# the tokens transformers' Idefics3 processor (and llama.cpp's mtmd) writes around each tile
IDEFICS3_IMAGE_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>")

_BLOCK_TENSORS = {  # GGUF block tensor -> HF module under model.vision_model.encoder.layers.N
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
_GLOBAL_TENSORS = {
    "v.patch_embd": "model.vision_model.embeddings.patch_embedding",
    "v.position_embd": "model.vision_model.embeddings.position_embedding",
    "v.post_ln": "model.vision_model.post_layernorm",
    "mm.model.fc": "model.connector.modality_projection.proj",
}


def is_mmproj_name(path: Path) -> bool:
    """A file named as llama.cpp names projector files (mmproj*.gguf, any case)."""
    name = path.name.lower()
    return name.startswith(MMPROJ_PREFIX) and name.endswith(".gguf")


def find_mmproj(model: Path) -> Path | None:
    """The `mmproj*.gguf` file beside a model GGUF, or None. With several there, the one named
    after the model as llama.cpp's converter names them (mmproj-<model file>) is taken; otherwise
    they are refused by name (which one belongs to the model is for --mmproj to say)."""
    folder = model.parent
    try:
        beside = sorted(p for p in folder.iterdir() if is_mmproj_name(p) and p.is_file() and p != model)
    except OSError:
        return None
    if len(beside) > 1:
        named = [
            p for p in beside if p.name.lower()[len(MMPROJ_PREFIX) :].lstrip("-_.") == model.name.lower()
        ]
        if len(named) == 1:
            return named[0]
        names = ", ".join(p.name for p in beside)
        raise ModelLoadError(
            f"{model}: several mmproj files beside it ({names}); name the one to use with --mmproj"
        )
    return beside[0] if beside else None


def is_mmproj_file(gguf: GGUFFile) -> bool:
    return gguf.metadata.get("general.architecture") == MMPROJ_ARCHITECTURE


@dataclass
class Projector:
    """What an mmproj file adds to a text checkpoint (see `attach_mmproj`)."""

    path: Path
    projector_type: str
    config: dict[str, Any]  # the vision family's top-level config keys (vision_config, ...)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # HF names
    preprocessor: dict[str, Any] = field(default_factory=dict)  # preprocessor_config.json style


def _projector_type(gguf: GGUFFile) -> str:
    meta = gguf.metadata
    value = meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")
    if not isinstance(value, str) or not value:
        raise ModelLoadError(f"{gguf.path}: no clip.projector_type in the mmproj metadata")
    return value


def _require_int(gguf: GGUFFile, key: str) -> int:
    value = gguf.metadata.get(key)
    if value is None:
        raise ModelLoadError(f"{gguf.path}: no {key} in the mmproj metadata")
    return int(value)


def _floats(gguf: GGUFFile, key: str) -> tuple[float, float, float]:
    value = gguf.metadata.get(key)
    if not isinstance(value, np.ndarray | list) or len(value) < 3:
        raise ModelLoadError(f"{gguf.path}: {key} must hold 3 numbers (the image's channels)")
    # float32 in the file: 0.5 stays 0.5, 0.48145466 reads back as 0.48145466 to seven digits
    return tuple(float(f"{float(v):.7g}") for v in list(value)[:3])  # type: ignore[return-value]


def _idefics3(
    gguf: GGUFFile, text_config: Mapping[str, Any], tokenizer: tokenizers.Tokenizer, text_source: str
) -> Projector:
    path, meta = gguf.path, gguf.metadata
    if text_config.get("model_type") != "llama":
        raise ModelLoadError(
            f"{path}: an idefics3 (SmolVLM) projector goes with a Llama text model, but {text_source} is "
            f"{text_config.get('model_type')!r}: this mmproj belongs to another model"
        )
    hidden = _require_int(gguf, "clip.vision.embedding_length")
    vision: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": _require_int(gguf, "clip.vision.feed_forward_length"),
        "num_hidden_layers": _require_int(gguf, "clip.vision.block_count"),
        "num_attention_heads": _require_int(gguf, "clip.vision.attention.head_count"),
        "image_size": _require_int(gguf, "clip.vision.image_size"),
        "patch_size": _require_int(gguf, "clip.vision.patch_size"),
        "num_channels": 3,
    }
    eps = meta.get("clip.vision.attention.layer_norm_epsilon")
    if eps is None:
        raise ModelLoadError(f"{path}: no clip.vision.attention.layer_norm_epsilon in the mmproj metadata")
    vision["layer_norm_eps"] = float(f"{float(eps):.7g}")
    if meta.get("clip.use_silu"):
        raise ModelLoadError(f"{path}: clip.use_silu is set; a SigLIP tower runs GELU")
    if not meta.get("clip.use_gelu"):
        # llama.cpp would run quick-GELU (x * sigmoid(1.702 x)), which no SmolVLM was trained with
        raise ModelLoadError(f"{path}: clip.use_gelu is not set (the tower's activation would be quick-GELU)")
    vision["hidden_act"] = "gelu_pytorch_tanh"  # ggml_gelu is the tanh approximation
    if hidden % vision["num_attention_heads"]:
        raise ModelLoadError(
            f"{path}: clip.vision.embedding_length {hidden} is not a multiple of the "
            f"{vision['num_attention_heads']} attention heads"
        )
    if vision["image_size"] % vision["patch_size"]:
        raise ModelLoadError(
            f"{path}: clip.vision.image_size {vision['image_size']} is not a multiple of patch_size "
            f"{vision['patch_size']}"
        )

    text_hidden = int(text_config["hidden_size"])
    fc = gguf.tensors.get("mm.model.fc.weight")
    if fc is None:
        raise ModelLoadError(f"{path}: no mm.model.fc.weight (the idefics3 projector)")
    out_features, in_features = fc.shape if len(fc.shape) == 2 else (0, 0)
    projection_dim = meta.get("clip.vision.projection_dim")
    made = int(projection_dim) if projection_dim is not None else out_features
    if made != text_hidden or out_features != text_hidden:
        raise ModelLoadError(
            f"{path}: the projector makes {out_features}-wide embeddings (clip.vision.projection_dim "
            f"{projection_dim}) but the text model {text_source} takes {text_hidden} (embedding_length): "
            "this mmproj belongs to another model"
        )
    # clip.vision.projector.scale_factor: the converter always writes it (config scale_factor,
    # default 2); without it llama.cpp merges 1 patch per side, which no idefics3 projector fits,
    # so a file lacking it gets the factor its projector's width implies
    factor = meta.get("clip.vision.projector.scale_factor")
    implied = math.isqrt(in_features // hidden) if in_features % hidden == 0 else 0
    scale = int(factor) if factor is not None else implied
    if scale < 1 or in_features != hidden * scale * scale:
        raise ModelLoadError(
            f"{path}: mm.model.fc.weight takes {in_features} inputs, but clip.vision.embedding_length "
            f"{hidden} and scale_factor {scale} make {hidden * scale * scale}"
        )
    side = vision["image_size"] // vision["patch_size"]
    if side % scale:
        raise ModelLoadError(f"{path}: {side} patches per side do not merge by scale_factor {scale}")

    missing = [t for t in IDEFICS3_IMAGE_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise ModelLoadError(
            f"{path}: the vocabulary of {text_source} has no {', '.join(missing)}: it is not the text "
            "model of this SmolVLM / Idefics3 projector"
        )
    # clip.vision.preproc_image_size: the folder's size.longest_edge; the converter falls back to
    # the tile size when the folder has none, and so does a file without the key (one tile)
    longest = meta.get("clip.vision.preproc_image_size")
    preprocessor = {
        "do_resize": True,
        "size": {"longest_edge": int(longest) if longest else vision["image_size"]},
        "max_image_size": {"longest_edge": vision["image_size"]},
        "do_image_splitting": True,  # no key; llama.cpp always splits
        "resample": 1,  # PIL LANCZOS, as transformers and llama.cpp's idefics3 preprocessor
        "do_rescale": True,
        "rescale_factor": 1 / 255,  # no key; SmolVLM's value
        "do_normalize": True,
        "image_mean": list(_floats(gguf, "clip.vision.image_mean")),
        "image_std": list(_floats(gguf, "clip.vision.image_std")),
    }
    config = {
        "vision_config": vision,
        "scale_factor": scale,
        "image_token_id": tokenizer.token_to_id("<image>"),
    }
    return Projector(path, "idefics3", config, preprocessor=preprocessor)


def _expected_shapes(vision: Mapping[str, Any], text_hidden: int, scale: int) -> dict[str, tuple[int, ...]]:
    """Every tensor an idefics3 mmproj holds, by HF name, with its torch shape."""
    d, f, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    side = vision["image_size"] // p
    shapes: dict[str, tuple[int, ...]] = {
        "model.vision_model.embeddings.patch_embedding.weight": (d, vision["num_channels"], p, p),
        "model.vision_model.embeddings.patch_embedding.bias": (d,),
        "model.vision_model.embeddings.position_embedding.weight": (side * side, d),
        "model.vision_model.post_layernorm.weight": (d,),
        "model.vision_model.post_layernorm.bias": (d,),
        "model.connector.modality_projection.proj.weight": (text_hidden, d * scale * scale),
    }
    for i in range(vision["num_hidden_layers"]):
        prefix = f"model.vision_model.encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{prefix}self_attn.{name}.weight"] = (d, d)
            shapes[f"{prefix}self_attn.{name}.bias"] = (d,)
        for name in ("layer_norm1", "layer_norm2"):
            shapes[f"{prefix}{name}.weight"] = (d,)
            shapes[f"{prefix}{name}.bias"] = (d,)
        shapes[f"{prefix}mlp.fc1.weight"] = (f, d)
        shapes[f"{prefix}mlp.fc1.bias"] = (f,)
        shapes[f"{prefix}mlp.fc2.weight"] = (d, f)
        shapes[f"{prefix}mlp.fc2.bias"] = (d,)
    return shapes


def hf_name(gguf_name: str) -> str | None:
    """The HF name of an idefics3 mmproj tensor, or None for one it does not have."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in _BLOCK_TENSORS:
        return f"model.vision_model.encoder.layers.{parts[2]}.{_BLOCK_TENSORS[parts[3]]}.{kind}"
    return None


def _read_tensors(
    gguf: GGUFFile, projector: Projector, text_hidden: int, dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    from turbospark.engine.gguf_loader import dequantize

    vision = projector.config["vision_config"]
    expected = _expected_shapes(vision, text_hidden, projector.config["scale_factor"])
    tensors: dict[str, torch.Tensor] = {}
    for info in gguf.tensors.values():
        name = hf_name(info.name)
        if name is None or name not in expected:
            raise ModelLoadError(
                f"{gguf.path}: unexpected tensor {info.name!r} for an {projector.projector_type} projector "
                f"of {vision['num_hidden_layers']} blocks"
            )
        if tuple(info.shape) != expected[name]:
            raise ModelLoadError(
                f"{gguf.path}: tensor {info.name!r} is {list(info.shape)}, but the metadata's sizes make it "
                f"{list(expected[name])}"
            )
        try:
            tensors[name] = dequantize(gguf.raw(info), info.ggml_type, info.shape, dtype)
        except ModelLoadError as e:
            raise ModelLoadError(f"{gguf.path}: tensor {info.name!r}: {e}") from e
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ModelLoadError(
            f"{gguf.path}: missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    return tensors


_READERS: dict[str, Callable[[GGUFFile, Mapping[str, Any], tokenizers.Tokenizer, str], Projector]] = {
    "idefics3": _idefics3,
}
# projector type -> (HF model_type, architectures entry) of the combined checkpoint
_FAMILIES = {"idefics3": ("idefics3", "Idefics3ForConditionalGeneration")}


def read_mmproj(
    path: Path,
    text_config: Mapping[str, Any],
    tokenizer: tokenizers.Tokenizer,
    dtype: torch.dtype | None = None,
    text_source: str = "the text model",
) -> Projector:
    """The mmproj file's tower, projector and image settings, checked against the text model
    (`text_config`, the text GGUF's HF-style config, its tokenizer, and `text_source` to name
    it in errors); raises ModelLoadError."""
    from turbospark.engine.gguf_file import GGUFFile

    if not path.is_file():
        raise ModelLoadError(f"{path}: no such mmproj file")
    gguf = GGUFFile(path)
    arch = gguf.metadata.get("general.architecture")
    if arch != MMPROJ_ARCHITECTURE:
        raise ModelLoadError(
            f"{path}: not an mmproj file (general.architecture {arch!r}, want {MMPROJ_ARCHITECTURE!r})"
        )
    if not gguf.metadata.get("clip.has_vision_encoder", False):
        raise ModelLoadError(f"{path}: the mmproj holds no vision encoder (clip.has_vision_encoder is false)")
    kind = _projector_type(gguf)
    reader = _READERS.get(kind)
    if reader is None:
        raise ModelLoadError(
            f"{path}: projector type {kind!r} is not supported (supported: {', '.join(SUPPORTED_PROJECTORS)})"
        )
    projector = reader(gguf, text_config, tokenizer, text_source)
    projector.tensors = _read_tensors(gguf, projector, int(text_config["hidden_size"]), dtype)
    return projector


def attach_mmproj(ckpt: LoadedCheckpoint, path: Path, dtype: torch.dtype | None = None) -> LoadedCheckpoint:
    """The text GGUF's checkpoint with the mmproj's tower: the vision family's config (the text
    config as `text_config`), the text tensors under the family's text prefix, the tower's, and
    the image processor's settings (`LoadedCheckpoint.preprocessor`)."""
    text_config = dict(ckpt.config)
    projector = read_mmproj(path, text_config, ckpt.tokenizer, dtype, ckpt.source)
    model_type, hf_class = _FAMILIES[projector.projector_type]
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "text_config": text_config,
        **projector.config,
        "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
        "torch_dtype": text_config.get("torch_dtype", "float32"),
    }
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in ckpt.tensors.items():
        # Idefics3's text model sits under model.text_model (the HF checkpoint's names)
        tensors[name.replace("model.", "model.text_model.", 1) if name.startswith("model.") else name] = (
            tensor
        )
    tensors.update(projector.tensors)
    log.info("%s: vision tower and %s projector from %s", ckpt.name, projector.projector_type, path)
    return LoadedCheckpoint(
        name=ckpt.name,
        source=ckpt.source,
        config=config,
        tensors=tensors,
        tokenizer=ckpt.tokenizer,
        tokenizer_config=ckpt.tokenizer_config,
        sampling=ckpt.sampling,
        preprocessor=projector.preprocessor,
        mmproj=str(path),
    )
