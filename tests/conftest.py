from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer


@pytest.fixture
def scripted_server() -> Iterator[LiveServer]:
    """A loopback server on the scripted demo backend."""
    with LiveServer([ScriptedChatModel()]) as server:
        yield server


@pytest.fixture(scope="session")
def claude() -> str:
    """The Claude Code CLI's path; skips where it is not installed, unless
    TURBOSPARK_REQUIRE_CLAUDE is set (CI installs it and sets that, so there it always runs)."""
    path = shutil.which("claude")
    if path is None:
        if os.environ.get("TURBOSPARK_REQUIRE_CLAUDE"):
            pytest.fail("TURBOSPARK_REQUIRE_CLAUDE is set but `claude` is not on PATH")
        pytest.skip("Claude Code CLI (`claude`) is not installed")
    return path


@pytest.fixture(scope="session")
def codex() -> str:
    """The Codex CLI's path; skips where it is not installed, unless TURBOSPARK_REQUIRE_CODEX is
    set (CI installs it and sets that, so there it always runs)."""
    path = shutil.which("codex")
    if path is None:
        if os.environ.get("TURBOSPARK_REQUIRE_CODEX"):
            pytest.fail("TURBOSPARK_REQUIRE_CODEX is set but `codex` is not on PATH")
        pytest.skip("Codex CLI (`codex`) is not installed")
    return path
