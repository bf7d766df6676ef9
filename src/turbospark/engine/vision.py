"""Images for vision-language models: the image processor, the prompt's image spans, and the
embeddings a step injects.

- `Idefics3ImageProcessor` reproduces transformers' Idefics3 / SmolVLM image processor from the
  folder's preprocessor_config.json (a test holds it to transformers' own): the longest edge
  resized to `size.longest_edge` (even, aspect kept), both edges rounded up to multiples of
  `max_image_size.longest_edge`, cut into square tiles of that size, plus the whole image resized
  to one tile (the "global" image); rescaled and normalized. Resizing is Pillow's (the resample
  filter the config names, LANCZOS by default), on 8-bit RGB, as transformers does.
- `expand_prompt` replaces each `<image>` token of a rendered prompt with that image's tokens
  (`<fake_token_around_image><row_r_col_c><image>*n ... <global-img><image>*n...`), the string
  transformers' processor builds, tokenized the same way.
- `ImagePrompt` rides on the sequence (its `runner_state`): each image's pixels, the positions
  of its `<image>` tokens in the prompt and a hash of the file's bytes. Its embeddings are
  computed once, on the engine thread, at the first step that feeds one of its tokens (every
  image due in a step is encoded in one batch, across sequences: all tiles have one shape), and
  kept until the sequence ends, so a chunk boundary inside an image's tokens only slices them.
  `cache_ids` is what the prefix cache hashes: the token ids with each image's span replaced by a
  key from its content hash, so the same picture in the next turn hits and another one misses.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    pixel_values: torch.Tensor  # (frames, 3, tile, tile) float32, tiles row-major then the global image
    rows: int  # 0 and 0: one frame, no tiles
    cols: int


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
        pixels = arrays.astype(np.float64) * self.rescale_factor
        pixels = pixels.astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)
            std = np.asarray(self.image_std, dtype=np.float32)
            pixels = (pixels - mean) / std
        tensor = torch.from_numpy(np.ascontiguousarray(pixels.transpose(0, 3, 1, 2)))
        return ProcessedImage(tensor, rows, cols)


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
    pixel_values: torch.Tensor  # (frames, 3, tile, tile)
    positions: list[int]  # where its <image> tokens sit in the prompt, one per embedding row
    span: tuple[int, int]  # [start, end) of its expanded tokens
    key: int  # from the file's content hash: the prefix cache's stand-in for the span's ids
    embeds: torch.Tensor | None = None  # (len(positions), hidden), once encoded


@dataclass(eq=False)
class ImagePrompt:
    """A sequence's images (see the module docstring); the sequence's `runner_state`."""

    images: list[PromptImage] = field(default_factory=list)

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


def _overlaps(positions: list[int], start: int, end: int) -> bool:
    return bool(positions) and positions[0] < end and positions[-1] >= start


Encoder = Callable[[torch.Tensor], torch.Tensor]  # pixels (frames, 3, S, S) -> (frames * n, hidden)


def step_embeds(
    states: Seq[Any], starts: Seq[int], counts: Seq[int], encode: Encoder, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed row indices, embeddings) of the image tokens a step feeds, or None when it feeds
    none. `states` are the step's sequences' runner states; sequence i feeds positions
    [starts[i], starts[i] + counts[i]). Images due now are encoded first, all in one batch."""
    prompts = [(i, s) for i, s in enumerate(states) if isinstance(s, ImagePrompt)]
    if not prompts:
        return None
    due = [img for i, p in prompts for img in p.due(starts[i], starts[i] + counts[i])]
    if due:
        out = encode(torch.cat([img.pixel_values for img in due]).to(device))
        at = 0
        for img in due:
            n = len(img.positions)
            img.embeds = out[at : at + n]
            at += n
        assert at == out.shape[0], "the encoder's rows do not match the images' tokens"
    offsets = np.cumsum([0, *counts]).tolist()
    rows: list[int] = []
    parts: list[torch.Tensor] = []
    for i, p in prompts:
        r, e = p.rows(starts[i], starts[i] + counts[i], offsets[i])
        rows.extend(r)
        parts.extend(e)
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.long, device=device), torch.cat(parts)


@dataclass(slots=True)
class VisionSpec:
    """What the backend needs to turn images into a sequence's `ImagePrompt`."""

    processor: Idefics3ImageProcessor
    image_token: str
    image_token_id: int
    seq_len: int  # <image> tokens (embedding rows) per frame


def expand_prompt(
    prompt_ids: Seq[int], images: Seq[RequestImage], spec: VisionSpec, tokenizer: Tokenizer
) -> tuple[list[int], ImagePrompt]:
    """The prompt with each `<image>` token replaced by its image's tokens, and the images."""
    marks = [i for i, t in enumerate(prompt_ids) if t == spec.image_token_id]
    if len(marks) != len(images):
        raise BackendError(
            f"the prompt has {len(marks)} {spec.image_token} markers but the request has {len(images)} "
            f"images (a text part may not contain {spec.image_token} itself)"
        )
    ids: list[int] = []
    prompt = ImagePrompt()
    last = 0
    for n, (mark, image) in enumerate(zip(marks, images, strict=True)):
        where = image.where or f"images[{n}]"
        processed = spec.processor.process(decode_image(image.data, where))
        ids.extend(prompt_ids[last:mark])
        start = len(ids)
        text = idefics3_image_text(processed.rows, processed.cols, spec.seq_len)
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        positions = [p for p in range(start, len(ids)) if ids[p] == spec.image_token_id]
        frames = processed.pixel_values.shape[0]
        assert len(positions) == frames * spec.seq_len, "the image text's tokens do not match its frames"
        digest = hashlib.blake2b(image.data, digest_size=8).digest()
        key = -1 - (int.from_bytes(digest, "little") >> 1)  # negative: never a token id
        prompt.images.append(PromptImage(processed.pixel_values, positions, (start, len(ids)), key))
        last = mark + 1
    ids.extend(prompt_ids[last:])
    return ids, prompt
