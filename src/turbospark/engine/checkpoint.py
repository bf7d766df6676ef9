"""What every checkpoint loader returns and raises, and where turbospark caches files.

The loaders (`loader`, `gguf_loader`, `hf_loader`, `gguf_tokenizer`, `pull`) import these from
here, so none of them imports another just for its types: `loader` picks a loader and imports
it; nothing imports `loader` back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers
    import torch


class ModelLoadError(Exception):
    """A checkpoint could not be loaded; the message names the file and what is wrong."""


class ModelNotFound(ModelLoadError):
    """Nothing matches the model spec."""


@dataclass
class LoadedCheckpoint:
    name: str  # a display id, e.g. "SmolLM2-135M-Instruct" or "qwen2.5-coder:0.5b"
    source: str  # the file or folder it was read from
    config: dict[str, Any]  # Hugging Face config.json style
    tensors: Mapping[str, torch.Tensor]  # Hugging Face weight names -> float tensors
    tokenizer: tokenizers.Tokenizer
    tokenizer_config: dict[str, Any]  # tokenizer_config.json style, plus "eos_token_ids"


def cache_dir() -> Path:
    """turbospark's cache root: $TURBOSPARK_CACHE, else $XDG_CACHE_HOME/turbospark or ~/.cache/turbospark.

    Holds converted GGUF tokenizers (`tokenizers/`) and pulled model files (`models/`).
    """
    if os.environ.get("TURBOSPARK_CACHE"):
        return Path(os.environ["TURBOSPARK_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "turbospark"
