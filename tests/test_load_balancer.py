"""Replicas behind a load balancer: the shipped `docs/haproxy.cfg` in front of two turbospark
replicas on loopback pins each conversation key to one replica and spreads different keys.

Each replica is `turbospark serve --model scripted:FILE` whose one reply names it, so an answer
says which replica served it. Skipped, with the reason, where `haproxy` is not installed (CI
installs it from the distribution's packages and sets TURBOSPARK_REQUIRE_HAPROXY to fail
instead).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from turbospark.testing import ServerProcess, free_port

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parent.parent / "docs" / "haproxy.cfg"
REPLICAS = ("replica1", "replica2")


def haproxy_binary() -> str | None:
    found = shutil.which("haproxy")
    if found is None and os.access("/usr/sbin/haproxy", os.X_OK):  # not on a non-root user's PATH
        found = "/usr/sbin/haproxy"
    return found


@pytest.fixture(scope="module")
def balancer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[ServerProcess]]]:
    binary = haproxy_binary()
    if binary is None:
        if os.environ.get("TURBOSPARK_REQUIRE_HAPROXY"):
            pytest.fail("TURBOSPARK_REQUIRE_HAPROXY is set but haproxy is not installed")
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    root = tmp_path_factory.mktemp("balancer")
    with ExitStack() as stack:
        replicas = []
        for name in REPLICAS:
            script = root / f"{name}.txt"
            script.write_text(f"answered by {name}", encoding="utf-8")
            replicas.append(stack.enter_context(ServerProcess("--model", f"scripted:{script}")))
        port = free_port()
        config = CONFIG.read_text(encoding="utf-8")
        for shipped, actual in (
            ("bind 127.0.0.1:8080", f"bind 127.0.0.1:{port}"),
            ("replica1 127.0.0.1:8001", f"replica1 127.0.0.1:{replicas[0].port}"),
            ("replica2 127.0.0.1:8002", f"replica2 127.0.0.1:{replicas[1].port}"),
        ):
            assert config.count(shipped) == 1, shipped
            config = config.replace(shipped, actual)
        (root / "haproxy.cfg").write_text(config, encoding="utf-8")
        log = stack.enter_context(tempfile.TemporaryFile())
        proxy = subprocess.Popen([binary, "-db", "-f", str(root / "haproxy.cfg")], stdout=log, stderr=log)
        stack.callback(proxy.wait, 10)
        stack.callback(proxy.terminate)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            if proxy.poll() is not None:
                log.seek(0)
                pytest.fail(f"haproxy exited with {proxy.returncode}: {log.read().decode(errors='replace')}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, "haproxy never answered /health"
            time.sleep(0.1)
        yield url, replicas


def served_by(url: str, *, conversation: str | None = None, api_key: str = "unused") -> str:
    headers = {"X-Conversation-Id": conversation} if conversation else {}
    with openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0) as client:
        reply = client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hi"}], extra_headers=headers
        )
    text = reply.choices[0].message.content or ""
    assert text.startswith("answered by "), text
    return text.removeprefix("answered by ")


def test_one_conversation_stays_on_one_replica_and_keys_spread(balancer) -> None:
    url, _ = balancer
    for key in ("conversation-a", "conversation-b", "conversation-c"):
        assert len({served_by(url, conversation=key) for _ in range(4)}) == 1, key
    placed = {key: served_by(url, conversation=key) for key in (f"conversation-{i}" for i in range(16))}
    assert set(placed.values()) == set(REPLICAS), placed
    # the same keys again, interleaved: each lands where it did
    assert {key: served_by(url, conversation=key) for key in reversed(placed)} == placed


def test_without_a_conversation_id_the_api_key_is_the_key(balancer) -> None:
    url, _ = balancer
    placed = {key: served_by(url, api_key=key) for key in (f"sk-user-{i}" for i in range(12))}
    assert set(placed.values()) == set(REPLICAS), placed
    assert {key: served_by(url, api_key=key) for key in placed} == placed


def test_a_replica_that_goes_away_hands_its_keys_to_the_other(balancer) -> None:
    """Runs last: it stops replica2."""
    url, replicas = balancer
    keys = [f"conversation-{i}" for i in range(16)]
    before = {key: served_by(url, conversation=key) for key in keys}
    replicas[1].terminate()
    after = {key: served_by(url, conversation=key) for key in keys}
    assert set(after.values()) == {"replica1"}, after
    # consistent hashing: keys that were on replica1 did not move
    assert all(after[k] == "replica1" for k, where in before.items() if where == "replica1")
