"""engines/: one module per serving engine: what it refuses, how a checked pair is handed to it.

- seam.py      what every engine fills (`Engine`: name, source, own_codes, refuses, plan) and the
               `ServeRequest` / `ServePlan` / `DraftRefused` they share
- vllm.py      vLLM: the codes only it refuses, the speculative config and the `vllm serve` argv
- sglang.py    SGLang: its own refusals (DSP701-DSP704), the DSPARK flags and the `sglang.launch_server` argv
- trtllm.py    TensorRT-LLM: DSP711, the speculative_config YAML and the `trtllm-serve` argv
- llamacpp.py  llama.cpp: the `llama-server --spec-type draft-dspark` argv on the pair's GGUF files

    plan = engine("vllm").plan(ServeRequest(target="Qwen/Qwen3-8B", draft="./my-draft"))

`ENGINE_ONLY_CODES`: validate's error codes that only some engine refuses (dspark's own runtime runs such a draft:
generate, eval and bench report them as warnings, quantize publishes it).
"""

from __future__ import annotations

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.engines import llamacpp, sglang, trtllm, vllm
from dspark_cli.runtime.engines.seam import Engine

ENGINES: dict[str, Engine] = {e.name: e for e in (vllm.ENGINE, sglang.ENGINE, trtllm.ENGINE, llamacpp.ENGINE)}
ENGINE_ONLY_CODES: frozenset[str] = frozenset().union(*(e.own_codes for e in ENGINES.values()))


def engine(name: str) -> Engine:
    """The registered engine of that name; DsparkError for another name."""
    if name not in ENGINES:
        raise DsparkError(f"the engine {name!r} is not one dspark serves with; use one of {', '.join(ENGINES)}.")
    return ENGINES[name]
