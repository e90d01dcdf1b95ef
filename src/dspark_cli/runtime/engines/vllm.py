"""Hand a checked target + draft pair to vLLM: the speculative config and the `vllm serve` argv.

    plan = ENGINE.plan(ServeRequest(target="Qwen/Qwen3-8B", draft="./my-draft"))   # engines.engine("vllm")
    plan.speculative_config   # {"method": "dspark", "model": "/abs/my-draft", "num_speculative_tokens": 7, ...}
    plan.argv                 # ["vllm", "serve", "Qwen/Qwen3-8B", "--speculative-config", "{...}"]
    exec_vllm(plan.argv)      # replaces this process (signals and the exit code belong to vLLM)

Nothing here loads weights: the pair goes through validate's header-only rules first, and a draft with errors vLLM
refuses is refused (DraftRefused, exit code 1 like validate). The block size and draft top-k are resolved by
settings.py, as for `dspark generate`; only vLLM's own restrictions are checked here. Every key written is a
field of vLLM's SpeculativeConfig; where each one comes from in vLLM's source is listed in docs/serve.md.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, NoReturn

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.rules import Report
from dspark_cli.runtime.engines.seam import (
    QKV,
    Engine,
    ServePlan,
    ServeRequest,
    checked_pair,
    engine_finding,
    head_quantization,
    linear_quantization,
)
from dspark_cli.runtime.settings import resolve_block_size, resolve_draft_topk, trained_block_size

VLLM = "vllm"
DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")  # SpeculativeConfig.draft_sample_method; dspark's default first
INSTALL_HINT = ("vLLM is not installed here (no `vllm` on PATH): on a CUDA machine run `pip install vllm` "
                "(a release with the 'dspark' speculative method), then run the command above.")
OMNI_ARCHITECTURE = "Qwen3OmniDSparkModel"  # vLLM requires num_speculative_tokens == block_size for it
RESERVED_VLLM_FLAGS = ("--speculative-config", "--speculative_config")
# Errors of validate's report about what vLLM cannot load although the draft is sound (dspark runs it):
# DSP012 a non-vanilla Markov head: vLLM's DSparkMarkovHead (vllm/model_executor/models/qwen3_dspark.py, also used
# by gemma4_dspark.py) has markov_w1 and markov_w2 only; DSP040-DSP042 Gemma-4 drafts without their own
# embed_tokens / lm_head, with attention_k_eq_v false or a reduced vocabulary (gemma4_dspark.py's load rules).
OWN_CODES = frozenset({"DSP012", "DSP040", "DSP041", "DSP042"})
# Warnings of validate's report about what vLLM loads but drops or changes (gemma4_dspark.py): DSP043 its loader
# skips every confidence_head tensor; DSP046 its soft-capping LogitsProcessor caps the Markov bias too.
LOSS_CODES = ("DSP043", "DSP046")


def plan_serve(request: ServeRequest) -> ServePlan:
    """validate's header-only rules on the pair, then the speculative config and the `vllm serve` argv."""
    check_request(request)
    if request.calibration is not None:
        raise DsparkError("vLLM reads no STS calibration file (it takes a survival threshold, the from-plan "
                          "option); drop the calibration or serve with SGLang or TensorRT-LLM.")
    pair = checked_pair(request, ENGINE)
    if request.confidence_threshold is not None and "DSP043" in pair.report.codes:
        raise DsparkError("vLLM's Gemma-4 DSpark loader skips the confidence head (validate's DSP043), so it cannot "
                          "cut blocks at a confidence threshold; plan without thresholds for vLLM.")
    spec, notes = speculative_config(pair.config, pair.draft, request)
    notes += stateful_target_notes(pair.target_config)
    return ServePlan(
        target=pair.target,
        draft=pair.draft,
        speculative_config=spec,
        argv=vllm_argv(pair.target, spec, request.port, request.engine_args),
        report=pair.report,
        trained_block_size=trained_block_size(pair.config),
        draft_quantization=_quantization(pair.report),
        notes=notes,
    )


# Stateful families vLLM's model registry lists (vllm/model_executor/models/registry.py, _TEXT_GENERATION_MODELS;
# Qwen3.5 in vllm/model_executor/models/qwen3_5.py), by the name dspark gives the family (docs/stateful.md).
VLLM_STATEFUL_ARCHITECTURES = {
    "Qwen3.5": "Qwen3_5ForConditionalGeneration", "Qwen3.5-MoE": "Qwen3_5MoeForConditionalGeneration",
    "Qwen3-Next": "Qwen3NextForCausalLM", "LFM2-MoE": "Lfm2MoeForCausalLM",
    "Falcon-H1": "FalconH1ForCausalLM", "Jamba": "JambaForCausalLM", "Bamba": "BambaForCausalLM",
    "Granite-4 hybrid": "GraniteMoeHybridForCausalLM", "LFM2": "Lfm2ForCausalLM", "Mamba2": "Mamba2ForCausalLM",
    "MiniMax": "MiniMaxForCausalLM",
}


def stateful_target_notes(target_config: dict) -> list[str]:
    """What serving a stateful target means: vLLM keeps its recurrent states itself (one per drafted position for
    Gated DeltaNet layers: vllm/v1/attention/backends/gdn_attn.py, GDNAttentionMetadata.spec_state_indices_tensor
    and num_accepted_tokens), so dspark's own rollback is not involved."""
    from dspark_cli.runtime.checkpoint.stateful import family_of_config_dict

    family = family_of_config_dict(target_config)
    if family is None:
        return []
    return [f"{family.name} target: vLLM lists {VLLM_STATEFUL_ARCHITECTURES[family.name]} and keeps its recurrent "
            "states itself during speculative decoding; check that your vLLM release runs the 'dspark' method "
            "with hybrid targets (docs/stateful.md)."]


def check_request(request: ServeRequest) -> None:
    if request.draft_sample_method not in (None, *DRAFT_SAMPLE_METHODS):
        raise DsparkError(f"the draft sample method must be one of {', '.join(DRAFT_SAMPLE_METHODS)}, "
                          f"got {request.draft_sample_method!r}.")
    for arg in request.engine_args:
        flag = arg.split("=", 1)[0]
        if sets_speculative_config(arg):
            raise DsparkError(f"the extra vLLM arguments contain {flag}, which sets vLLM's speculative config that "
                              "dspark builds itself; drop it and use dspark's own options (block size, draft top-k, "
                              "draft sample method).")
        if flag == "--port" and request.port is not None:
            raise DsparkError("the port is given twice (dspark's option and an extra vLLM argument); keep one.")


def sets_speculative_config(arg: str) -> bool:
    """Whether one extra vLLM argument sets (part of) the speculative config, in any spelling vLLM's parser takes:
    --speculative-config / --speculative_config, its short form -sc (also with the value attached), a dotted key
    (--speculative-config.num_speculative_tokens 5 sets one field of the JSON), or an unambiguous abbreviation
    of the long flag (argparse accepts prefixes). vLLM: vllm/engine/arg_utils.py EngineArgs.add_cli_args, and
    FlexibleArgumentParser (vllm/utils) for dotted keys."""
    flag = arg.split("=", 1)[0]
    if flag.startswith("-sc"):
        return True
    if not flag.startswith("--"):
        return False
    long_flag = flag.split(".", 1)[0].replace("_", "-")
    return long_flag in RESERVED_VLLM_FLAGS or (len(long_flag) >= len("--spec")
                                                 and RESERVED_VLLM_FLAGS[0].startswith(long_flag))


def speculative_config(config: DraftConfig, model: str, request: ServeRequest) -> tuple[dict[str, Any], list[str]]:
    """The JSON object for `vllm serve --speculative-config`, and notes on what vLLM takes from the draft itself."""
    method = "dflash" if config.kind == "dflash" else "dspark"
    tokens = _num_speculative_tokens(config, request.block_size)
    spec: dict[str, Any] = {
        "method": method,
        "model": model,
        "num_speculative_tokens": tokens,
        "draft_sample_method": request.draft_sample_method or DRAFT_SAMPLE_METHODS[0],
    }
    topk = _draft_topk(config, request.draft_topk, method)
    if topk is not None:
        spec["dspark_draft_topk"] = topk
    if request.confidence_threshold is not None:
        if method != "dspark" or not config.enable_confidence_head:
            raise DsparkError("a confidence threshold needs a DSpark draft with a confidence head, and this draft "
                              "has none; plan without thresholds.")
        spec["dspark_confidence_threshold"] = request.confidence_threshold
    notes = dflash2_notes() if config.family == "dflash2" else []
    if config.reduced_vocab:
        notes.append(f"reduced draft vocabulary ({config.draft_vocab_size} of {config.vocab_size} ids): vLLM maps "
                     "draft ids to target ids with the checkpoint's d2t tensor; nothing to set here.")
    return spec, notes


def dflash2_notes() -> list[str]:
    """What vLLM needs to run a DFlash2 draft's selector (docs/serve.md): its dflash method dispatches a
    DFlash2DraftModel to DFlash2Speculator, which lives in the V2 GPU model runner
    (vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py), and qwen3_dflash2.py's compute_candidates raises for a
    quantized target lm_head."""
    return ["DFlash2: vLLM runs the path selector in its V2 GPU model runner (set VLLM_USE_V2_MODEL_RUNNER=1 where "
            "your release does not default to it) and needs the target's lm_head unquantized."]


def vllm_argv(target: str, spec: dict[str, Any], port: int | None, extra: tuple[str, ...] | list[str]) -> list[str]:
    """`vllm serve TARGET --speculative-config JSON [--port P] [EXTRA...]` as an argument list (no shell)."""
    argv = [VLLM, "serve", target, "--speculative-config", json.dumps(spec)]
    if port is not None:
        argv += ["--port", str(port)]
    return argv + list(extra)


def find_vllm() -> str | None:
    """Path of the `vllm` executable on PATH, or None."""
    return shutil.which(VLLM)


def exec_vllm(argv: list[str]) -> NoReturn:
    """Replace this process by vLLM: same PID, so signals reach vLLM and its exit code is the caller's.

    A `vllm` on PATH that the kernel cannot start (not an executable format, a missing interpreter on its #! line,
    no permission) is one sentence."""
    try:
        os.execvp(argv[0], argv)
    except OSError as error:
        where = shutil.which(argv[0]) or argv[0]
        why = error.strerror or str(error)
        if isinstance(error, FileNotFoundError) and os.path.exists(where):
            why = "the interpreter named on its #! line does not exist"
        raise DsparkError(f"cannot start {where}: {why}; the vllm on PATH is not a working executable, reinstall "
                          "vLLM (pip install vllm) or fix PATH.") from None


def _num_speculative_tokens(config: DraftConfig, requested: int | None) -> int:
    """settings.py's block size (the trained one by default, never more), and vLLM's equality for Qwen3-Omni
    drafts (vllm/config/speculative.py, SpeculativeConfig._validate_qwen3_omni_dspark)."""
    tokens = resolve_block_size(config, requested)
    trained = trained_block_size(config)
    if config.architecture == OMNI_ARCHITECTURE and trained is not None and tokens != trained:
        raise DsparkError(f"vLLM serves {OMNI_ARCHITECTURE} drafts only with num_speculative_tokens equal to their "
                          f"block size {trained}; drop the block size or use {trained}.")
    return tokens


def _draft_topk(config: DraftConfig, requested: int | None, method: str) -> int | None:
    """settings.py's draft top-k (1 to the draft vocabulary); vLLM reads it only for a DSpark draft's Markov head
    (vllm/config/speculative.py, SpeculativeConfig.__post_init__ requires a Qwen3DSparkModel-family draft)."""
    topk = resolve_draft_topk(config, requested)
    if topk is not None and (method != "dspark" or not config.has_markov):
        raise DsparkError("a draft top-k applies to the Markov head of a DSpark draft, and this draft has none; "
                          "drop the top-k.")
    return topk


def rules(config: DraftConfig, report: Report) -> tuple[list, list[str]]:
    """vLLM's own refusals of quantized Linear layers (DSP731, DSP732) and what it serves with losses: validate's
    vLLM-specific warnings, one note each."""
    notes = [f"{finding.code} {finding.message}" for finding in report.warnings if finding.code in LOSS_CODES]
    return quantized_layer_findings(config, report), notes


def quantized_layer_findings(config: DraftConfig, report: Report) -> list:
    """A draft whose Linear layers are ModelOpt-quantized (dspark quantize --scope draft), as vLLM's source reads it:
    - DFlashQwen3Model (vllm/model_executor/models/qwen3_dflash.py @ 036a00d1, the backbone of qwen3_dspark.py @
      0302ff40 and qwen3_dflash2.py) builds qkv_proj, o_proj, the MLP and fc with the draft's own quant_config
      (utils.get_draft_quant_config; vllm/v1/worker/gpu/spec_decode/dspark/utils.py @ 0308cbae load_dspark_model
      sets it), so they load. But its context-K/V precompute, which every draft step and the start-up dummy run go
      through, takes `qkv_proj.weight[q_size:]` of every layer (_build_context_kv_buffers, called at the end of
      load_weights) and multiplies it with F.linear (_project_context_kv), outside the layer's quantization method:
      a packed uint8 (NVFP4) or float8 (FP8) weight against bf16 activations -> DSP731.
    - Qwen3DSparkForCausalLM (and DFlashQwen3ForCausalLM) build the draft's lm_head as ParallelLMHead without a
      quant_config (unlike markov_w2, which gets one), so a quantized lm_head's packed weight and scales have no
      quantized parameters to load into -> DSP732."""
    quant = linear_quantization(config, report)
    if quant is None:
        return []
    found = []
    if quant.covers(*QKV):
        found.append(engine_finding("DSP731", f"{quant.stored}, q/k/v projections among them; vLLM's DFlash backbone "
                                              "(qwen3_dflash.py) multiplies each layer's stored qkv_proj.weight as "
                                              "a dense matrix for the context K/V, outside its quantization "
                                              "method."))
    if quant.names is not None and "lm_head" in quant.names:
        found.append(engine_finding("DSP732", "the lm_head is quantized; vLLM builds the draft's lm_head as an "
                                              "unquantized ParallelLMHead (qwen3_dspark.py, qwen3_dflash.py), so its "
                                              "packed weight and scales do not load."))
    return found


def _quantization(report: Report) -> str:
    head = head_quantization(report)
    if head:
        return (f"markov_w2 {head}: vLLM reads the quantization from the draft's quantization_config "
                "(or hf_quant_config.json); the speculative config leaves 'quantization' unset")
    return "unquantized"


def plain_argv(request: ServeRequest) -> list[str]:
    """`vllm serve TARGET [--port P] [...]`: the target without a draft."""
    argv = [VLLM, "serve", request.target] + ([] if request.port is None else ["--port", str(request.port)])
    return argv + list(request.engine_args)

ENGINE = Engine(name="vllm", label="vLLM", source="vLLM's source files and commits listed in docs/serve.md "
                "(vllm/config/speculative.py SpeculativeConfig, vllm/model_executor/models/qwen3_dspark.py, "
                "qwen3_dflash.py and gemma4_dspark.py)", own_codes=OWN_CODES, plan=plan_serve, rules=rules,
                layout="DeepSpec, SpecForge or speculators (vLLM's adapter maps speculators configs); Qwen3 or "
                "Gemma-4 backbone", reads="the draft and target folders; a survival threshold (from-plan option)",
                installed=lambda: find_vllm() is not None, install_hint=INSTALL_HINT, plain=plain_argv,
                draft_length_setting="num_speculative_tokens", threshold_setting="dspark_confidence_threshold")
