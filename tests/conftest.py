from __future__ import annotations

from collections.abc import Iterator

import pytest

from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer


@pytest.fixture
def scripted_server() -> Iterator[LiveServer]:
    """A loopback server on the scripted demo backend."""
    with LiveServer([ScriptedChatModel()]) as server:
        yield server
