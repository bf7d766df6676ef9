"""Teacher-forced accuracy of the CPU paths against the float32 model, same weights, same text.

For each model: the float32 model reads `--tokens` tokens of a text (ARCHITECTURE.md by default)
one token per step, and its next-token distribution at every position is the reference. The
model as the server builds it (`--quant auto`, the CPU profile's activation dtype) reads the same
tokens the same way: the decode path, where with the native kernels on every matmul, norm and
attention is theirs. Reported: top-1 agreement with float32 and the mean KL(float32 || path) in
nats. `TURBOSPARK_NATIVE_KERNELS=0` gives torch's kernels' numbers for comparison,
`--kv-cache-dtype float32` the server's float16 cache's share of the difference.

    python benchmarks/accuracy_cpu.py --models smollm2,qwen2.5-coder:0.5b --tokens 512
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from turbospark.engine.backend import resolve_kv_dtype
from turbospark.engine.cpu_kernels import cpu_kernels
from turbospark.engine.loader import load_checkpoint
from turbospark.engine.models import build_model
from turbospark.engine.quant import auto_quant
from turbospark.engine.runner import ModelRunner, SequenceState


def logits_of(model: torch.nn.Module, ids: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(len(ids), vocab) float32 next-token logits, one token per step."""
    runner = ModelRunner(model, max_context=len(ids) + 8, kv_dtype=kv_dtype)
    seq = SequenceState()
    return torch.stack([runner.forward([(seq, [t])])[0].float() for t in ids])


def compare(reference: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    top1 = float((reference.argmax(-1) == got.argmax(-1)).float().mean())
    ref_lp, got_lp = reference.log_softmax(-1), got.log_softmax(-1)
    kl = float((ref_lp.exp() * (ref_lp - got_lp)).sum(-1).mean())
    return top1, kl


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,qwen2.5-coder:0.5b")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "ARCHITECTURE.md"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto", help="as `turbospark serve --kv-cache-dtype`")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_kernels().describe())
    text = Path(args.text).read_text()
    for spec in args.models.split(","):
        ckpt = load_checkpoint(spec, progress=False)
        ids = ckpt.tokenizer.encode(text).ids[: args.tokens]
        reference = logits_of(build_model(ckpt.config, dict(ckpt.tensors), "cpu", torch.float32), ids)
        quant = auto_quant(ckpt.tensors)
        model = build_model(
            ckpt.config, dict(ckpt.tensors), "cpu", cpu_kernels().activation_dtype, quant=quant
        )
        dtype = cpu_kernels().activation_dtype
        kv_dtype = resolve_kv_dtype("cpu", dtype, args.kv_cache_dtype)
        top1, kl = compare(reference, logits_of(model, ids, kv_dtype))
        print(
            f"{spec} {quant}, KV {kv_dtype}, {len(ids)} tokens: "
            f"top-1 agreement with float32 {top1:.1%}, KL {kl:.4f} nats"
        )


if __name__ == "__main__":
    main()
