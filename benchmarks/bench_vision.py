"""Image encode time and time to first token for one 512x512 picture on a random-weight model of
SmolVLM-256M-Instruct's configuration (SigLIP 12x768 on 512-pixel tiles, scale factor 4: 64
tokens a tile; a 30-layer 576-wide Llama text model), served by turbospark's engine.

    python -m benchmarks.bench_vision                 # CPU (int8 text model, float vision tower)
    python -m benchmarks.bench_vision --device cuda   # GPU (bf16)

The folder is written once (`--folder`, default a temporary one) by transformers' own
`save_pretrained` from the real config with random weights (seed 0), with SmolVLM's chat template,
its special tokens over the packaged SmolLM2 tokenizer and SmolVLM-256M's preprocessor config
(longest edge 2048, 512-pixel tiles): a 512x512 picture becomes 4x4 tiles and the global image,
17 frames, 1,088 image tokens. No weights are fetched.

Each run sends a fresh picture (so the prefix cache does not hit): `encode` is preprocessing
(decode, resize, tiles) plus the vision tower and connector over the 17 frames, timed alone;
`ttft` is `run_completion` with one new token: preprocessing, the encode on the engine thread
and the whole prefill. Medians over `--runs`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from turbospark.backend import GenerationConfig, RequestImage

TEXT_CONFIG = {
    "model_type": "llama",
    "vocab_size": 49280,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
VISION_CONFIG = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 512,
    "patch_size": 16,
    "layer_norm_eps": 1e-6,
}
PREPROCESSOR = {
    "do_resize": True,
    "size": {"longest_edge": 2048},
    "max_image_size": {"longest_edge": 512},
    "do_image_splitting": True,
    "resample": 1,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def write_folder(folder: Path) -> None:
    """A random-weight SmolVLM-256M-class folder (see the module docstring)."""
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.engine import tiny_vlm  # the tokenizer and chat template the tests use

    folder.mkdir(parents=True, exist_ok=True)
    tok = tiny_vlm.tokenizer()
    assert tok.get_vocab_size() <= TEXT_CONFIG["vocab_size"]
    config = transformers.Idefics3Config(
        text_config=TEXT_CONFIG,
        vision_config=VISION_CONFIG,
        scale_factor=4,
        image_token_id=tok.token_to_id("<image>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Idefics3ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    eou = tok.token_to_id("<end_of_utterance>")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<end_of_utterance>", "chat_template": tiny_vlm.SMOLVLM_CHAT_TEMPLATE})
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eou]}))
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--folder", type=Path, help="where the random folder is (written if missing)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="runs first, not counted")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.engine import tiny_vlm

    from turbospark.chat_template import render_chat_template
    from turbospark.engine.backend import load_backend
    from turbospark.engine.vision import decode_image

    folder = args.folder or Path(tempfile.mkdtemp(prefix="smolvlm-256m-random-"))
    if not (folder / "config.json").is_file():
        started = time.perf_counter()
        write_folder(folder)
        print(f"wrote {folder} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    backend = load_backend(str(folder), device=args.device, progress=False, kv_cache_gb=1.0)
    spec = backend._vision
    assert spec is not None
    model = backend.runner.model
    prompt = render_chat_template(
        backend.tokenizer.chat_template or "",
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the picture."}]}],
        add_generation_prompt=True,
    )
    ids = backend.tokenizer.encode(prompt)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    encode_s, ttft_s, tokens = [], [], 0
    for run in range(args.runs + args.warmup):
        picture = tiny_vlm.png(512, 512, seed=100 + run)
        started = time.perf_counter()
        processed = spec.processor.process(decode_image(picture))
        embeds = model.encode_images(processed.pixel_values.to(backend.runner.device))  # type: ignore[attr-defined]
        sync()
        encoded = time.perf_counter() - started
        del embeds
        started = time.perf_counter()
        result = backend.run_completion(
            ids,
            GenerationConfig(max_new_tokens=1, temperature=0.0),
            [RequestImage(picture, "image/png")],
            threading.Event(),
            lambda _: None,
        )
        ttft = time.perf_counter() - started
        tokens = result.num_prompt_tokens
        if run >= args.warmup:
            encode_s.append(encoded)
            ttft_s.append(ttft)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"SmolVLM-256M-class random, {device}, {backend.details().quantization} text model: one 512x512 "
        f"image ({processed.pixel_values.shape[0]} frames, {tokens}-token prompt): encode "
        f"{statistics.median(encode_s) * 1000:.0f} ms, TTFT {statistics.median(ttft_s) * 1000:.0f} ms "
        f"(median of {args.runs}; encode {', '.join(f'{s * 1000:.0f}' for s in encode_s)} ms; "
        f"TTFT {', '.join(f'{s * 1000:.0f}' for s in ttft_s)} ms)"
    )


if __name__ == "__main__":
    main()
