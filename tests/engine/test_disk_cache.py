"""The prefix cache on disk (`engine/disk_cache.py`): blocks a server computed are read back by
the next one, bit for bit, under the same salt only; a damaged file is a miss, not an error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_backend import greedy, word_tokenizer
from tiny_models import FAMILIES, checkpoint

from turbospark.backend import NEVER_CANCEL
from turbospark.engine.backend import RealChatModel, attach_disk_cache
from turbospark.engine.disk_cache import SUFFIX, DiskBlockStore
from turbospark.engine.kv_cache import BlockManager, KVCache
from turbospark.engine.models import build_model

BLOCK = 4


def _cache(seed: int) -> KVCache:
    kv = KVCache(
        num_layers=2, num_blocks=8, block_size=BLOCK, num_kv_heads=2, head_dim=8, dtype=torch.float16
    )
    gen = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    return kv


def _manager(kv: KVCache, folder: Path, max_bytes: int = 1 << 20) -> tuple[BlockManager, DiskBlockStore]:
    blocks = BlockManager(kv.num_blocks, BLOCK)
    store = DiskBlockStore(folder, kv.k, kv.v, BLOCK, max_bytes)
    blocks.store = store
    return blocks, store


def test_blocks_come_back_bit_for_bit_in_a_new_cache(tmp_path: Path) -> None:
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    first = _cache(seed=1)
    blocks, store = _manager(first, tmp_path)
    table = blocks.allocate(4)
    key = BlockManager.root_key(None)
    blocks.register_full_blocks(tokens, table, len(tokens), 0, key)
    assert store.num_saved == 3 and len(list(tmp_path.glob("*" + SUFFIX))) == 3

    second = _cache(seed=2)  # another process: other contents, empty bookkeeping
    again, store2 = _manager(second, tmp_path)
    hits, key = again.match_prefix(tokens)
    assert hits == []
    keys = again.stored_continuation(tokens, 0, key)
    assert len(keys) == 3
    fresh = again.allocate(3)
    assert again.load_stored(keys, fresh) == 3 and store2.num_loaded == 3
    for src, dst in zip(table[:3], fresh, strict=True):
        s, d = slice(src * BLOCK, (src + 1) * BLOCK), slice(dst * BLOCK, (dst + 1) * BLOCK)
        assert torch.equal(first.k[:, :, s], second.k[:, :, d])
        assert torch.equal(first.v[:, :, s], second.v[:, :, d])
    loaded = list(fresh)
    again.release(fresh)
    assert again.match_prefix(tokens)[0] == loaded  # registered: the next sequence shares them
    again.check()

    # another salt (another tenant) finds nothing; a shorter prompt leaves its last token
    assert again.stored_continuation(tokens, 0, BlockManager.root_key("tenant-b")) == []
    assert len(again.stored_continuation(tokens[:12], 0, None)) == 2


def test_a_damaged_file_is_a_miss_and_goes(tmp_path: Path) -> None:
    tokens = list(range(9))
    blocks, _ = _manager(_cache(seed=1), tmp_path)
    blocks.register_full_blocks(tokens, blocks.allocate(3), 9, 0, None)
    first, _second = sorted(tmp_path.glob("*" + SUFFIX))
    first.write_bytes(first.read_bytes()[:10])  # cut short
    again, store = _manager(_cache(seed=2), tmp_path)
    keys = again.stored_continuation(tokens, 0, None)
    fresh = again.allocate(len(keys))
    loaded = again.load_stored(keys, fresh)
    assert loaded < len(keys) and len(store) == 1
    assert not any(p.stat().st_size == 10 for p in tmp_path.glob("*" + SUFFIX))


def test_the_folder_is_trimmed_least_recently_used_first(tmp_path: Path) -> None:
    kv = _cache(seed=1)
    one_block = 2 * 2 * 2 * BLOCK * 8 * 2  # k and v, 2 layers, 2 heads, 4 slots, 8 dims, fp16
    blocks, store = _manager(kv, tmp_path, max_bytes=4 * one_block)
    for start in range(0, 6 * 100, 100):  # six unrelated one-block prompts
        tokens = list(range(start, start + BLOCK + 1))
        table = blocks.allocate(2)
        blocks.register_full_blocks(tokens, table, BLOCK + 1, 0, None)
        blocks.release(table)
    assert store.num_saved == 6
    assert len(store) <= 4 and len(list(tmp_path.glob("*" + SUFFIX))) == len(store)
    newest = BlockManager.chain_key(None, tuple(range(500, 500 + BLOCK)))
    assert newest in store


def _tiny(folder_env: Path) -> RealChatModel:
    cfg, tensors, _ = checkpoint(FAMILIES["llama"], seed=0, init_std=1.0)
    model = RealChatModel("tiny-llama", build_model(cfg, tensors), word_tokenizer(), max_context=512)
    attach_disk_cache(model, str(folder_env / "weights.safetensors"), size_gb=0.1)
    return model


def test_a_restarted_backend_reads_the_prompt_instead_of_computing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path / "cache"))
    (tmp_path / "weights.safetensors").write_bytes(b"stand-in")  # the fingerprint's file
    tok = word_tokenizer()
    prompt = tok.encode(" ".join(f"w{i % 300}" for i in range(200)))
    cold = _tiny(tmp_path)
    first = cold.run_completion(prompt, greedy(8), None, NEVER_CANCEL, lambda e: None)
    assert first.num_cached_tokens == 0
    cold.close()

    warm = _tiny(tmp_path)  # a new backend: its memory cache is empty
    second = warm.run_completion(prompt, greedy(8), None, NEVER_CANCEL, lambda e: None)
    assert second.num_cached_tokens == (len(prompt) - 1) // 16 * 16  # all but the last block
    assert second.num_cached_tokens >= 0.9 * len(prompt)
    assert second.token_ids == first.token_ids  # float32: the read KV is the computed KV
    warm.close()


@pytest.mark.slow
def test_a_restarted_server_answers_from_the_disk_cache(tmp_path: Path) -> None:
    """`serve --prefix-cache-dir DIR`: the second server's first request finds the first one's
    prompt on disk (the OpenAI usage counts it as cached tokens)."""
    import openai

    from turbospark.testing import ServerProcess

    question = "Summarize this list of words in one line: " + ", ".join(f"item {i}" for i in range(120))
    env = {"TURBOSPARK_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    usages = []
    for _ in range(2):
        folder = str(tmp_path / "prefix")
        with ServerProcess("--model", "smollm2", "--prefix-cache-dir", folder, env=env) as server:
            server.wait_healthy(timeout=300)
            with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
                reply = client.chat.completions.create(
                    model="smollm2",
                    messages=[{"role": "user", "content": question}],
                    max_tokens=4,
                    temperature=0,
                )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            usages.append((reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens))
    (prompt, cold), (prompt_again, warm) = usages
    assert prompt == prompt_again > 300
    assert cold == 0
    assert warm >= 0.9 * prompt, usages
    assert list((tmp_path / "prefix").glob("*/*" + SUFFIX))
