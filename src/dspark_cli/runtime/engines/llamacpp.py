"""Hand a checked target + draft pair to llama.cpp (release b11434): the `llama-server` argv.

    plan = ENGINE.plan(ServeRequest(target="./my-target", draft="./my-draft"))   # engines.engine("llamacpp")
    plan.argv   # ["llama-server", "-m", "/abs/my-target.gguf", "-md", "/abs/my-draft.gguf",
                #  "--spec-type", "draft-dspark", "--spec-draft-n-max", "7"]

llama.cpp loads GGUF files, not folders: the pair is checked as folders (validate's header-only rules, as for
vLLM), and the argv names the GGUF beside each folder (`FOLDER.gguf`), which `dspark convert DRAFT --to gguf`
writes for the draft and llama.cpp's convert_hf_to_gguf.py (or scripts/convert_target_llamacpp.py) for the target;
the plan's notes give both commands. What llama.cpp does, from its source at b11434:
- speculative.md of llama.cpp's docs "DSpark (`draft-dspark`)": `-md` the draft GGUF, `--spec-type draft-dspark`,
  `--spec-draft-n-max` clamped to the trained block size; Qwen3 backbones only.
- common/speculative.cpp (common_speculative_state_draft_dflash): `--spec-draft-p-min P` truncates a drafted block
  at the first position whose confidence-head score is below P, and refuses a draft without a confidence head;
  each block position is read from the draft's sampler (the Markov bias chained in-graph), so dspark's draft
  top-k and draft sample method have no llama.cpp counterpart.
- src/models/dflash.cpp: only the vanilla Markov head (markov_w1, markov_w2) is loaded.
"""

from __future__ import annotations

from pathlib import Path

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
from dspark_cli.runtime.engines.seam import DraftRefused, Engine, ServePlan, ServeRequest
from dspark_cli.runtime.settings import resolve_block_size, trained_block_size

LLAMA_SERVER = "llama-server"
OWN_CODES = frozenset({"DSP012"})  # a non-vanilla Markov head: src/models/dflash.cpp loads markov_w1/w2 only
RESERVED_FLAGS = ("-m", "--model", "-md", "--model-draft", "--spec-draft-model", "--spec-type", "--spec-draft-n-max",
                  "--spec-draft-p-min", "--draft-p-min")  # common/arg.cpp spellings of what dspark sets


def plan_serve(request: ServeRequest) -> ServePlan:
    """validate's header-only rules on the folders, then the `llama-server` argv on the GGUF beside each."""
    _check_args(request)
    ckpt = open_checkpoint(request.draft)
    report = validate_checkpoint(ckpt, read_target_config(request.target))
    refused = ENGINE.refuses(report)
    if refused:
        raise DraftRefused(report, refused, request.target, ENGINE.label)
    config = DraftConfig.from_dict(ckpt.config)
    _check_draft(config, report.resolved.get("head_format") or "")
    target, draft = gguf_beside(request.target, "target"), gguf_beside(request.draft, "draft")
    argv = llama_server_argv(target, draft, resolve_block_size(config, request.block_size), request)
    return ServePlan(target=target, draft=draft, speculative_config={"spec_type": "draft-dspark"}, argv=argv,
                     report=report, trained_block_size=trained_block_size(config), draft_quantization="unquantized",
                     notes=_notes(request, target, draft))


def llama_server_argv(target: str, draft: str, n_max: int, request: ServeRequest) -> list[str]:
    """`llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-dspark --spec-draft-n-max N [...]`."""
    argv = [LLAMA_SERVER, "-m", target, "-md", draft, "--spec-type", "draft-dspark", "--spec-draft-n-max", str(n_max)]
    if request.confidence_threshold is not None:
        argv += ["--spec-draft-p-min", str(request.confidence_threshold)]
    if request.port is not None:
        argv += ["--port", str(request.port)]
    return argv + list(request.engine_args)


def gguf_beside(folder: str, role: str) -> str:
    """The GGUF file llama.cpp loads for a model folder: FOLDER.gguf beside it, as an absolute path."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise DsparkError(f"the {role} {folder} is not a local folder; llama.cpp loads GGUF files, so dspark plans "
                          "from the folder and its GGUF beside it.")
    return str(path.resolve().with_name(path.resolve().name + ".gguf"))


def _check_args(request: ServeRequest) -> None:
    for arg in request.engine_args:
        if arg.split("=", 1)[0] in RESERVED_FLAGS:
            raise DsparkError(f"the extra llama.cpp arguments contain {arg}, which dspark sets itself; drop it and "
                              "use dspark's own options (block size, confidence threshold).")
    if request.port is not None and not 1 <= request.port <= 65535:
        raise DsparkError(f"the port must be between 1 and 65535, got {request.port}.")


def _check_draft(config: DraftConfig, head_format: str) -> None:
    """What llama.cpp refuses beyond validate's codes: other backbones than Qwen3 (speculative.md of llama.cpp's
    docs), a quantized markov_w2 (dflash.cpp reads no NVFP4 block scales) and a draft without a Markov head."""
    if config.family != "qwen3":
        raise DsparkError(f"llama.cpp runs DSpark drafts with a Qwen3 backbone only, and this is a "
                          f"{config.family_title()} draft.")
    if head_format.startswith("nvfp4"):
        raise DsparkError("llama.cpp's dflash model reads no NVFP4 block scales; serve the unquantized draft.")
    if not config.has_markov:
        raise DsparkError("the draft has no Markov head; llama.cpp runs it as a DFlash draft (spec type "
                          "draft-dflash), which dspark does not plan.")


def _notes(request: ServeRequest, target: str, draft: str) -> list[str]:
    notes = [f"llama.cpp loads GGUF files: write {draft} with dspark convert {request.draft} (the to option gguf, "
             f"the target option {request.target}) and {target} with llama.cpp's convert_hf_to_gguf.py (or "
             "scripts/convert_target_llamacpp.py for a tokenizer it does not recognize)."]
    if request.draft_topk is not None:
        notes.append("llama.cpp reads each drafted position from its own draft sampler: the draft top-k is not "
                     "passed.")
    return notes


ENGINE = Engine(name="llamacpp", label="llama.cpp", source="llama.cpp release b11434 (speculative.md of "
                "llama.cpp's docs, common/speculative.cpp, common/arg.cpp, src/models/dflash.cpp, conversion/qwen.py DSparkModel)",
                own_codes=OWN_CODES, plan=plan_serve)
