"""Hand a checked target + draft pair to TensorRT-LLM: the `speculative_config` YAML and the `trtllm-serve` argv.

    plan = ENGINE.plan(ServeRequest(target="Qwen/Qwen3-8B", draft="./my-draft"))   # engines.engine("trtllm")
    plan.files   # {"dspark-trtllm.yaml": "speculative_config:\n  decoding_type: DSpark\n  ..."}
    plan.argv    # ["trtllm-serve", T, "--extra_llm_api_options", "<files_dir>/dspark-trtllm.yaml"]

Read from NVIDIA/TensorRT-LLM (docs/engine-trtllm.md):
- tensorrt_llm/_torch/models/modeling_dspark.py @ 008b54fe (module docstring): every `decoding_type: DSpark`
  drafter is built there, embedded (DeepSeek-V4's mtp.*) or standalone; a standalone drafter is
  GQADSparkForCausalLM, DFlash's block decode plus the Markov head, the confidence head and the shift_label
  convention.
- tensorrt_llm/llmapi/llm_args.py, `DSparkDecodingConfig(DecodingBaseConfig)` (a strict model: unknown keys are
  errors), picked from the YAML by `decoding_type: "DSpark"`; `speculative_model` and `max_draft_len` come from
  DecodingBaseConfig. Its `markov_head_type` is `Literal["vanilla", "gated", "rnn"]` @ 00043967 and c319397c. The
  confidence fields differ between stored versions: none @ 00043967 ("intentionally omitted");
  `confidence_sts_path` @ c319397c and 31366260 only together with `enable_confidence_scheduling` and a profiled
  SPS table (`confidence_sps_table_path`, plus a live fingerprint @ c319397c), which its validators require.
- tensorrt_llm/commands/serve.py @ 00209af1: `--config` / `--extra_llm_api_options` take the YAML.
- tensorrt_llm/_torch/models/modeling_dflash.py @ 009d8fa4: DFlashForCausalLM's block decode runs each draft
  layer as attention, o_proj, post-attention norm and MLP, with no grouped convolution, and the file has no
  candidate selector, so a DFlash2 draft would be drafted as another model -> DSP741. Its `load_weights` rebuilds fc
  as a plain nn.Linear of the stored fc.weight's shape and dtype and copies the weight in, and
  `_build_fused_kv_buffers` concatenates every layer's `qkv_proj.weight[q_size : q_size + 2 * kv_size]` for the one
  F.linear of `precompute_context_kv`: quantized q/k/v or fc (dspark quantize --scope draft) are multiplied as dense
  matrices without their scales -> DSP712 (GQADSparkForCausalLM @ 008b54fe is a DFlashForCausalLM and loads through
  it).
Not verified: that a standalone drafter builds gated / rnn heads (the config accepts them); NVFP4 markov_w2; how
speculators configs are mapped; Gemma-4 drafts. Each is a note in the verdict, not a silent "serves".
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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

OWN_FLAGS = ("--extra-llm-api-options", "--config")  # the YAML dspark writes (serve.py's two names)
EXECUTABLE = "trtllm-serve"
CONFIG_FILE = "dspark-trtllm.yaml"
INSTALL_HINT = ("TensorRT-LLM is not installed here (no `trtllm-serve` on PATH): on a CUDA machine run "
                "`pip install tensorrt_llm` (a release with decoding_type DSpark), then run the command above.")
OWN_CODES: frozenset[str] = frozenset()  # llm_args.py accepts every head type vLLM refuses (DSP012): a note below


def rules(config: DraftConfig, report: Report) -> tuple[list[Finding], list[str]]:
    """TensorRT-LLM's own refusal (DSP711) and what it drops or may not serve (unverified ones say so)."""
    findings, notes = [], []
    if config.family == "dflash2":
        findings.append(engine_finding("DSP741", "this is a DFlash2 draft (grouped convolutions and a path "
                                                 "selector)."))
    elif not config.has_markov:
        findings.append(engine_finding("DSP711", "the draft has no Markov head (markov_rank 0 or a DFlash draft)."))
    findings += head_type_finding(ENGINE, config, "DSP726", "llm_args.py DSparkDecodingConfig.markov_head_type, "
                                  "modeling_speculative.py build_markov_head")
    if config.has_markov and config.markov_head_type in ENGINE.markov_heads - {"vanilla"}:
        notes.append(f"{config.markov_head_type} Markov head: TensorRT-LLM's DSparkDecodingConfig accepts it "
                     "(markov_head_type vanilla | gated | rnn); not verified that a standalone drafter builds it.")
    if config.enable_confidence_head:
        notes.append("TensorRT-LLM loads the confidence head; it schedules verification with it only with "
                     "enable_confidence_scheduling and its own profiled SPS table, which dspark does not write.")
    if head_quantization(report):
        notes.append("NVFP4 markov_w2: not verified that a standalone TensorRT-LLM drafter loads it.")
    quant = linear_quantization(config, report)
    if quant is not None and quant.covers(*QKV, ".fc"):
        findings.append(engine_finding("DSP712", f"{quant.stored}, q/k/v projections or fc among them; TensorRT-LLM's "
                                                 "standalone drafter rebuilds fc as a plain nn.Linear from the stored "
                                                 "weight and multiplies each qkv_proj.weight as a dense matrix for the "
                                                 "context K/V (modeling_dflash.py)."))
    elif quant is not None:
        notes.append(f"{quant.stored} (not q/k/v or fc): not verified that a standalone TensorRT-LLM drafter loads "
                     "them quantized.")
    if config.format.startswith("speculators"):
        notes.append("speculators-format config: not verified how TensorRT-LLM maps its block slots.")
    if config.family == "gemma4":
        notes.append("Gemma-4 draft: not verified that TensorRT-LLM builds a standalone Gemma-4 drafter.")
    return findings, notes


def plan_serve(request: ServeRequest) -> ServePlan:
    """validate's header-only rules and TensorRT-LLM's verdict, then the YAML and the `trtllm-serve` argv."""
    refuse_vllm_only_settings(request, ENGINE.label)
    refuse_own_flags(request, ENGINE.label, OWN_FLAGS)
    if request.calibration is not None:
        raise DsparkError("TensorRT-LLM reads an STS file only with enable_confidence_scheduling, which its config "
                          "refuses without a step-cost table profiled by TensorRT-LLM itself (some versions have no "
                          "STS key at all); drop the calibration, or serve with SGLang.")
    pair = checked_pair(request, ENGINE)
    spec = {"decoding_type": "DSpark", "speculative_model": pair.draft,
            "max_draft_len": resolve_block_size(pair.config, request.block_size)}
    config_path = str(Path(request.files_dir) / CONFIG_FILE)
    argv = [EXECUTABLE, pair.target, "--extra_llm_api_options", config_path]
    if request.port is not None:
        argv += ["--port", str(request.port)]
    return ServePlan(target=pair.target, draft=pair.draft, speculative_config=spec,
                     argv=argv + list(request.engine_args), report=pair.report,
                     trained_block_size=trained_block_size(pair.config),
                     draft_quantization=head_quantization(pair.report) or "unquantized",
                     notes=pair.verdict.notes, engine=ENGINE.name, files={CONFIG_FILE: yaml_text(spec)})


def yaml_text(spec: dict) -> str:
    """The extra LLM API options file: one `speculative_config` mapping (JSON scalars are YAML scalars)."""
    lines = ["speculative_config:"] + [f"  {key}: {json.dumps(value)}" for key, value in spec.items()]
    return "\n".join(lines) + "\n"


def find_trtllm() -> str | None:
    return shutil.which(EXECUTABLE)


def plain_argv(request: ServeRequest) -> list[str]:
    """`trtllm-serve TARGET [--port P] [...]`: the target without a draft."""
    refuse_own_flags(request, ENGINE.label, OWN_FLAGS)
    argv = [EXECUTABLE, request.target] + ([] if request.port is None else ["--port", str(request.port)])
    return argv + list(request.engine_args)

ENGINE = Engine(
    name="trtllm", label="TensorRT-LLM", own_codes=OWN_CODES, plan=plan_serve, rules=rules,
    source="NVIDIA/TensorRT-LLM tensorrt_llm/_torch/models/modeling_dspark.py @ 008b54fe, "
           "tensorrt_llm/llmapi/llm_args.py @ 00043967 and c319397c (docs/engine-trtllm.md)",
    layout="a standalone DSpark drafter: DeepSpec-like GQA (Qwen3) backbone with a Markov head",
    reads="the draft and target folders, via the YAML (no STS or step-cost file from dspark)",
    installed=lambda: find_trtllm() is not None, install_hint=INSTALL_HINT,
    markov_heads=frozenset({"vanilla", "gated", "rnn"}),  # llm_args.py Literal, build_markov_head
    plain=plain_argv, draft_length_setting="max_draft_len",
)
