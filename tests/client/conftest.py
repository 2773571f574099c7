"""The client's tests run against a real `pcr-rag serve` on the tiny model: they take the server tests' fixtures
(tests/server/conftest.py), loaded here rather than copied."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("server_fixtures", Path(__file__).parents[1] / "server" / "conftest.py")
assert _spec is not None and _spec.loader is not None
_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_server)

tiny = _server.tiny
engine = _server.engine
reference = _server.reference
server = _server.server
base_url = _server.base_url
fresh = _server.fresh
h = _server.h
