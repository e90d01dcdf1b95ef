"""regen's finish reason from llama.cpp's /completion: `stop_type` eos and word (a stop word) are stops, limit
(n_predict reached) alone is a length stop; the reply's ids are the server's."""

from __future__ import annotations

import pytest

from dspark_cli.runtime.regen.client import Sampling, Server


@pytest.mark.parametrize(("stop_type", "finish"), [("eos", "stop"), ("word", "stop"), ("limit", "length")])
def test_llamacpp_stop_type_is_the_finish_reason(monkeypatch, stop_type, finish):
    replies = {"/apply-template": {"prompt": "<user>hi"}, "/tokenize": {"tokens": [5, 6]},
               "/completion": {"content": "ok", "tokens": [7, 8], "stop_type": stop_type}}
    monkeypatch.setattr(Server, "post", lambda self, path, body: replies[path])
    reply = Server("http://127.0.0.1:1", "llamacpp", "m", Sampling(), 1.0).reply([{"role": "user", "content": "hi"}])
    assert (reply.finish_reason, reply.token_ids, reply.prompt_token_ids) == (finish, [7, 8], [5, 6])
