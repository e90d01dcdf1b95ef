"""When a verdict plan says speculation does not pay (n = 0), each engine's command serves the target alone: no draft,
no speculative setting, the port and the extra arguments kept."""

from __future__ import annotations

import pytest

from dspark_cli.runtime.engines import engine
from dspark_cli.runtime.engines.seam import ServeRequest


@pytest.mark.parametrize(("name", "head"), [("vllm", ["vllm", "serve", "Qwen/Qwen3-8B"]),
                                            ("trtllm", ["trtllm-serve", "Qwen/Qwen3-8B"])])
def test_plain_command_of_each_engine(name, head):
    argv = engine(name).plain(ServeRequest(target="Qwen/Qwen3-8B", draft="./draft", port=8000,
                                           engine_args=("--max-model-len", "4096")))
    assert argv == head + ["--port", "8000", "--max-model-len", "4096"]


def test_plain_sglang_names_the_target_only():
    argv = engine("sglang").plain(ServeRequest(target="Qwen/Qwen3-8B", draft="./draft"))
    assert argv[1:] == ["-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-8B"]


def test_plain_llamacpp_loads_the_target_gguf_beside_its_folder(tmp_path):
    (tmp_path / "target").mkdir()
    argv = engine("llamacpp").plain(ServeRequest(target=str(tmp_path / "target"), draft=str(tmp_path / "draft")))
    assert argv == ["llama-server", "-m", str(tmp_path / "target.gguf")]
    with pytest.raises(Exception, match="-md"):  # a draft flag among the extra arguments contradicts the plan
        engine("llamacpp").plain(ServeRequest(target=str(tmp_path / "target"), draft="d", engine_args=("-md", "x")))
