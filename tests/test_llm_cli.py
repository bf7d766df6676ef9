"""Simon Willison's `llm` CLI (PyPI `llm`), headless, against a loopback server: a model declared
in `extra-openai-models.yaml` with `api_base` pointing at turbospark, as its documentation
tells users of local OpenAI-compatible servers to do. Plugins are not loaded
(`LLM_LOAD_PLUGINS=""`) and the user folder is a throwaway one, so nothing outside the test is
read or written, and nothing is logged to its database (`--no-log`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

API_KEY = "turbospark-test-key"


def run_llm(server: LiveServer, home: Path, *args: str) -> str:
    home.mkdir(exist_ok=True)
    (home / "extra-openai-models.yaml").write_text(
        f"""- model_id: turbospark
  model_name: local
  api_base: "{server.url}/v1"
  api_key_name: turbospark
""",
        encoding="utf-8",
    )
    (home / "keys.json").write_text(f'{{"turbospark": "{API_KEY}"}}', encoding="utf-8")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LLM_USER_PATH": str(home)}
    env["LLM_LOAD_PLUGINS"] = ""
    done = subprocess.run(
        [sys.executable, "-m", "llm", "-m", "turbospark", "--no-log", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_llm_cli_completes_a_turn(tmp_path: Path) -> None:
    backend = ScriptedChatModel(["Hello from turbospark.", "Hi again."], model_id="local")
    with LiveServer([backend], api_keys=[API_KEY]) as server:
        streamed = run_llm(server, tmp_path / "home", "say hi", "-s", "Be brief.")
        whole = run_llm(server, tmp_path / "home", "say hi again", "--no-stream")
    assert streamed.strip() == "Hello from turbospark."
    assert whole.strip() == "Hi again."
    first = backend.tokenizer.decode(backend.prompts[0], skip_special_tokens=False)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in first and "say hi" in first
