"""The header of a GGUF file (llama.cpp's format): metadata and tensor table over a memory map.

Parsed here rather than with `gguf.GGUFReader`: that reader decodes every entry of the
vocabulary arrays into numpy views up front (2 s for SmolLM2, 7 s for a 150k vocabulary), while
a load with a warm tokenizer cache needs none of them. The loader (`gguf_loader`) and the
tokenizer builder (`gguf_tokenizer`) both read it.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from turbospark.engine.checkpoint import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType), as struct formats.
_SCALAR_FORMATS: dict[int, struct.Struct] = {
    0: struct.Struct("<B"),
    1: struct.Struct("<b"),
    2: struct.Struct("<H"),
    3: struct.Struct("<h"),
    4: struct.Struct("<I"),
    5: struct.Struct("<i"),
    6: struct.Struct("<f"),
    7: struct.Struct("<?"),
    10: struct.Struct("<Q"),
    11: struct.Struct("<q"),
    12: struct.Struct("<d"),
}
_NUMPY_DTYPES: dict[int, str] = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_TYPE_STRING = 8
_TYPE_ARRAY = 9
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class StringArray:
    """A GGUF array of strings, decoded only when asked for (vocabularies are 50k-150k long)."""

    def __init__(self, buf: mmap.mmap, offset: int, count: int) -> None:
        self._buf = buf
        self._offset = offset
        self.count = count

    def __len__(self) -> int:
        return self.count

    def read(self) -> list[str]:
        buf, pos, out = self._buf, self._offset, []
        unpack = _U64.unpack_from
        for _ in range(self.count):
            (n,) = unpack(buf, pos)
            pos += 8
            out.append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        return out


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the fastest-moving (row length)
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch (row-major) shape."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type id {self.ggml_type}"


class GGUFFile:
    """The header of a GGUF file (metadata and tensor table) over a private memory map.

    The map is copy-on-write (ACCESS_COPY), so tensors viewed on it are writable without ever
    touching the file, and untouched pages are shared with the page cache.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self.file_size = os.fstat(f.fileno()).st_size
                if self.file_size < 24:
                    raise ModelLoadError(f"{path}: not a GGUF file (only {self.file_size} bytes)")
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read: {e.strerror or e}") from e
        if self._buf[:4] != GGUF_MAGIC:
            raise ModelLoadError(f"{path}: not a GGUF file (magic {bytes(self._buf[:4])!r}, want b'GGUF')")
        try:
            self._parse()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: truncated or corrupt GGUF header ({e})") from e

    def _parse(self) -> None:
        buf = self._buf
        (version,) = _U32.unpack_from(buf, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: unsupported GGUF version {version} (or a big-endian file)")
        (num_tensors,) = _U64.unpack_from(buf, 8)
        (num_fields,) = _U64.unpack_from(buf, 16)
        # A truncated or garbage header shows up as absurd counts; fail before looping on them.
        if num_tensors > self.file_size or num_fields > self.file_size:
            raise ModelLoadError(f"{self.path}: corrupt GGUF header (counts {num_tensors}, {num_fields})")
        pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(num_fields):
            key, pos = self._read_string(pos)
            (value_type,) = _U32.unpack_from(buf, pos)
            self.metadata[key], pos = self._read_value(value_type, pos + 4)
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(num_tensors):
            name, pos = self._read_string(pos)
            (num_dims,) = _U32.unpack_from(buf, pos)
            if num_dims > 8:
                raise ModelLoadError(f"{self.path}: corrupt tensor table ({name!r} has {num_dims} dims)")
            dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
            pos += 4 + 8 * num_dims
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, tuple(dims), ggml_type, offset))
        data_start = -(-pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            if ggml_type not in QUANT_SIZES:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown ggml type id {ggml_type}")
            block_size, type_size = QUANT_SIZES[ggml_type]
            num_elements = math.prod(dims)
            if dims and dims[0] % block_size:
                raise ModelLoadError(f"{self.path}: tensor {name!r} rows of {dims[0]} are not whole blocks")
            info = TensorInfo(
                name, dims, ggml_type, data_start + offset, num_elements // block_size * type_size
            )
            if info.offset + info.nbytes > self.file_size:
                raise ModelLoadError(
                    f"{self.path}: truncated: tensor {name!r} needs bytes up to {info.offset + info.nbytes} "
                    f"but the file has {self.file_size}"
                )
            self.tensors[name] = info

    def _read_string(self, pos: int) -> tuple[str, int]:
        (n,) = _U64.unpack_from(self._buf, pos)
        if pos + 8 + n > self.file_size:
            raise ModelLoadError(
                f"{self.path}: truncated GGUF header (string at byte {pos} runs past the end)"
            )
        return self._buf[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n

    def _read_value(self, value_type: int, pos: int) -> tuple[Any, int]:
        buf = self._buf
        if value_type == _TYPE_STRING:
            return self._read_string(pos)
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is not None:
            return fmt.unpack_from(buf, pos)[0], pos + fmt.size
        if value_type != _TYPE_ARRAY:
            raise ModelLoadError(f"{self.path}: unknown GGUF metadata value type {value_type}")
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type == _TYPE_STRING:
            start = pos
            unpack = _U64.unpack_from
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
            if pos > self.file_size:
                raise ModelLoadError(f"{self.path}: truncated GGUF header (array runs past the end)")
            return StringArray(buf, start, count), pos
        dtype = _NUMPY_DTYPES.get(item_type)
        if dtype is not None:
            array = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy()
            return array, pos + array.nbytes
        items = []
        for _ in range(count):
            item, pos = self._read_value(item_type, pos)
            items.append(item)
        return items, pos

    def raw(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor viewing the map (no copy)."""
        if info.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._buf, dtype=torch.uint8, count=info.nbytes, offset=info.offset)

    def strings(self, key: str) -> list[str] | None:
        value = self.metadata.get(key)
        if value is None:
            return None
        if isinstance(value, StringArray):
            return value.read()
        raise ModelLoadError(f"{self.path}: metadata {key!r} is not an array of strings")


QUANT_SIZES: dict[int, tuple[int, int]] = {int(k): v for k, v in GGML_QUANT_SIZES.items()}
