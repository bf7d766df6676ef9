"""What every checkpoint loader returns and raises, and where turbospark caches files.

The loaders (`loader`, `gguf_loader`, `hf_loader`, `gguf_tokenizer`, `pull`) import these from
here, so none of them imports another just for its types: `loader` picks a loader and imports
it; nothing imports `loader` back.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turbospark.backend import SamplingDefaults

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
    # the sampler settings the checkpoint recommends (generation_config.json, GGUF general.sampling.*)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    # a vision model's image processor settings (preprocessor_config.json style) when they come
    # from elsewhere than the folder's preprocessor_config.json (a GGUF mmproj's metadata)
    preprocessor: dict[str, Any] | None = None
    mmproj: str | None = None  # the llama.cpp mmproj file the vision tower was read from


log = logging.getLogger("turbospark.engine")

# Each sampler setting: (lowest, highest, lowest allowed exclusively) a checkpoint may recommend.
_SAMPLING_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 100.0, False),
    "top_p": (0.0, 1.0, True),
    "top_k": (0.0, 1e9, False),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, 10.0, True),
}


def sampling_from(values: Mapping[str, Any], names: Mapping[str, str], source: str) -> SamplingDefaults:
    """The sampler settings a checkpoint's metadata recommends. `names` maps each of
    `SamplingDefaults`' fields to the key `values` holds it under. A value that is missing or
    null is left unset; one that is not a number in range is left unset too, with a warning (a
    stray generation_config.json value must not stop a model from loading)."""
    found: dict[str, float | int] = {}
    for name, key in names.items():
        value = values.get(key)
        if value is None:
            continue
        low, high, exclusive = _SAMPLING_RANGES[name]
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
        in_range = low < number <= high if exclusive else low <= number <= high
        if name == "top_k":
            in_range = in_range and number.is_integer()
        if not in_range:
            log.warning("%s: ignoring %s = %r (not a valid %s)", source, key, value, name)
            continue
        # GGUF stores float32: 0.95 reads back as 0.949999988; seven digits give the written value
        found[name] = int(number) if name == "top_k" else float(f"{number:.7g}")
    if not found:
        return SamplingDefaults()
    top_k = found.get("top_k")
    return SamplingDefaults(
        temperature=found.get("temperature"),
        top_p=found.get("top_p"),
        top_k=None if top_k is None else int(top_k),
        min_p=found.get("min_p"),
        repetition_penalty=found.get("repetition_penalty"),
        source=source,
    )


def cache_dir() -> Path:
    """turbospark's cache root: $TURBOSPARK_CACHE, else $XDG_CACHE_HOME/turbospark or ~/.cache/turbospark.

    Holds converted GGUF tokenizers (`tokenizers/`) and pulled model files (`models/`).
    """
    if os.environ.get("TURBOSPARK_CACHE"):
        return Path(os.environ["TURBOSPARK_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "turbospark"
