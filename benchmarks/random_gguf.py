"""A GGUF of random weights shaped and typed like a real one, for machines the real file cannot
reach (a lent machine takes a few MB, not the 100-500 MB of a model).

    python benchmarks/random_gguf.py skeleton MODEL.gguf skel.json.gz   # where the model is
    python benchmarks/random_gguf.py build skel.json.gz random.gguf     # where it is needed

`skeleton` keeps every metadata field (the tokenizer and chat template included) and each
tensor's name, shape and quantization type, and no weights. `build` writes a GGUF with the same
metadata and tensors of random bytes in the same types, with each block's float16 scales set to
small finite values, so every engine that reads the real file reads this one, at the same speed
(speed does not depend on the weights' values), and decodes text of no meaning.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

# byte offsets of the float16 scale fields inside one block, per type (ggml-common.h); the rest of
# a block (codes, packed sub-block scales) is valid whatever its bytes
_SCALE_OFFSETS = {
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q2_K: (80, 82),
    GGMLQuantizationType.Q3_K: (108,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}
# a scale of this size gives weights of about the size trained ones have (~0.01-0.05)
_SCALE = 0.002
# the tensors that must stay near 1 (RMSNorm weights): random ones would scale activations freely
_NORMS = ("norm.weight",)


def _value(field: Any) -> Any:
    return field.contents()


def skeleton(src: Path, out: Path) -> None:
    reader = GGUFReader(src)
    fields = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # the header: the writer makes its own
        types = [t.name for t in field.types]
        fields.append({"name": name, "types": types, "value": _value(field)})
    tensors = [
        {"name": t.name, "shape": [int(n) for n in t.shape], "type": t.tensor_type.name}
        for t in reader.tensors
    ]
    with gzip.open(out, "wt", encoding="utf-8") as fh:
        json.dump({"fields": fields, "tensors": tensors}, fh)


def _random_tensor(rng: np.random.Generator, name: str, shape: list[int], qtype: GGMLQuantizationType) -> Any:
    # `shape` is GGUF's order (the fastest-moving dimension first)
    numel = int(np.prod(shape))
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        dtype = np.float32 if qtype is GGMLQuantizationType.F32 else np.float16
        if name.endswith(_NORMS):
            data = np.ones(numel, dtype=np.float32)
        else:
            data = rng.normal(0.0, 0.02, numel).astype(np.float32)
        return data.astype(dtype).reshape(list(reversed(shape)))
    if qtype not in _SCALE_OFFSETS:
        raise SystemExit(f"{name}: no random filler for {qtype.name} yet (add its scale offsets)")
    block, size = GGML_QUANT_SIZES[qtype]
    rows = numel // shape[0]
    blocks = rows * (shape[0] // block)
    raw = rng.integers(0, 256, blocks * size, dtype=np.uint8).reshape(blocks, size)
    scale = np.frombuffer(np.float16(_SCALE).tobytes(), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[qtype]:
        raw[:, offset : offset + 2] = scale
    return raw.reshape(rows, (shape[0] // block) * size)


def build(skel: Path, out: Path, seed: int) -> None:
    with gzip.open(skel, "rt", encoding="utf-8") as fh:
        spec = json.load(fh)
    arch = next(f["value"] for f in spec["fields"] if f["name"] == "general.architecture")
    writer = GGUFWriter(out, arch)
    for field in spec["fields"]:
        if field["name"] == "general.architecture":
            continue  # the writer adds it
        types = [GGUFValueType[t] for t in field["types"]]
        sub = types[1] if types[0] is GGUFValueType.ARRAY else None
        writer.add_key_value(field["name"], field["value"], types[0], sub_type=sub)
    rng = np.random.default_rng(seed)
    for t in spec["tensors"]:
        qtype = GGMLQuantizationType[t["type"]]
        data = _random_tensor(rng, t["name"], t["shape"], qtype)
        raw_dtype = None if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else qtype
        writer.add_tensor(t["name"], data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("skeleton", help="a real GGUF's metadata and tensor list, without weights")
    s.add_argument("gguf", type=Path)
    s.add_argument("out", type=Path)
    b = sub.add_parser("build", help="a random-weight GGUF from a skeleton")
    b.add_argument("skeleton", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "skeleton":
        skeleton(args.gguf, args.out)
    else:
        build(args.skeleton, args.out, args.seed)


if __name__ == "__main__":
    main()
