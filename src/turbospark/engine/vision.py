"""Images for vision-language models: the image processor, the prompt's image spans, and the
embeddings a step injects.

- `Idefics3ImageProcessor` reproduces transformers' Idefics3 / SmolVLM image processor from the
  folder's preprocessor_config.json (a test holds it to transformers' own): the longest edge
  resized to `size.longest_edge` (even, aspect kept), both edges rounded up to multiples of
  `max_image_size.longest_edge`, cut into square tiles of that size, plus the whole image resized
  to one tile (the "global" image); rescaled and normalized. Resizing is Pillow's (the resample
  filter the config names, LANCZOS by default), on 8-bit RGB, as transformers does.
- `Qwen2VLImageProcessor` reproduces transformers' Qwen2-VL image processor (PIL backend) the
  same way: both edges rounded to multiples of patch_size * merge_size with the pixel count held
  between min_pixels and max_pixels (`smart_resize`), a bicubic resize, rescale and normalize,
  then the picture cut into patches of 3 x temporal_patch_size x patch_size x patch_size (a still
  image is its own frame twice), laid out merge block by merge block, with its patch grid (t, h, w).
- `expand_prompt` replaces each image marker of a rendered prompt with that image's tokens: for
  Idefics3 each `<image>` becomes `<fake_token_around_image><row_r_col_c><image>*n ...
  <global-img><image>*n...`, the string transformers' processor builds, tokenized the same way;
  for Qwen2-VL each `<|image_pad|>` (the template writes it between `<|vision_start|>` and
  `<|vision_end|>`) becomes t*h*w / merge_size**2 of them, one per merged patch.
- `ImagePrompt` rides on the sequence (its `runner_state`): each image's pixels, the positions
  of its `<image>` tokens in the prompt and a hash of the file's bytes. Its embeddings are
  computed once, on the engine thread, at the first step that feeds one of its tokens (every
  image due in a step is encoded in one batch, across sequences: all tiles have one shape), and
  kept until the sequence ends, so a chunk boundary inside an image's tokens only slices them.
  `cache_ids` is what the prefix cache hashes: the token ids with each image's span replaced by a
  key from its content hash, so the same picture in the next turn hits and another one misses.
- M-RoPE (Qwen2-VL): the engine hands a model 1-D positions (a token's index in its sequence).
  A Qwen2-VL prompt's `ImagePrompt` maps them to the model's 3-D rotary positions (temporal,
  height, width): a text token's three are its index less the positions the images before it
  saved (each image of an h x w merged grid takes h*w tokens but advances the position by
  max(h, w)), an image token's are its (t, row, column) in the grid plus the position where the
  image starts; a generated token continues the same way. `step_embeds` hands the step's 3-D
  positions to the model with the image rows (`StepEmbeds.mrope`) whenever a sequence in the step
  has images, decode steps included, so those steps run the model's own forward.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from turbospark.backend import BackendError, RequestImage

if TYPE_CHECKING:
    from PIL import Image

    from turbospark.tokenizer import Tokenizer

MAX_IMAGE_SIDE = 4096  # transformers' Idefics3 MAX_IMAGE_SIZE: no resized edge beyond it


def decode_image(data: bytes, where: str = "image") -> Image.Image:
    """The file's pixels as 8-bit RGB; a `BackendError` (400) naming `where` when Pillow cannot
    read it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise BackendError(f"'{where}' could not be decoded as an image: {exc}") from exc


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


@dataclass(slots=True)
class ProcessedImage:
    # Idefics3: (frames, 3, tile, tile) float32, tiles row-major then the global image;
    # Qwen2-VL: (patches, 3 * temporal_patch_size * patch_size**2), merge block by merge block
    pixel_values: torch.Tensor
    rows: int  # Idefics3's tiles (0 and 0: one frame, no tiles)
    cols: int
    grid: tuple[int, int, int] | None = None  # Qwen2-VL: the patch grid (t, h, w)


@dataclass(slots=True)
class Idefics3ImageProcessor:
    """Idefics3 / SmolVLM image preprocessing (see the module docstring)."""

    longest_edge: int = 4 * 364
    tile: int = 364
    split: bool = True
    resample: int = 1  # PIL.Image.Resampling.LANCZOS
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_resize: bool = True
    do_normalize: bool = True

    @classmethod
    def from_config(cls, pre: Mapping[str, Any]) -> Idefics3ImageProcessor:
        out = cls()
        size = pre.get("size") or {}
        out.longest_edge = int(size.get("longest_edge", out.longest_edge))
        out.tile = int((pre.get("max_image_size") or {}).get("longest_edge", out.tile))
        out.split = bool(pre.get("do_image_splitting", out.split))
        out.resample = int(pre.get("resample", out.resample))
        out.rescale_factor = float(pre.get("rescale_factor", out.rescale_factor))
        out.image_mean = tuple(pre.get("image_mean", out.image_mean))
        out.image_std = tuple(pre.get("image_std", out.image_std))
        out.do_resize = bool(pre.get("do_resize", True))
        out.do_normalize = bool(pre.get("do_normalize", True))
        return out

    @classmethod
    def from_folder(cls, folder: Path) -> Idefics3ImageProcessor:
        import json

        path = folder / "preprocessor_config.json"
        return cls.from_config(json.loads(path.read_text()) if path.is_file() else {})

    def _resize(self, img: Image.Image, height: int, width: int) -> Image.Image:
        return img.resize((width, height), resample=self.resample)

    def process(self, img: Image.Image) -> ProcessedImage:
        if self.do_resize:
            h, w = _rescale_to_max_len(img.height, img.width, self.longest_edge)
            h, w = _scale_below(h, w, MAX_IMAGE_SIDE)
            img = self._resize(img, h, w)
        tile = self.tile
        rows = cols = 0
        if self.split:
            h, w = img.height, img.width
            aspect = w / h
            if w >= h:
                w = math.ceil(w / tile) * tile
                h = math.ceil(int(w / aspect) / tile) * tile
            else:
                h = math.ceil(h / tile) * tile
                w = math.ceil(int(h * aspect) / tile) * tile
            img = self._resize(img, h, w)
            if h > tile or w > tile:
                rows, cols = (h - tile) // tile + 1, (w - tile) // tile + 1
                frames = [
                    img.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
                    for r in range(rows)
                    for c in range(cols)
                ]
                frames.append(self._resize(img, tile, tile))
            else:
                frames = [img]
        else:
            frames = [self._resize(img, tile, tile)]
        arrays = np.stack([np.asarray(f, dtype=np.uint8) for f in frames])  # (n, H, W, 3)
        pixels = _rescale_normalize(
            arrays, self.rescale_factor, self.image_mean, self.image_std, self.do_normalize
        )
        tensor = torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2)))
        return ProcessedImage(tensor, rows, cols)

    @property
    def max_pixels(self) -> int:
        return self.longest_edge**2


def _rescale_normalize(
    arrays: np.ndarray,
    rescale_factor: float,
    mean: Seq[float],
    std: Seq[float],
    normalize: bool,
    rescale: bool = True,
) -> np.ndarray:
    """8-bit (..., 3) pixels as float32, rescaled (in float64, as transformers does) and
    normalized per channel."""
    pixels = arrays.astype(np.float64) * rescale_factor if rescale else arrays
    pixels = pixels.astype(np.float32)
    if normalize:
        pixels = (pixels - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return pixels


OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # smart_resize refuses a picture more elongated than this


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both edges multiples of `factor`, near the picture's own (Python's
    round, ties to even, as transformers), the pixel count brought within [min_pixels,
    max_pixels] by one common scale with the aspect ratio kept."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise BackendError(
            f"the image is {width}x{height}: its aspect ratio is over {MAX_ASPECT_RATIO}, which this model "
            "cannot read"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


@dataclass(slots=True)
class Qwen2VLImageProcessor:
    """Qwen2-VL image preprocessing (see the module docstring)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = 3  # PIL.Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_config(cls, pre: Mapping[str, Any]) -> Qwen2VLImageProcessor:
        """From preprocessor_config.json: `size` {shortest_edge, longest_edge} holds the pixel
        bounds (newer files), `min_pixels` / `max_pixels` override it (older ones)."""
        out = cls()
        size = pre.get("size") or {}
        out.min_pixels = int(pre.get("min_pixels") or size.get("shortest_edge") or out.min_pixels)
        out.max_pixels = int(pre.get("max_pixels") or size.get("longest_edge") or out.max_pixels)
        for name in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if pre.get(name) is not None:
                setattr(out, name, int(pre[name]))
        out.rescale_factor = float(pre.get("rescale_factor", out.rescale_factor))
        out.image_mean = tuple(pre.get("image_mean") or out.image_mean)
        out.image_std = tuple(pre.get("image_std") or out.image_std)
        out.do_resize = bool(pre.get("do_resize", True))
        out.do_rescale = bool(pre.get("do_rescale", True))
        out.do_normalize = bool(pre.get("do_normalize", True))
        return out

    @classmethod
    def from_folder(cls, folder: Path) -> Qwen2VLImageProcessor:
        import json

        path = folder / "preprocessor_config.json"
        return cls.from_config(json.loads(path.read_text()) if path.is_file() else {})

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def process(self, img: Image.Image) -> ProcessedImage:
        if self.do_resize:
            h, w = smart_resize(img.height, img.width, self.factor, self.min_pixels, self.max_pixels)
            img = img.resize((w, h), resample=self.resample)
        elif img.height % self.factor or img.width % self.factor:
            raise BackendError(
                f"the image is {img.width}x{img.height}, not a multiple of {self.factor} pixels, and this "
                "model's preprocessor_config.json turns resizing off"
            )
        arr = np.asarray(img, dtype=np.uint8)
        pixels = _rescale_normalize(
            arr, self.rescale_factor, self.image_mean, self.image_std, self.do_normalize, self.do_rescale
        ).transpose(2, 0, 1)  # (3, H, W)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = pixels.shape[1] // p, pixels.shape[2] // p
        # (3, gh/m, m, p, gw/m, m, p) -> (gh/m, gw/m, m, m, 3, p, p): merge block by merge block,
        # each patch channel-major; then every channel's frame repeated t times (a still picture)
        blocks = pixels.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        flat = np.ascontiguousarray(frames.reshape(gh * gw, 3 * t * p * p))
        return ProcessedImage(torch.from_numpy(flat), 0, 0, (1, gh, gw))


ImageProcessor = Idefics3ImageProcessor | Qwen2VLImageProcessor


def idefics3_image_text(rows: int, cols: int, seq_len: int) -> str:
    """The text transformers' Idefics3Processor puts where one `<image>` was."""
    image = "<image>" * seq_len
    fake, glob = "<fake_token_around_image>", "<global-img>"
    if rows == 0 and cols == 0:
        return f"{fake}{glob}{image}{fake}"
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{fake}<row_{r + 1}_col_{c + 1}>{image}"
        text += "\n"
    return text + f"\n{fake}{glob}{image}{fake}"


@dataclass(eq=False)
class PromptImage:
    pixel_values: torch.Tensor  # `ProcessedImage.pixel_values`
    positions: list[int]  # where its image tokens sit in the prompt, one per embedding row
    span: tuple[int, int]  # [start, end) of its expanded tokens
    key: int  # from the file's content hash: the prefix cache's stand-in for the span's ids
    embeds: torch.Tensor | None = None  # (len(positions), hidden), once encoded
    grid: tuple[int, int, int] | None = None  # Qwen2-VL: the patch grid (t, h, w)
    merge: int = 1  # Qwen2-VL: patches merged per side into one token

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """(t, h, w) of its tokens (Qwen2-VL: the patch grid after the spatial merge)."""
        assert self.grid is not None
        t, h, w = self.grid
        return t, h // self.merge, w // self.merge


@dataclass(eq=False)
class ImagePrompt:
    """A sequence's images (see the module docstring); the sequence's `runner_state`. `mrope`: the
    model rotates by 3-D positions (Qwen2-VL), which `rope_positions` gives."""

    images: list[PromptImage] = field(default_factory=list)
    mrope: bool = False

    def cache_ids(self, token_ids: list[int]) -> list[int]:
        ids = list(token_ids)
        for image in self.images:
            start, end = image.span
            ids[start:end] = [image.key] * (end - start)
        return ids

    def due(self, start: int, end: int) -> list[PromptImage]:
        """Images with a token in [start, end) and no embeddings yet."""
        return [i for i in self.images if i.embeds is None and _overlaps(i.positions, start, end)]

    def rows(self, start: int, end: int, offset: int) -> tuple[list[int], list[torch.Tensor]]:
        """The packed rows (from `offset`, where position `start` sits) of image tokens in
        [start, end), and their embeddings."""
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for image in self.images:
            pos = image.positions
            if not _overlaps(pos, start, end):
                continue
            lo = int(np.searchsorted(pos, start))
            hi = int(np.searchsorted(pos, end))
            assert image.embeds is not None
            rows.extend(p - start + offset for p in pos[lo:hi])
            parts.append(image.embeds[lo:hi])
        return rows, parts

    def rope_positions(self, start: int, end: int) -> np.ndarray:
        """M-RoPE positions (3, end - start) of the sequence's positions [start, end), prompt or
        generated (see the module docstring). An image's tokens are one contiguous run."""
        index = np.arange(start, end, dtype=np.int64)
        out = np.broadcast_to(index, (3, end - start)).copy()
        shift = 0  # what the images so far saved: rope position = index - shift after them
        for image in self.images:
            first = image.positions[0]
            if first >= end:
                break
            t, h, w = image.token_grid
            count = t * h * w
            inside = (index >= first) & (index < first + count)
            if inside.any():
                k = index[inside] - first
                base = first - shift
                out[0, inside] = base + k // (h * w)
                out[1, inside] = base + (k // w) % h
                out[2, inside] = base + k % w
            shift += count - max(h, w)
            after = index >= first + count
            out[:, after] = index[after] - shift
        return out


def _overlaps(positions: list[int], start: int, end: int) -> bool:
    return bool(positions) and positions[0] < end and positions[-1] >= start


class Encoder(Protocol):
    """A vision model's `encode_images`: pixels (all due images' `pixel_values` concatenated)
    and, for a model that takes them (Qwen2-VL), their patch grids (images, 3) -> one embedding
    per image token, in order."""

    def __call__(self, pixels: torch.Tensor, grid_thw: torch.Tensor | None = ..., /) -> torch.Tensor: ...


class StepEmbeds(tuple[torch.Tensor, torch.Tensor]):
    """A step's (packed rows, input embeddings) of its image tokens (rows may be empty) and, for
    an M-RoPE model, `mrope`: the step's 3-D positions (3, num_tokens), else None."""

    mrope: torch.Tensor | None = None


def _encode(due: list[PromptImage], encode: Encoder, device: torch.device) -> None:
    pixels = torch.cat([img.pixel_values for img in due]).to(device)
    grids = [img.grid for img in due]
    if any(g is None for g in grids):
        out = encode(pixels)
    else:
        out = encode(pixels, torch.tensor(grids, dtype=torch.long))
    at = 0
    for img in due:
        n = len(img.positions)
        img.embeds = out[at : at + n]
        at += n
    assert at == out.shape[0], "the encoder's rows do not match the images' tokens"


def step_embeds(
    states: Seq[Any], starts: Seq[int], counts: Seq[int], encode: Encoder, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed row indices, embeddings) of the image tokens a step feeds, as a `StepEmbeds`, or
    None when it feeds none and no sequence in it needs M-RoPE positions. `states` are the step's
    sequences' runner states; sequence i feeds positions [starts[i], starts[i] + counts[i]).
    Images due now are encoded first, all in one batch."""
    prompts = [(i, s) for i, s in enumerate(states) if isinstance(s, ImagePrompt)]
    if not prompts:
        return None
    due = [img for i, p in prompts for img in p.due(starts[i], starts[i] + counts[i])]
    if due:
        _encode(due, encode, device)
    offsets = np.cumsum([0, *counts]).tolist()
    rows: list[int] = []
    parts: list[torch.Tensor] = []
    for i, p in prompts:
        r, e = p.rows(starts[i], starts[i] + counts[i], offsets[i])
        rows.extend(r)
        parts.extend(e)
    mrope = any(p.mrope and p.images for _, p in prompts)
    if not rows and not mrope:
        return None
    out = StepEmbeds(
        (
            torch.tensor(rows, dtype=torch.long, device=device),
            torch.cat(parts) if parts else torch.empty(0, 0, device=device),
        )
    )
    if mrope:
        per_seq = [
            s.rope_positions(a, a + n)
            if isinstance(s, ImagePrompt) and s.mrope
            else np.broadcast_to(np.arange(a, a + n, dtype=np.int64), (3, n))
            for s, a, n in zip(states, starts, counts, strict=True)
        ]
        out.mrope = torch.from_numpy(np.concatenate(per_seq, axis=1)).to(device)
    return out


@dataclass(slots=True)
class VisionSpec:
    """What the backend needs to turn images into a sequence's `ImagePrompt`."""

    processor: ImageProcessor
    image_token: str  # the marker the chat template writes for a picture
    image_token_id: int
    seq_len: int = 0  # Idefics3: <image> tokens (embedding rows) per frame

    def image_ids(self, processed: ProcessedImage, tokenizer: Tokenizer) -> list[int]:
        """The ids that stand for one picture in the prompt (see `expand_prompt`)."""
        if isinstance(self.processor, Qwen2VLImageProcessor):
            assert processed.grid is not None
            t, h, w = processed.grid
            return [self.image_token_id] * (t * h * w // self.processor.merge_size**2)
        text = idefics3_image_text(processed.rows, processed.cols, self.seq_len)
        return tokenizer.encode(text, add_special_tokens=False)


def expand_prompt(
    prompt_ids: Seq[int], images: Seq[RequestImage], spec: VisionSpec, tokenizer: Tokenizer
) -> tuple[list[int], ImagePrompt]:
    """The prompt with each image marker replaced by its image's tokens, and the images."""
    marks = [i for i, t in enumerate(prompt_ids) if t == spec.image_token_id]
    if len(marks) != len(images):
        raise BackendError(
            f"the prompt has {len(marks)} {spec.image_token} markers but the request has {len(images)} "
            f"images (a text part may not contain {spec.image_token} itself)"
        )
    qwen = isinstance(spec.processor, Qwen2VLImageProcessor)
    merge = spec.processor.merge_size if isinstance(spec.processor, Qwen2VLImageProcessor) else 1
    ids: list[int] = []
    prompt = ImagePrompt(mrope=qwen)
    last = 0
    for n, (mark, image) in enumerate(zip(marks, images, strict=True)):
        where = image.where or f"images[{n}]"
        processed = spec.processor.process(decode_image(image.data, where))
        ids.extend(prompt_ids[last:mark])
        start = len(ids)
        ids.extend(spec.image_ids(processed, tokenizer))
        positions = [p for p in range(start, len(ids)) if ids[p] == spec.image_token_id]
        if processed.grid is not None:
            assert len(positions) == math.prod(processed.grid) // merge**2
        else:
            frames = processed.pixel_values.shape[0]
            assert len(positions) == frames * spec.seq_len, "the image text's tokens do not match its frames"
        digest = hashlib.blake2b(image.data, digest_size=8).digest()
        key = -1 - (int.from_bytes(digest, "little") >> 1)  # negative: never a token id
        span = (start, len(ids))
        prompt.images.append(
            PromptImage(processed.pixel_values, positions, span, key, grid=processed.grid, merge=merge)
        )
        last = mark + 1
    ids.extend(prompt_ids[last:])
    return ids, prompt
