"""The llama-server fixture (tests/fixtures/llama_server.py) starts the real build with the slots asked for, the
draft under dspark's flags, and stops it. Skipped when the build is absent."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from llama_server import demo_ggufs, llama_server, needs_llamacpp  # noqa: F401 (demo_ggufs is a fixture)

pytestmark = needs_llamacpp


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_server_slots_draft_and_stop(demo_ggufs):
    target, draft = demo_ggufs
    with llama_server(target, draft, slots=2) as url:
        assert get(url + "/props")["total_slots"] == 2
        body = {"prompt": "def add(a, b):", "n_predict": 16, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            timings = json.loads(response.read())["timings"]
        assert timings["predicted_n"] == 16 and timings["draft_n"] > 0
    with pytest.raises(urllib.error.URLError):
        get(url + "/health")
