"""Hand a checked target + draft pair to llama.cpp (release b11434): the `llama-server` argv.

    plan = ENGINE.plan(ServeRequest(target="./my-target", draft="./my-draft"))   # engines.engine("llamacpp")
    plan.argv   # ["llama-server", "-m", "/abs/my-target.gguf", "-md", "/abs/my-draft.gguf",
                #  "--spec-type", "draft-dspark", "--spec-draft-n-max", "7"]

llama.cpp loads GGUF files, not folders: the pair is checked as folders (validate's header-only rules, as for
vLLM), and the argv names the GGUF beside each folder (`FOLDER.gguf`), which `dspark convert DRAFT --to gguf`
writes for the draft and `dspark convert TARGET --to gguf` for a Qwen3 or Qwen2 target (llama.cpp's own converter
for others); the plan's notes give both commands. What llama.cpp does, from its source at b11434:
- speculative.md of llama.cpp's docs "DSpark (`draft-dspark`)": `-md` the draft GGUF, `--spec-type draft-dspark`,
  `--spec-draft-n-max` clamped to the trained block size; Qwen3 backbones only.
- common/speculative.cpp (common_speculative_state_draft_dflash): `--spec-draft-p-min P` truncates a drafted block
  at the first position whose confidence-head score is below P, and refuses a draft without a confidence head;
  each block position is read from the draft's sampler (the Markov bias chained in-graph), so dspark's draft
  top-k and draft sample method have no llama.cpp counterpart.
- src/models/dflash.cpp: only the vanilla Markov head (markov_w1, markov_w2) is loaded.
DFlash2 drafts (docs/engine-llamacpp.md): speculative.md's `draft-dflash` spec type, `--spec-draft-n-max` clamped
to the trained block size minus the anchor's slot (common/speculative.cpp, `n_draft_max = block_size - 1` for a
draft that is not draft-dspark); the draft loop walks the selector's lattice greedily (`is_dflash2`) and
`--spec-draft-p-min` stops it at the first position whose selector top-1 probability is below P; dflash.cpp refuses
a hidden size below top_k·(top_k + 1) at start-up (validate's DSP062, vLLM and SGLang serve such a draft).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
from dspark_cli.runtime.checkpoint.rules import Finding, Report, validate_checkpoint
from dspark_cli.runtime.engines.seam import (
    DraftRefused,
    Engine,
    ServePlan,
    ServeRequest,
    engine_finding,
    head_quantization,
    linear_quantization,
    refuse_own_flags,
)
from dspark_cli.runtime.settings import resolve_block_size, trained_block_size

LLAMA_SERVER = "llama-server"
# DSP012 a non-vanilla Markov head: src/models/dflash.cpp loads markov_w1/w2 only; DSP062 a DFlash2 hidden size
# below top_k * (top_k + 1): dflash.cpp packs each position's lattice into one hidden-size row
OWN_CODES = frozenset({"DSP012", "DSP062"})
FAMILIES = ("qwen3", "dflash2")  # the backbones of its dflash model (speculative.md; dspark convert writes these)
OWN_FLAGS = ("-m", "--model", "-md", "--model-draft", "--spec-draft-model", "--spec-type", "--spec-draft-n-max",
             "--spec-draft-p-min", "--draft-p-min")  # common/arg.cpp spellings of what dspark sets


def plan_serve(request: ServeRequest) -> ServePlan:
    """validate's header-only rules on the folders, then the `llama-server` argv on the GGUF beside each."""
    refuse_own_flags(request, ENGINE.label, OWN_FLAGS)
    refuse_unread_settings(request)
    ckpt = open_checkpoint(request.draft)
    report = validate_checkpoint(ckpt, read_target_config(request.target))
    config = DraftConfig.from_dict(ckpt.config)
    refused = ENGINE.verdict(report, config).refused
    if refused:
        raise DraftRefused(report, refused, request.target, ENGINE.label)
    refuse_threshold_without_head(config, request)
    target, draft = gguf_beside(request.target, "target"), gguf_beside(request.draft, "draft")
    spec = {"spec_type": spec_type(config), "spec_draft_n_max": resolve_block_size(config, request.block_size)}
    argv = llama_server_argv(target, draft, spec, request)
    quant = linear_quantization(config, report)
    stored = "unquantized" if quant is None else (
        f"{' and '.join(kind.upper() for kind in sorted(quant.counts))} in the folder, dequantized in the GGUF")
    return ServePlan(target=target, draft=draft, speculative_config=spec, argv=argv, engine=ENGINE.name,
                     report=report, trained_block_size=trained_block_size(config), draft_quantization=stored,
                     notes=_notes(request, target, draft) + quantized_layer_notes(config, report))


def refuse_unread_settings(request: ServeRequest) -> None:
    """What llama-server has no setting for (common/arg.cpp, common/speculative.cpp): a draft top-k (each position
    is read from the draft's own top-10 sampler), a draft sample method other than greedy (the DSpark drafter takes
    the top candidate of every position, cur_p->data[0]), an STS file (its cut-off is spec-draft-p-min alone)."""
    if request.draft_topk is not None:
        raise DsparkError("llama.cpp drafts each position from its own sampler and takes no draft top-k; drop it.")
    if request.draft_sample_method not in (None, "greedy"):
        raise DsparkError(f"llama.cpp drafts the top candidate at every position (greedy) and has no "
                          f"{request.draft_sample_method} draft sampling; drop the draft sample method or pass "
                          "greedy.")
    if request.calibration is not None:
        raise DsparkError("llama.cpp reads no STS calibration file (its only confidence setting is the threshold "
                          "spec-draft-p-min, from the from-plan option); drop the calibration.")


def refuse_threshold_without_head(config: DraftConfig, request: ServeRequest) -> None:
    """A threshold for a draft-dspark draft without a confidence head: llama-server then fails to initialise
    speculation ("DSpark draft has no confidence head: please set --spec-draft-p-min 0",
    common/speculative.cpp) and serves the target without the draft. A DFlash2 draft's cut-off is its selector's."""
    dspark = spec_type(config) == "draft-dspark"
    if request.confidence_threshold is not None and dspark and not config.enable_confidence_head:
        raise DsparkError("a confidence threshold needs a draft with a confidence head, and this draft has none "
                          "(llama.cpp would start without the draft); plan without thresholds.")


def conf_proj_refusal(config: DraftConfig, has_confidence: bool) -> str | None:
    """Why llama.cpp's dflash model cannot hold this draft's confidence head, or None: src/models/dflash.cpp loads
    conf_proj.weight as [hidden + markov_rank, 1], the hidden state and the Markov state. `dspark convert --to gguf`
    refuses such a draft with this reason and `validate --engine llamacpp` with DSP724: the one rule of both."""
    if has_confidence and not (config.has_markov and config.confidence_head_with_markov):
        return ("its confidence head reads the hidden state alone, and llama.cpp's conf_proj reads the hidden state "
                "and the Markov state")
    return None


def spec_type(config: DraftConfig) -> str:
    """llama.cpp's spec type for the draft: draft-dflash for a DFlash2 draft (its selector needs the DFlash block
    of the anchor and N masks), draft-dspark for a DSpark one."""
    return "draft-dflash" if config.family == "dflash2" else "draft-dspark"


def llama_server_argv(target: str, draft: str, spec: dict, request: ServeRequest) -> list[str]:
    """`llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type TYPE --spec-draft-n-max N [...]`."""
    argv = [LLAMA_SERVER, "-m", target, "-md", draft, "--spec-type", spec["spec_type"], "--spec-draft-n-max",
            str(spec["spec_draft_n_max"])]
    if request.confidence_threshold is not None:
        argv += ["--spec-draft-p-min", str(request.confidence_threshold)]
    if request.port is not None:
        argv += ["--port", str(request.port)]
    return argv + list(request.engine_args)


def plain_argv(request: ServeRequest) -> list[str]:
    """`llama-server -m TARGET.gguf [--port P] [...]`: the target without a draft."""
    refuse_own_flags(request, ENGINE.label, OWN_FLAGS)
    argv = [LLAMA_SERVER, "-m", gguf_beside(request.target, "target")]
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


def causality_refusal(config: DraftConfig) -> str | None:
    """Why llama.cpp's dflash draft cannot attend with this draft's causality, or None: vLLM gives each layer its own
    (DraftConfig.layer_attention: sliding_attention layers causal, full ones not, unless is_causal or
    dflash_config.causal says otherwise) and llama.cpp reads one flag for the whole draft (common/speculative.cpp,
    `dflash.attention.causal`). `dspark convert --to gguf` refuses such a draft with this reason and
    `validate --engine llamacpp` with DSP727: the one rule of both."""
    layers = config.layer_attention
    if layers is not None and len({layer.causal for layer in layers}) > 1:
        return ("its layers differ in causality (vLLM runs sliding_attention layers causal and full ones "
                "non-causal unless is_causal or dflash_config.causal says otherwise), and llama.cpp's dflash draft "
                "has one causal flag for all its layers (dflash.attention.causal)")
    return None


def rules(config: DraftConfig, report: Report) -> tuple[list[Finding], list[str]]:
    """llama.cpp's own refusals beyond validate's codes (DSP721-DSP724, DSP727): other backbones than Qwen3
    (speculative.md of llama.cpp's docs), a quantized markov_w2 (dflash.cpp reads no NVFP4 block scales), no Markov
    head, a confidence head its conf_proj cannot hold (`conf_proj_refusal`), layers of differing causality
    (`causality_refusal`); the last two are the converter's own rules."""
    findings = []
    if config.family not in FAMILIES:
        findings.append(engine_finding("DSP721", f"this is a {config.family_title} draft."))
    head = head_quantization(report)
    if head:
        findings.append(engine_finding("DSP722", f"markov_w2 is stored {head}."))
    if not config.has_markov and config.family != "dflash2":
        findings.append(engine_finding("DSP723", "the draft has no Markov head (markov_rank 0 or a DFlash draft)."))
    confidence = conf_proj_refusal(config, config.enable_confidence_head)
    if confidence:
        findings.append(engine_finding("DSP724", f"{confidence}; dspark convert refuses it."))
    causality = causality_refusal(config)
    if causality:
        findings.append(engine_finding("DSP727", f"{causality}; dspark convert refuses it."))
    notes = ["llama.cpp loads GGUF files: the draft and a Qwen3 or Qwen2 target through dspark convert, another "
             "target through llama.cpp's own converter (docs/convert.md)."]
    if config.enable_confidence_head:
        notes.append("llama.cpp uses the confidence head only as a static per-position cut-off (spec-draft-p-min), "
                     "not a verify budget; an STS file is not read.")
    if config.family == "dflash2":
        notes.append("DFlash2: llama.cpp walks the selector's lattice greedily at every temperature (the target "
                     "still verifies exactly); its selector top-1 probability is the cut-off spec-draft-p-min reads.")
    notes += quantized_layer_notes(config, report)
    return findings, notes


def quantized_layer_notes(config: DraftConfig, report: Report) -> list[str]:
    """What the GGUF holds for ModelOpt-quantized Linear layers: dspark convert dequantizes them exactly
    (convert/dequant.py) and writes F32, or the outtype's own quantization; FP8's static input scales have no GGUF
    tensor (llama.cpp quantizes each matmul's activations its own way, if at all), so they are dropped."""
    quant = linear_quantization(config, report)
    if quant is None:
        return []
    note = (f"{quant.stored}: dspark convert writes them dequantized (exact) as F32, or in the outtype you "
            "choose; llama.cpp runs no ModelOpt format")
    if "fp8" in quant.counts:
        note += "; FP8's static input scales are dropped (activations stay unquantized)"
    return [note + "."]


def _notes(request: ServeRequest, target: str, draft: str) -> list[str]:
    notes = [f"llama.cpp loads GGUF files: write {draft} with dspark convert {request.draft} (the to option gguf, "
             f"the target option {request.target}) and {target} with dspark convert {request.target} (the to option "
             "gguf; a Qwen3 or Qwen2 target, llama.cpp's own converter for others)."]
    return notes


def build_binary(name: str) -> Path:
    """A llama.cpp program (llama-server, llama-quantize): scripts/build_llamacpp.sh's build (under
    DSPARK_LLAMACPP_CACHE, default ~/.cache/dspark/llama.cpp-b11434) when it is there, else the one on PATH, else
    the build's path (absent: the caller's message names it)."""
    cache = Path(os.environ.get("DSPARK_LLAMACPP_CACHE", Path.home() / ".cache/dspark/llama.cpp-b11434"))
    built = cache / "build" / "bin" / name
    on_path = shutil.which(name)
    return built if built.is_file() or on_path is None else Path(on_path)


def local_server_argv(binary: Path, target_gguf: Path, draft_gguf: Path | None, spec_args: tuple[str, ...],
                      port: int, threads: int) -> list[str]:
    """llama-server on 127.0.0.1:PORT, one slot, its speculation counters on /metrics: the server convert's
    acceptance guard starts for each draft (`spec_args` are the plan's flags after -md)."""
    draft = ["-md", str(draft_gguf), *spec_args] if draft_gguf is not None else []
    return [str(binary), "-m", str(target_gguf), *draft, "--host", "127.0.0.1", "--port", str(port), "-np", "1",
            "-t", str(threads), "--metrics"]


def quantize_argv(binary: Path, source: Path, out: Path, ftype: str, leave_output: bool) -> list[str]:
    """llama-quantize's argv (tools/quantize/quantize.cpp): `--leave-output-tensor` keeps output.weight as it
    was; one thread, so that its output does not depend on the machine."""
    return [str(binary), *(["--leave-output-tensor"] if leave_output else []), str(source), str(out), ftype, "1"]


ENGINE = Engine(
    name="llamacpp", label="llama.cpp", own_codes=OWN_CODES, plan=plan_serve, rules=rules,
    source="llama.cpp release b11434 (speculative.md of llama.cpp's docs, common/speculative.cpp, common/arg.cpp, "
           "src/models/dflash.cpp, conversion/qwen.py DSparkModel)",
    layout="its own GGUF (dflash architecture; dspark convert), target layer ids DeepSpec's + 1; Qwen3 backbone, "
           "vanilla unquantized Markov head",
    reads="the target's and the draft's GGUF files",
    installed=lambda: shutil.which(LLAMA_SERVER) is not None,
    plain=plain_argv, draft_length_setting="--spec-draft-n-max", threshold_setting="--spec-draft-p-min",
    install_hint="llama.cpp is not installed here (no `llama-server` on PATH): build it (scripts/build_llamacpp.sh "
                 "builds release b11434) and put its bin/ folder on PATH, then run the command above.",
)
