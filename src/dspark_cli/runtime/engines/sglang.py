"""Hand a checked target + draft pair to SGLang: its DSPARK speculative algorithm and the `sglang.launch_server` argv.

    plan = ENGINE.plan(ServeRequest(target="Qwen/Qwen3-8B", draft="./my-draft"))   # engines.engine("sglang")
    plan.argv   # [python, "-m", "sglang.launch_server", "--model-path", T, "--speculative-algorithm", "DSPARK", ...]

Every rule below was read from sgl-project/sglang (docs/engine-sglang.md lists them, with what is not verified):
- python/sglang/srt/models/dspark.py @ 01f47623: `build_markov_head` builds vanilla, gated and rnn heads;
  `DSparkDraftMixin.__init__` raises for a config with speculators_model_type "dspark" (slot k read one position
  early: accept length ~1, sgl-project/sglang#30261) -> DSP701; `load_weights` skips `embed_tokens.` and `lm_head.`
  (the target's are used) and raises for a Markov weight the unquantized nn.Linear head has no parameter for
  (NVFP4 `weight_scale`...) -> DSP702; markov_w2 is sized to `vocab_size`, so a reduced draft vocabulary does not
  load -> DSP703; `build_confidence_head` returns None under SGLANG_RAGGED_VERIFY_MODE=static.
- python/sglang/srt/speculative/dspark_components/dspark_config.py @ 01f47623: markov_rank > 0 is required ->
  DSP704; SUPPORTED_DSPARK_MARKOV_HEAD_TYPES = vanilla, gated, rnn.
- python/sglang/srt/speculative/dspark_components/dspark_sts.py @ 9e16e2d0: the STS file is DSparkStsCalibration
  JSON (`temperatures`, all > 0), what `dspark calibrate` writes.
- the launch flags (--speculative-algorithm DSPARK, --speculative-draft-model-path, --speculative-dspark-block-size
  = gamma, the draft tokens per round, --speculative-dspark-confidence-sts-path): ServerArgs in
  python/sglang/srt/server_args.py (the DSPARK-only fields' help text).
Quantized Linear layers (dspark quantize --scope draft): python/sglang/srt/models/dflash.py @ 003b23d7 builds qkv_proj
unquantized ("Intentionally left unquantized"), @ 7f151c5e every layer -> DSP705 for quantized q/k/v.
Gemma-4 drafts: models/dspark.py registers Qwen3DSparkModel only; whether another SGLang file serves
Gemma4DSparkModel is not verified (source not found), so it is a note, not a refusal.
DFlash2 drafts (PR #35371): python/sglang/srt/models/dflash.py's `DFlash2DraftModel` (a DFlashDraftModel with
`CandidateSelector`; "Reuses the DFLASH speculative worker") raises without dflash_config.selector_rank, and its
`compute_candidates` needs a dense or supported-quantized target lm_head; speculative/dflash_worker.py @ 0468412f
takes the block (the anchor and N masks) from --speculative-num-draft-tokens, to which the convolutions' window is
set. So a DFlash2 draft is launched with --speculative-algorithm DFLASH, not DSPARK, and without an STS file.
"""

from __future__ import annotations

import importlib.util
import sys

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.rules import Finding, Report
from dspark_cli.runtime.engines.seam import (
    QKV,
    Engine,
    ServePlan,
    ServeRequest,
    checked_pair,
    engine_finding,
    head_quantization,
    head_type_finding,
    linear_quantization,
    refuse_own_flags,
    refuse_vllm_only_settings,
)
from dspark_cli.runtime.settings import resolve_block_size, trained_block_size

MODULE = "sglang.launch_server"
INSTALL_HINT = ("SGLang is not installed for this Python (no importable `sglang`): on a CUDA machine run "
                "`pip install sglang` (a release with the DSPARK speculative algorithm), then run the command above.")
OWN_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-draft-model",
             "--speculative-dspark-block-size", "--speculative-num-draft-tokens",
             "--speculative-dspark-confidence-sts-path")


def rules(config: DraftConfig, report: Report) -> tuple[list[Finding], list[str]]:
    """SGLang's own refusals (DSP701-DSP704) and what it drops for this draft."""
    findings, notes = [], []
    if config.format == "speculators-dspark":
        findings.append(engine_finding("DSP701", "the config has speculators_model_type 'dspark'; SGLang refuses "
                                                 "it rather than read every block slot one position early."))
    head = head_quantization(report)
    if head:
        findings.append(engine_finding("DSP702", f"markov_w2 is stored {head}; SGLang loads the Markov head into "
                                                 "an unquantized layer and fails on its scale tensors."))
    if config.reduced_vocab:
        findings.append(engine_finding("DSP703", f"the draft predicts {config.draft_vocab_size} of "
                                                 f"{config.vocab_size} ids; SGLang uses the target's lm_head and "
                                                 "a full-vocabulary markov_w2."))
    if not config.has_markov and config.family != "dflash2":
        findings.append(engine_finding("DSP704", "the draft has no Markov head (markov_rank 0 or a DFlash draft)."))
    findings += head_type_findings(config)
    quantized_findings, quantized_notes = quantized_layers(config, report)
    findings += quantized_findings
    notes += quantized_notes
    if config.family == "dflash2":
        notes.append("DFlash2: SGLang serves it with its DFLASH algorithm (a block of the anchor and N masks) and "
                     "needs the target's lm_head dense or of a quantization its selector supports.")
    if "DSP104" not in report.codes or "DSP105" not in report.codes:
        notes.append("SGLang drops the draft's own embed_tokens / lm_head and uses the target's.")
    if config.enable_confidence_head:
        notes.append("the confidence head is built only when SGLANG_RAGGED_VERIFY_MODE is not 'static' (the "
                     "default); otherwise it and an STS file are unused (every drafted token is verified).")
    if config.family == "gemma4":
        notes.append("Gemma-4 draft: not verified that SGLang serves Gemma4DSparkModel (its models/dspark.py "
                     "registers Qwen3DSparkModel only).")
    return findings, notes


def quantized_layers(config: DraftConfig, report: Report) -> tuple[list[Finding], list[str]]:
    """A draft whose Linear layers are ModelOpt-quantized, as SGLang's DFlash layers (which DSpark's and DFlash2's
    drafts are built on) read it. python/sglang/srt/models/dflash.py @ 003b23d7 builds qkv_proj with quant_config=None
    ("Intentionally left unquantized": kv_proj_only slices its raw weight) and o_proj, the MLP and fc with the
    quant_config; @ 7f151c5e every layer is unquantized. Its load_weights skips names it has no parameter for
    (weight_scale, input_scale) and loads the weight itself into the unquantized one: a packed NVFP4 [N, K/2] does
    not fit, FP8 codes load without their scale -> DSP705 for quantized q/k/v; other quantized layers are a note (which
    of the two versions a release has is not verified). The draft's own lm_head is dropped anyway (the target's is
    used)."""
    quant = linear_quantization(config, report)
    if quant is None:
        return [], []
    if quant.covers(*QKV):
        return [engine_finding("DSP705", f"{quant.stored}, q/k/v projections among them; SGLang builds qkv_proj "
                                         "unquantized (models/dflash.py) and loads no weight_scale into it.")], []
    return [], [f"{quant.stored} (not q/k/v): SGLang's models/dflash.py @ 003b23d7 builds o_proj, the MLP and fc with "
                "the quantization config, @ 7f151c5e unquantized; not verified for your release."]


def head_type_findings(config: DraftConfig) -> list[Finding]:
    """DSP725: a Markov head type SGLang does not build, or none where its parse_dspark_draft_config reads one
    (dspark_markov_head_type, dspark_config, text_config, the top level): with markov_rank > 0 it raises "DSpark
    requires markov_head_type when markov_rank > 0" (unless the draft is bundled in a target by dspark_* keys),
    where dspark assumes vanilla (DeepSpec writes the key)."""
    if config.has_markov and head_type_read(config.raw) is None:
        return [engine_finding("DSP725", "config.json has markov_rank > 0 but no markov_head_type where SGLang "
                                         "reads it (the top level, dspark_config or text_config).")]
    return head_type_finding(ENGINE, config, "DSP725", "dspark_config.py SUPPORTED_DSPARK_MARKOV_HEAD_TYPES")


def head_type_read(raw: dict) -> str | None:
    """markov_head_type as SGLang's parse_dspark_draft_config finds it, or None."""
    nested = [raw.get(key) if isinstance(raw.get(key), dict) else {} for key in ("dspark_config", "text_config")]
    found = (raw.get("dspark_markov_head_type"), nested[0].get("markov_head_type"),
             (nested[1] or raw).get("markov_head_type"), raw.get("markov_head_type"))
    return next((str(value).lower() for value in found if value is not None), None)


def plan_serve(request: ServeRequest) -> ServePlan:
    """validate's header-only rules and SGLang's verdict on the pair, then the `sglang.launch_server` argv."""
    refuse_vllm_only_settings(request, ENGINE.label)
    refuse_own_flags(request, ENGINE.label, OWN_FLAGS)
    pair = checked_pair(request, ENGINE)
    block = resolve_block_size(pair.config, request.block_size)
    if pair.config.family == "dflash2":
        flags = dflash_flags(pair.draft, block, request)
    else:
        flags = {"speculative_algorithm": "DSPARK", "speculative_draft_model_path": pair.draft,
                 "speculative_dspark_block_size": block}
        if request.calibration is not None:
            flags["speculative_dspark_confidence_sts_path"] = sts_file(request.calibration, pair.config, block)
    argv = [sys.executable, "-m", MODULE, "--model-path", pair.target]
    for key, value in flags.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    if request.port is not None:
        argv += ["--port", str(request.port)]
    return ServePlan(target=pair.target, draft=pair.draft, speculative_config=flags,
                     argv=argv + list(request.engine_args), report=pair.report,
                     trained_block_size=trained_block_size(pair.config), draft_quantization="unquantized",
                     notes=pair.verdict.notes, engine=ENGINE.name)


def dflash_flags(draft: str, block: int, request: ServeRequest) -> dict:
    """SGLang's flags for a DFlash2 draft: the DFLASH algorithm, whose block is the anchor and `block` masks."""
    if request.calibration is not None:
        raise DsparkError("SGLang's DFLASH algorithm, which serves DFlash2 drafts, reads no STS calibration file; "
                          "drop the calibration.")
    return {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": draft,
            "speculative_num_draft_tokens": block + 1}


def sts_file(path: str, config: DraftConfig, block: int) -> str:
    """`path` when SGLang would read it as the draft's STS calibration (dspark_sts.py DSparkStsCalibration: a JSON
    object with `temperatures`, all above 0; dspark reads one per drafted position) and use it (the draft has a
    confidence head); DsparkError in one sentence otherwise: a missing file, a run file, another format."""
    from pathlib import Path

    from dspark_cli.runtime.io.reading import read_json_file
    from dspark_cli.runtime.measure.calibration import MAX_STS_BYTES, check_temperatures, load_temperatures

    if not config.enable_confidence_head:
        raise DsparkError("the draft has no confidence head, so SGLang would not use an STS calibration file; drop "
                          "the calibration.")
    temperatures = load_temperatures(Path(path))  # missing, not JSON, no temperatures: one sentence
    if "temperatures" not in read_json_file(Path(path), "calibration file", MAX_STS_BYTES, "give another file"):
        raise DsparkError(f"{path} names its temperatures sts_temperatures only, and SGLang's DSparkStsCalibration "
                          "reads the temperatures key; give a file written by `dspark calibrate`.")
    check_temperatures(temperatures, block, path)
    return path


def sglang_installed() -> bool:
    """Whether this interpreter can import sglang (checked without importing it)."""
    return importlib.util.find_spec("sglang") is not None


def plain_argv(request: ServeRequest) -> list[str]:
    """`python -m sglang.launch_server --model-path TARGET [--port P] [...]`: the target without a draft."""
    refuse_own_flags(request, ENGINE.label, OWN_FLAGS)
    argv = [sys.executable, "-m", MODULE, "--model-path", request.target]
    return argv + ([] if request.port is None else ["--port", str(request.port)]) + list(request.engine_args)

ENGINE = Engine(
    name="sglang", label="SGLang", own_codes=frozenset(), plan=plan_serve, rules=rules,
    source="sgl-project/sglang python/sglang/srt/models/dspark.py and speculative/dspark_components/dspark_config.py "
           "@ 01f47623, dspark_sts.py @ 9e16e2d0, server_args.py @ 001067ff (docs/engine-sglang.md)",
    layout="DeepSpec layout (slot k predicts anchor+k+1), full vocabulary, unquantized Markov head; Qwen3 backbone",
    reads="the draft and target folders; an STS temperatures file (the calibration option)",
    installed=sglang_installed, install_hint=INSTALL_HINT,
    markov_heads=frozenset({"vanilla", "gated", "rnn"}),  # dspark_config.py SUPPORTED_DSPARK_MARKOV_HEAD_TYPES
    plain=plain_argv, draft_length_setting="--speculative-dspark-block-size",
)
