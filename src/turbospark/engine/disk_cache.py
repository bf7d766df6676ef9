"""The prefix cache on disk: full KV blocks kept across server restarts.

A restarted server finds the blocks of a prompt it computed before on disk and reads them
instead of prefilling them: Claude Code's ~18,800-token first request is minutes of prefill on
a CPU and a read of ~230 MB here (Qwen2.5-0.5B, float16 KV).

A block is a file named by its chain key (`BlockManager.chain_key`: a stable digest of the
previous block's key and this block's token ids, so one name stands for a whole prefix, the
cache salt included). The files live in one folder per model fingerprint (`fingerprint`: the
weights file's identity, the KV layout and dtype, the device kind, torch's and turbospark's
versions), so KV written by other weights, kernels or layouts is never read. A file holds the
block's keys, then its values, for every layer, raw, in the cache's dtype. One of the wrong size
or unreadable is a miss and is deleted. Writes go to a temporary name and are renamed into
place, so no reader sees half a block. The folder is bounded (`max_bytes`): the least recently
used files go first (a hit touches its file's mtime).

Only blocks the engine registers in the prefix cache are written (prompt and generated alike,
as in memory), once each, on the engine thread after the step that filled them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("turbospark.engine")

SUFFIX = ".kv"


def fingerprint(source: str, k: torch.Tensor, block_size: int, extra: tuple[str, ...] = ()) -> str:
    """A name for "KV computed by these weights, this way": files under another fingerprint are
    never read. The weights are named by path, size and modification time (hashing gigabytes
    at every start would cost more than it guards); `extra`: more weight files (a GGUF model's
    mmproj, whose tower computes the image tokens' inputs)."""
    import turbospark

    path = Path(source)
    files = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf")) if path.is_dir() else [path]
    files += [Path(f) for f in extra]
    stats = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        stats.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    facts = {
        "weights": stats or source,
        "kv": [list(k.shape[:2]), block_size, k.shape[3], str(k.dtype)],
        "device": k.device.type,
        "torch": torch.__version__,
        "turbospark": getattr(turbospark, "__version__", ""),
    }
    return hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=12).hexdigest()


class DiskBlockStore:
    """Full KV blocks on disk, by chain key (see the module docstring)."""

    def __init__(
        self, folder: Path, k: torch.Tensor, v: torch.Tensor, block_size: int, max_bytes: int
    ) -> None:
        """`k`, `v`: the cache's (num_layers, num_kv_heads, num_slots, head_dim) tensors."""
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.k, self.v = k, v
        self.block_size = block_size
        layers, heads, _, head_dim = k.shape
        self.block_shape = (layers, heads, block_size, head_dim)
        self.block_bytes = 2 * layers * heads * block_size * head_dim * k.element_size()
        self.max_bytes = max_bytes
        self._known: set[int] = set()
        for f in folder.glob("*" + SUFFIX):
            try:
                self._known.add(int(f.stem, 16))
            except ValueError:
                continue
        self.num_loaded = 0  # blocks read back (lifetime)
        self.num_saved = 0  # blocks written (lifetime)
        self._failed = False

    def __contains__(self, key: int) -> bool:
        return key in self._known

    def __len__(self) -> int:
        return len(self._known)

    def _path(self, key: int) -> Path:
        return self.folder / f"{key:016x}{SUFFIX}"

    def _slots(self, block: int) -> slice:
        bs = self.block_size
        return slice(block * bs, (block + 1) * bs)

    def save(self, key: int, block: int) -> None:
        """Writes block `block` of the cache under `key`, unless a file has it already."""
        if key in self._known or self._failed:
            return
        slots = self._slots(block)
        k = self.k[:, :, slots, :].contiguous()
        v = self.v[:, :, slots, :].contiguous()
        data = torch.stack((k, v)).cpu().view(torch.uint8).numpy().tobytes()
        path = self._path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:  # a full or read-only disk: the in-memory cache goes on alone
            log.warning("the disk prefix cache in %s stops writing: %s", self.folder, exc)
            self._failed = True
            tmp.unlink(missing_ok=True)
            return
        self._known.add(key)
        self.num_saved += 1
        if len(self._known) * self.block_bytes > self.max_bytes:
            self._trim()

    def load(self, key: int, block: int) -> bool:
        """Reads the block saved under `key` into block `block` of the cache; False (and the file
        is gone) when it cannot be read whole."""
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except OSError:
            self._known.discard(key)
            return False
        if len(raw) != self.block_bytes:
            self._forget(key)
            return False
        both = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.k.dtype)
        both = both.view(2, *self.block_shape)
        slots = self._slots(block)
        self.k[:, :, slots, :].copy_(both[0])
        self.v[:, :, slots, :].copy_(both[1])
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: trimmed last
        self.num_loaded += 1
        return True

    def _forget(self, key: int) -> None:
        self._known.discard(key)
        self._path(key).unlink(missing_ok=True)

    def _trim(self) -> None:
        """Deletes the least recently used files until the folder is at 90% of its bound."""
        dated: list[tuple[int, int]] = []
        for key in self._known:
            try:
                dated.append((self._path(key).stat().st_mtime_ns, key))
            except OSError:
                dated.append((0, key))
        dated.sort()
        keep = int(0.9 * self.max_bytes) // self.block_bytes
        for _, key in dated[: max(0, len(dated) - keep)]:
            self._forget(key)
