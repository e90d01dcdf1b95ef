"""The registry of validate's codes and the report they end up in.

`CODES` is the single registry: code → (severity, title); docs/validate.md documents each code. Groups:
DSP0xx config, DSP1xx vLLM load errors, DSP2xx tensors, DSP3xx NVFP4, DSP4xx files, DSP5xx read errors (raised
as CheckpointError, exit 2), DSP6xx deep value checks, DSP8xx GGUF files (a llama.cpp `dflash` draft GGUF checked by
rules/gguf.py; DSP801 is its read error, exit 2). `ENGINE_CODES` (DSP7xx) are the restrictions of one serving
engine: evaluated by that engine's module (runtime/engines/), never by `validate_checkpoint` (vLLM's few, DSP73x,
beside the validate codes vLLM's report already carries, such as DSP012).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dspark_cli.runtime.checkpoint.formats import FORMAT_NAMES

ERROR, WARNING, INFO = "error", "warning", "info"

CODES: dict[str, tuple[str, str]] = {
    # config
    "DSP001": (ERROR, "not a DSpark or DFlash draft"),
    "DSP002": (INFO, "DFlash draft: Markov and confidence rules off"),
    "DSP003": (WARNING, "DSpark draft of another model family, checked with the Qwen3 rules"),
    "DSP004": (ERROR, "SpecForge markov_rank only under dflash_config"),
    "DSP005": (WARNING, "SpecForge DSpark key only under dflash_config"),
    "DSP006": (WARNING, "speculators DSpark head served one slot off by older vLLM"),
    "DSP007": (WARNING, "markov_rank 0: DeepSpec's DFlash ablation, not known to be servable by vLLM"),
    "DSP010": (ERROR, "geometry key missing or not a positive integer"),
    "DSP011": (ERROR, "markov_rank missing, negative or not an integer"),
    "DSP012": (ERROR, "markov_head_type is not vanilla (vLLM cannot serve it; dspark runs it)"),
    "DSP013": (ERROR, "block_size is not a positive integer"),
    "DSP014": (WARNING, "no block_size"),
    "DSP015": (ERROR, "no mask token"),
    "DSP016": (ERROR, "mask token id outside the vocabulary"),
    "DSP017": (ERROR, "target_layer_ids missing or malformed"),
    "DSP018": (ERROR, "target_layer_ids not strictly increasing"),
    "DSP019": (ERROR, "target layer id outside the target's depth"),
    "DSP020": (WARNING, "draft_vocab_size larger than the target vocabulary"),
    "DSP021": (WARNING, "confidence head enabled but no confidence_head weights"),
    "DSP022": (WARNING, "confidence_head weights present but the head is not enabled"),
    "DSP023": (WARNING, "confidence_head_with_markov missing"),
    "DSP024": (ERROR, "feature width differs from the target's hidden size"),
    "DSP025": (WARNING, "input vocab smaller than the target vocabulary"),
    "DSP026": (ERROR, "attention heads not divisible by key/value heads"),
    "DSP027": (ERROR, "dspark_draft_topk outside [1, draft_vocab_size]"),
    "DSP028": (ERROR, "sliding-attention layers without a window"),
    "DSP029": (WARNING, "use_aux_hidden_state is false"),
    "DSP030": (INFO, "1+N (bonus-anchor) query layout"),
    "DSP031": (WARNING, "num_target_layers differs from the target's depth"),
    "DSP032": (WARNING, "logit_scale is not a positive number"),
    "DSP033": (ERROR, "dspark_bonus_anchor contradicts the trained query layout"),
    "DSP034": (ERROR, "target_layer_ids include the target's last decoder layer"),
    "DSP035": (ERROR, "config value vLLM's Qwen3 backbone cannot build from"),
    # Gemma-4 drafts (checkpoint/families/gemma4.py: vLLM's gemma4_dspark.py load rules)
    "DSP040": (ERROR, "Gemma-4 draft without its own embed_tokens or lm_head"),
    "DSP041": (ERROR, "Gemma-4 draft with attention_k_eq_v false"),
    "DSP042": (ERROR, "Gemma-4 draft with a reduced draft vocabulary or d2t"),
    "DSP043": (WARNING, "Gemma-4 confidence head not loaded by vLLM"),
    "DSP044": (ERROR, "Gemma-4 draft layer that is not full attention"),
    "DSP045": (ERROR, "Gemma-4 feature DeepSpec and vLLM drafts do not have"),
    "DSP046": (WARNING, "vLLM soft-caps the Gemma-4 Markov bias, DeepSpec does not"),
    "DSP047": (ERROR, "Gemma-4 full-attention geometry not uniform or not stated"),
    "DSP048": (WARNING, "use_sliding_window without sliding layers: runs dense"),
    "DSP049": (INFO, "sliding layers without use_sliding_window: llama.cpp's converter drops the window"),
    # DFlash2 drafts (checkpoint/families/dflash2.py: vLLM's qwen3_dflash2.py and llama.cpp's start-up refusals)
    "DSP060": (ERROR, "DFlash2 key missing from dflash_config or not a positive integer"),
    "DSP061": (ERROR, "DFlash2 hidden size not divisible by conv_group_size"),
    "DSP062": (ERROR, "DFlash2 hidden size below selector_top_k*(selector_top_k+1) (llama.cpp)"),
    "DSP063": (ERROR, "DFlash2 selector_top_k larger than the vocabulary"),
    "DSP064": (WARNING, "DFlash2 key at the top level only"),
    "DSP065": (ERROR, "DFlash2 draft with a Markov head, confidence head or reduced vocabulary"),
    # vLLM load errors
    "DSP100": (INFO, "without the target option: target vocabulary assumed equal to vocab_size"),
    "DSP101": (ERROR, "expanded input vocab without embed_tokens"),
    "DSP102": (ERROR, "reduced draft vocab without lm_head"),
    "DSP103": (ERROR, "reduced draft vocab without d2t"),
    "DSP104": (INFO, "embed_tokens shared from the target"),
    "DSP105": (INFO, "lm_head shared from the target"),
    "DSP106": (ERROR, "d2t shipped with a full draft vocabulary"),
    # tensors
    "DSP201": (ERROR, "required tensor missing"),
    "DSP202": (ERROR, "tensor has the wrong shape"),
    "DSP203": (ERROR, "weight with a non-floating dtype"),
    "DSP204": (WARNING, "d2t is not an integer tensor"),
    "DSP205": (ERROR, "tensor vLLM has no parameter for"),
    "DSP206": (INFO, "t2d is ignored by vLLM"),
    "DSP207": (INFO, "mask_embedding is ignored by vLLM"),
    "DSP208": (INFO, "DFlash alias tensor names"),
    "DSP209": (ERROR, "tensor names carry a model. prefix"),
    "DSP210": (ERROR, "bias vLLM has no parameter for (a load error, or dropped)"),
    "DSP211": (ERROR, "DFlash2 conv or selector tensors in a draft that is not DFlash2"),
    # NVFP4
    "DSP301": (ERROR, "NVFP4 packed weight has the wrong dtype or shape"),
    "DSP302": (ERROR, "NVFP4 weight_scale missing or wrong"),
    "DSP303": (ERROR, "NVFP4 weight_scale_2 missing or wrong"),
    "DSP304": (ERROR, "NVFP4 input features not a multiple of 16"),
    "DSP305": (WARNING, "NVFP4 input features not a multiple of 64 (Marlin)"),
    "DSP306": (ERROR, "NVFP4 tensors without a quantization config"),
    "DSP307": (ERROR, "quantization config vLLM cannot parse"),
    "DSP308": (ERROR, "NVFP4 layer not marked W4A16_NVFP4 by the quantization config"),
    "DSP309": (WARNING, "hf_quant_config.json differs from config.json (vLLM ignores it)"),
    "DSP310": (ERROR, "layer claimed quantized but stored unquantized"),
    "DSP311": (ERROR, "W4A4 NVFP4 layer without input_scale"),
    "DSP312": (WARNING, "quantization config only in hf_quant_config.json"),
    "DSP313": (WARNING, "quantization config is not ModelOpt's"),
    "DSP314": (INFO, "NVFP4 W4A16 head"),
    "DSP315": (ERROR, "input_scale beside a W4A16 layer"),
    "DSP316": (ERROR, "FP8 weight has the wrong shape"),
    "DSP317": (ERROR, "FP8 weight_scale missing or wrong"),
    "DSP318": (ERROR, "FP8 input_scale missing or wrong"),
    "DSP319": (ERROR, "FP8 layer not marked FP8 by the quantization config"),
    # files
    "DSP401": (WARNING, "pickle weight file (never loaded)"),
    "DSP402": (ERROR, "tensor present in two shards"),
    "DSP403": (WARNING, "index and shard headers disagree"),
    "DSP404": (WARNING, "safetensors file not named by the index"),
    # deep (tensor values)
    "DSP601": (ERROR, "NaN or Inf values"),
    "DSP602": (WARNING, "all-zero weight matrix"),
    "DSP603": (ERROR, "d2t maps outside the target vocabulary"),
    "DSP604": (ERROR, "d2t maps two draft ids to one target id"),
    "DSP605": (ERROR, "NVFP4 block scales not finite and non-negative"),
    "DSP606": (ERROR, "NVFP4 weight_scale_2 not finite and positive"),
    "DSP607": (WARNING, "untrained norm (every element exactly 1, or all equal)"),
    "DSP608": (ERROR, "the probe: acceptance near zero, decoding slower with this draft"),
    "DSP609": (ERROR, "FP8 weight_scale or input_scale not finite and positive"),
    # GGUF files (rules/gguf.py: what llama.cpp b11434 reads from a dflash draft GGUF)
    "DSP802": (ERROR, "GGUF architecture is not dflash"),
    "DSP803": (ERROR, "GGUF key llama.cpp requires missing"),
    "DSP804": (ERROR, "GGUF tensor llama.cpp requires missing or of another shape"),
    "DSP805": (ERROR, "GGUF block size missing or not positive (llama.cpp drafts 16)"),
    "DSP806": (ERROR, "GGUF target layers malformed or without the +1"),
    "DSP807": (ERROR, "GGUF draft does not fit the target's depth or width"),
    "DSP808": (ERROR, "GGUF target layers differ from the converted folder's plus one"),
    "DSP809": (WARNING, "GGUF without sample_from_anchor (llama.cpp assumes true)"),
    "DSP810": (ERROR, "GGUF mask token missing or outside the vocabulary"),
    "DSP811": (ERROR, "GGUF vocabulary differs from the target's"),
    "DSP812": (ERROR, "GGUF window keys a runtime would miss or refuse"),
    "DSP813": (ERROR, "GGUF Markov or confidence tensor of an integer type"),
    "DSP814": (WARNING, "GGUF has_confidence_head contradicts its tensors"),
}

# Restrictions of one serving engine (runtime/engines/<engine>.py evaluates them on a sound draft): code -> (engine
# label, title, hint). Always errors for that engine only; dspark's own runtime serves such a draft.
ENGINE_CODES: dict[str, tuple[str, str, str]] = {
    "DSP701": ("SGLang", "speculators-layout DSpark config (SGLang refuses it: slot shift)",
               "serve it with vLLM, or convert the draft to DeepSpec's layout (slot k predicts anchor+k+1)"),
    "DSP702": ("SGLang", "quantized Markov head (SGLang's markov_w2 is an unquantized nn.Linear)",
               "serve the unquantized draft (before dspark quantize) with SGLang, or the NVFP4 one with vLLM"),
    "DSP703": ("SGLang", "reduced draft vocabulary (SGLang drops the draft's lm_head and sizes markov_w2 to the "
               "target vocabulary)", "serve it with vLLM, or train a full-vocabulary draft"),
    "DSP704": ("SGLang", "draft without a Markov head (SGLang's DSPARK algorithm requires markov_rank > 0)",
               "serve a DFlash draft with vLLM (method dflash)"),
    "DSP705": ("SGLang", "quantized q/k/v projections (SGLang's DFlash layers build qkv_proj unquantized)",
               "serve the unquantized draft (before dspark quantize), or convert the quantized one for llama.cpp"),
    "DSP711": ("TensorRT-LLM", "draft without a Markov head (dspark hands TensorRT-LLM DSpark drafts only)",
               "serve a DFlash draft with vLLM (method dflash)"),
    "DSP712": ("TensorRT-LLM", "quantized q/k/v projections or fc (its standalone drafter multiplies them as dense "
               "matrices)", "serve the unquantized draft (before dspark quantize), or convert the quantized one for "
               "llama.cpp"),
    "DSP741": ("TensorRT-LLM", "DFlash2 draft (TensorRT-LLM's DFlash drafter has no grouped convolution or path "
               "selector)", "serve it with vLLM (method dflash), SGLang (DFLASH) or llama.cpp (draft-dflash)"),
    "DSP721": ("llama.cpp", "draft backbone other than Qwen3 (llama.cpp's dflash model and its converter are "
               "Qwen3's)", "serve it with vLLM"),
    "DSP722": ("llama.cpp", "quantized Markov head (llama.cpp's dflash model reads no NVFP4 block scales)",
               "convert and serve the unquantized draft (before dspark quantize)"),
    "DSP723": ("llama.cpp", "draft without a Markov head (llama.cpp runs it as a DFlash draft, spec type "
               "draft-dflash, which dspark does not plan)", "serve it with vLLM (method dflash)"),
    "DSP724": ("llama.cpp", "confidence head reading the hidden state alone (llama.cpp's conf_proj reads the hidden "
               "and the Markov state; dspark convert refuses it)", "train the confidence head with "
               "confidence_head_with_markov (dspark train's default), or serve with vLLM"),
    "DSP727": ("llama.cpp", "draft layers differing in causality (llama.cpp reads one dflash.attention.causal flag for "
               "the whole draft; dspark convert refuses it)", "set is_causal (or dflash_config.causal) so that every "
               "layer is alike, or serve with vLLM"),
    "DSP725": ("SGLang", "Markov head type SGLang does not build (vanilla, gated, rnn), or none where SGLang reads "
               "markov_head_type", "write markov_head_type (vanilla, gated or rnn) at the top level of config.json, "
               "as DeepSpec does"),
    "DSP726": ("TensorRT-LLM", "Markov head type TensorRT-LLM does not build (vanilla, gated, rnn)",
               "retrain with a vanilla, gated or rnn Markov head"),
    "DSP731": ("vLLM", "quantized q/k/v projections (vLLM's DFlash backbone multiplies qkv_proj.weight as a dense "
               "matrix for the context K/V)", "serve the unquantized draft (before dspark quantize); the quantized "
               "one runs in dspark's own runtime, and as a dequantized GGUF in llama.cpp"),
    "DSP732": ("vLLM", "quantized lm_head (vLLM builds the draft's lm_head unquantized)",
               "quantize without the lm-head option (the lm_head stays bf16)"),
}

# Raised as CheckpointError (exit code 2) by checkpoint/read.py, rules/context.py (DSP512) and rules/deep.py (DSP514).
READ_ERRORS: dict[str, str] = {
    "DSP500": "not a folder, config file or hub id",
    "DSP501": "file missing or unreadable",
    "DSP502": "JSON file invalid or not an object",
    "DSP503": "safetensors header malformed",
    "DSP504": "unknown safetensors dtype",
    "DSP505": "overlapping tensors",
    "DSP506": "tensor data beyond the end of the file (truncated)",
    "DSP507": "no .safetensors weights",
    "DSP508": "index without a valid weight_map",
    "DSP509": "index names a shard outside the checkpoint folder",
    "DSP510": "index names a missing shard",
    "DSP511": "hub checkpoint unavailable",
    "DSP512": "target config lacks vocab_size, hidden_size or num_hidden_layers",
    "DSP513": "safetensors data section with gaps or trailing bytes",
    "DSP514": "tensor data could not be loaded (the deep option)",
    "DSP801": "GGUF file malformed or truncated",
}


@dataclass(frozen=True)
class Finding:
    code: str  # stable, e.g. "DSP012"
    severity: str  # "error" | "warning" | "info"
    message: str  # one sentence naming the key or tensor
    hint: str  # what to do about it

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class SkippedCheck:
    check: str  # the codes or rule group not run
    reason: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class Report:
    source: str
    format: str  # a key of formats.FORMAT_NAMES
    findings: list[Finding] = field(default_factory=list)
    skipped: list[SkippedCheck] = field(default_factory=list)
    resolved: dict[str, Any] = field(default_factory=dict)  # values as vLLM would resolve them
    deep: bool = False

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == WARNING]

    @property
    def infos(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == INFO]

    @property
    def codes(self) -> list[str]:
        return [f.code for f in self.findings]

    def exit_code(self, strict: bool = False) -> int:
        """0: loadable; 1: errors (or warnings with strict)."""
        return 1 if self.errors or (strict and self.warnings) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": self.source,
            "format": self.format,
            "format_name": FORMAT_NAMES[self.format],
            "deep": self.deep,
            "summary": {"errors": len(self.errors), "warnings": len(self.warnings), "info": len(self.infos)},
            "resolved": self.resolved,
            "findings": [f.to_dict() for f in self.findings],
            "skipped": [s.to_dict() for s in self.skipped],
        }


class Results(list):
    """What one rule returns: its findings and skipped checks, in the order it made them."""

    def add(self, code: str, message: str, hint: str) -> None:
        self.append(Finding(code, CODES[code][0], message, hint))

    def skip(self, check: str, reason: str) -> None:
        self.append(SkippedCheck(check, reason))


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors, then warnings, then infos; by code within a severity; a code's findings keep the rules' order."""
    order = {ERROR: 0, WARNING: 1, INFO: 2}
    return sorted(findings, key=lambda f: (order[f.severity], f.code))
