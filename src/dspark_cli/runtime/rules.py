"""Validation rules for draft checkpoints: every way vLLM can fail to load (or silently mis-serve) a DSpark draft.

`validate_checkpoint(ckpt, target_config, deep)` reads only what `open_checkpoint` already parsed (config.json,
hf_quant_config.json, safetensors headers); `deep=True` additionally loads tensors one at a time. Every finding has
a stable code; `CODES` is the registry (severity + title) and docs/validate.md documents each code. Groups:
DSP0xx config, DSP1xx vLLM load errors, DSP2xx tensors, DSP3xx NVFP4, DSP4xx files, DSP5xx read errors (raised
as CheckpointError, exit 2), DSP6xx deep value checks.
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dspark_cli.runtime.checkpoint import (
    DFLASH_ALIASES,
    IGNORED_BY_VLLM,
    MARKOV_W2,
    NVFP4_SUFFIXES,
    Checkpoint,
    CheckpointError,
    ExpectedTensor,
    LinearModule,
    TensorInfo,
    expected_draft_tensors,
    linear_modules,
)
from dspark_cli.runtime.config import (
    FORMAT_NAMES,
    GEOMETRY_KEYS,
    MASK_TOKEN_KEYS,
    DraftConfig,
    TargetConfig,
)

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
    "DSP012": (ERROR, "markov_head_type is not vanilla"),
    "DSP013": (ERROR, "block_size is not a positive integer"),
    "DSP014": (WARNING, "no block_size"),
    "DSP015": (ERROR, "no mask token"),
    "DSP016": (ERROR, "mask token id outside the vocabulary"),
    "DSP017": (ERROR, "target_layer_ids missing or malformed"),
    "DSP018": (ERROR, "target_layer_ids not strictly increasing"),
    "DSP019": (ERROR, "target layer id outside the target's depth"),
    "DSP020": (ERROR, "draft_vocab_size larger than the target vocabulary"),
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
    # vLLM load errors (dspark-format.md §1.3)
    "DSP100": (INFO, "no --target: target vocabulary assumed equal to vocab_size"),
    "DSP101": (ERROR, "expanded input vocab without embed_tokens"),
    "DSP102": (ERROR, "reduced draft vocab without lm_head"),
    "DSP103": (ERROR, "reduced draft vocab without d2t"),
    "DSP104": (INFO, "embed_tokens shared from the target"),
    "DSP105": (INFO, "lm_head shared from the target"),
    "DSP106": (WARNING, "d2t shipped with a full draft vocabulary"),
    # tensors (dspark-format.md §1.2)
    "DSP201": (ERROR, "required tensor missing"),
    "DSP202": (ERROR, "tensor has the wrong shape"),
    "DSP203": (ERROR, "weight with a non-floating dtype"),
    "DSP204": (ERROR, "d2t is not int64"),
    "DSP205": (WARNING, "unexpected tensor"),
    "DSP206": (INFO, "t2d is ignored by vLLM"),
    "DSP207": (INFO, "mask_embedding is ignored by vLLM"),
    "DSP208": (INFO, "DFlash alias tensor names"),
    "DSP209": (ERROR, "tensor names carry a model. prefix"),
    # NVFP4 (nvfp4.md §4-5)
    "DSP301": (ERROR, "NVFP4 packed weight has the wrong dtype or shape"),
    "DSP302": (ERROR, "NVFP4 weight_scale missing or wrong"),
    "DSP303": (ERROR, "NVFP4 weight_scale_2 missing or wrong"),
    "DSP304": (ERROR, "NVFP4 input features not a multiple of 16"),
    "DSP305": (WARNING, "NVFP4 input features not a multiple of 64 (Marlin)"),
    "DSP306": (ERROR, "NVFP4 tensors without a quantization config"),
    "DSP307": (ERROR, "quantization config vLLM cannot parse"),
    "DSP308": (ERROR, "NVFP4 layer not marked W4A16_NVFP4 by the quantization config"),
    "DSP309": (ERROR, "config.json and hf_quant_config.json disagree"),
    "DSP310": (ERROR, "layer claimed quantized but stored unquantized"),
    "DSP311": (ERROR, "W4A4 NVFP4 layer without input_scale"),
    "DSP312": (WARNING, "quantization config only in hf_quant_config.json"),
    "DSP313": (WARNING, "quantization config is not ModelOpt's"),
    "DSP314": (INFO, "NVFP4 W4A16 head"),
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
}

# Raised by checkpoint.py / this module as CheckpointError: the input could not be read (exit code 2).
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
    "DSP514": "tensor data could not be loaded (--deep)",
}

VLLM_QUANT_ALGOS = {"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION"}
MIXED_LAYER_ALGOS = {"FP8", "NVFP4", "W4A16_NVFP4"}
NVFP4_GROUP = 16
MARLIN_K_MULTIPLE = 64
FLOAT_MATRIX_DTYPES = {"F16", "BF16", "F32", "F64"}
MAX_DRAFT_LAYERS = 256  # DeepSpec drafts have 5; a larger count is a corrupt config, not a draft


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
    format: str  # a key of config.FORMAT_NAMES
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


def validate_checkpoint(ckpt: Checkpoint, target_config: dict | None = None, deep: bool = False) -> Report:
    """Run every rule on an opened checkpoint; `target_config` is the target's config.json (vocab, width, depth)."""
    target = _target(target_config)
    return _Validation(ckpt, target, deep).run()


def _target(raw: dict | None) -> TargetConfig | None:
    if raw is None:
        return None
    target = TargetConfig.from_dict(raw)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if getattr(target, k) is None]
    if missing:
        raise CheckpointError(
            "DSP512", f"the --target config has no positive {', '.join(missing)}; pass the target causal LM's folder."
        )
    return target


# --- quantization config as vLLM reads it (nvfp4.md §4.2, §5) ----------------------------------------------------


@dataclass
class QuantConfig:
    where: str  # "config.json quantization_config" or "hf_quant_config.json"
    method: str | None
    algo: str | None  # upper-cased
    group_size: Any
    exclude: list[str]
    layers: dict[str, dict[str, Any]]  # quantized_layers (MIXED_PRECISION)
    problems: list[str]  # why vLLM would refuse it


def _config_json_quant(raw: Any) -> QuantConfig:
    where = "config.json quantization_config"
    if not isinstance(raw, dict):
        return QuantConfig(where, None, None, None, [], {}, ["it is not a JSON object"])
    group = raw.get("group_size")
    for group_config in _dict(raw.get("config_groups")).values():
        weights = _dict(_dict(group_config).get("weights"))
        if group is None and "group_size" in weights:
            group = weights["group_size"]
    exclude = raw.get("ignore", raw.get("exclude_modules"))
    quant = _quant(where, raw.get("quant_method"), raw.get("quant_algo"), group, exclude, raw.get("quantized_layers"))
    if quant.method is None:
        quant.problems.append("quant_method is missing; vLLM needs 'modelopt'")
    return quant


def _legacy_quant(raw: dict[str, Any]) -> QuantConfig:
    where = "hf_quant_config.json"
    section = raw.get("quantization")
    if not isinstance(section, dict):
        return QuantConfig(where, None, None, None, [], {}, ["it has no 'quantization' object"])
    method = "modelopt" if _dict(raw.get("producer")).get("name") == "modelopt" else None
    quant = _quant(where, method, section.get("quant_algo"), section.get("group_size"),
                   section.get("exclude_modules"), section.get("quantized_layers"))  # fmt: skip
    if method is None:
        quant.problems.append("its producer is not modelopt, so vLLM does not read it as a ModelOpt config")
    if quant.algo and "FP4" in quant.algo:  # vLLM's NVFP4 family
        missing = [k for k in ("group_size", "kv_cache_quant_algo", "exclude_modules") if k not in section]
        if missing:
            quant.problems.append(
                f"vLLM raises 'NVFP4 quantization requires the following fields in hf_quant_config.json: {missing}'"
            )
    return quant


def _quant(where: str, method: Any, algo: Any, group: Any, exclude: Any, layers: Any) -> QuantConfig:
    problems: list[str] = []
    algo_name = algo.upper() if isinstance(algo, str) else None
    if algo is None:
        problems.append("vLLM raises \"Missing 'quant_algo' in quantization config\"")
    elif algo_name not in VLLM_QUANT_ALGOS:
        problems.append(f"quant_algo {algo!r} is not one vLLM's ModelOpt loader accepts ({sorted(VLLM_QUANT_ALGOS)})")
    if exclude is not None and not (isinstance(exclude, list) and all(isinstance(e, str) for e in exclude)):
        problems.append("the exclusion list (ignore / exclude_modules) is not a list of strings")
        exclude = None
    if algo_name and "FP4" in algo_name and group not in (None, NVFP4_GROUP):
        problems.append(f"group_size is {group!r}; NVFP4 needs 16")
    clean_layers: dict[str, dict[str, Any]] = {}
    if algo_name == "MIXED_PRECISION":
        if not isinstance(layers, dict) or not layers:
            problems.append("MIXED_PRECISION needs a non-empty quantized_layers object")
        else:
            for key, entry in layers.items():
                layer_algo = entry.get("quant_algo") if isinstance(entry, dict) else None
                if not isinstance(layer_algo, str) or layer_algo.upper() not in MIXED_LAYER_ALGOS:
                    problems.append(f"quantized_layers[{key!r}] has quant_algo {layer_algo!r}, which vLLM leaves "
                                    "unquantized (it accepts FP8, NVFP4, W4A16_NVFP4)")  # fmt: skip
                    continue
                layer_group = entry.get("group_size", NVFP4_GROUP)
                if "NVFP4" in layer_algo.upper() and layer_group != NVFP4_GROUP:
                    problems.append(f"quantized_layers[{key!r}] has group_size {layer_group!r}; NVFP4 needs 16")
                clean_layers[key] = {"quant_algo": layer_algo.upper(), "group_size": layer_group}
    return QuantConfig(where, method if isinstance(method, str) else None, algo_name, group, list(exclude or []),
                       clean_layers, problems)  # fmt: skip


def _is_excluded(prefixes: tuple[str, ...], patterns: list[str]) -> bool:
    """vLLM's is_layer_excluded: exact, substring, then fnmatch; a trailing `x*` also means `x` and `x.*`."""
    expanded: list[str] = []
    for pattern in patterns:
        expanded += [pattern[:-1], pattern[:-1] + ".*"] if pattern.endswith("*") and len(pattern) > 1 else [pattern]
    return any(p == c or (p and p in c) or fnmatch.fnmatchcase(c, p) for p in expanded for c in prefixes)


def _claimed_algo(module: LinearModule, quant: QuantConfig) -> str | None:
    """The algorithm vLLM would quantize this layer with, or None when it stays unquantized."""
    prefixes = (module.prefix, *module.shard_prefixes)
    if _is_excluded(prefixes, quant.exclude):
        return None
    if quant.algo != "MIXED_PRECISION":
        return quant.algo
    for key, entry in quant.layers.items():
        key = "lm_head" if key.endswith(".lm_head") else key
        if key in prefixes or key.startswith(module.prefix + "."):
            return entry["quant_algo"]
    return None


# --- the rules ----------------------------------------------------------------------------------------------------


class _Validation:
    def __init__(self, ckpt: Checkpoint, target: TargetConfig | None, deep: bool):
        self.ckpt = ckpt
        self.config = DraftConfig.from_dict(ckpt.config)
        self.target = target
        self.report = Report(source=ckpt.source, format=self.config.format, deep=deep)
        self.on_disk = ckpt.tensors  # on-disk name -> info
        self.tensors: dict[str, TensorInfo] = {}  # canonical name (vLLM's renames applied) -> info
        self.nvfp4_weights: set[str] = set()  # Linear weights stored as NVFP4 (uint8)
        self.quant: QuantConfig | None = None  # the quantization config vLLM would use, if it can parse it
        self.foreign_quant = False  # a non-ModelOpt quantization config (not checked)
        self.head_claim: str | None = None  # the algorithm vLLM would give markov_w2

    # -- plumbing --

    def add(self, code: str, message: str, hint: str) -> None:
        self.report.findings.append(Finding(code, CODES[code][0], message, hint))

    def skip(self, check: str, reason: str) -> None:
        self.report.skipped.append(SkippedCheck(check, reason))

    @property
    def target_vocab(self) -> int | None:
        return self.target.vocab_size if self.target else self.config.vocab_size

    def run(self) -> Report:
        self.check_files()
        self.canonical_names()
        if self.check_format():
            geometry_ok = self.check_geometry()
            if not geometry_ok:  # per-layer rules need a trustworthy layer count
                self.config = replace(self.config, num_hidden_layers=0)
            self.check_dspark_keys()
            self.check_block_mask_layers()
            self.check_target()
            self.check_confidence_flags()
            self.check_load_errors()
            self.find_nvfp4_weights()
            if geometry_ok:
                self.check_tensors()
            else:
                self.skip("DSP201-DSP205", "the config's geometry is incomplete (see DSP010)")
            self.check_quantization(geometry_ok)
        if self.report.deep:
            self.check_values()
        else:
            self.skip("DSP601-DSP606", "tensor values are checked only with --deep")
        self.resolve()
        order = {ERROR: 0, WARNING: 1, INFO: 2}
        self.report.findings.sort(key=lambda f: (order[f.severity], f.code))
        return self.report

    # -- files (DSP4xx) --

    def check_files(self) -> None:
        for name in self.ckpt.pickle_files:
            self.add("DSP401", f"{name} is a pickle file; dspark never loads it, because unpickling can run code.",
                     "Delete it or convert it to safetensors; vLLM loads the .safetensors weights.")
        seen: dict[str, str] = {}
        for file, infos in self.ckpt.shards.items():
            for name in infos:
                if name in seen:
                    self.add("DSP402", f"tensor {name!r} is in both {seen[name]} and {file}.",
                             "Re-save the checkpoint so every tensor is stored once.")
                else:
                    seen[name] = file
        if self.ckpt.index is not None:
            self.check_index()

    def check_index(self) -> None:
        weight_map: dict[str, str] = self.ckpt.index.get("weight_map", {})
        for name, file in sorted(weight_map.items()):
            if name in self.ckpt.shards.get(file, {}):
                continue
            holders = [f for f, infos in self.ckpt.shards.items() if name in infos]
            where = f"it is in {holders[0]}" if holders else "no shard holds it"
            self.add("DSP403", f"the index maps {name!r} to {file}, but {where}.",
                     "Regenerate model.safetensors.index.json from the shards (or re-download the checkpoint).")
        for file, infos in self.ckpt.shards.items():
            for name in sorted(set(infos) - set(weight_map)):
                self.add("DSP403", f"tensor {name!r} in {file} is missing from the index's weight_map.",
                         "Regenerate model.safetensors.index.json from the shards.")
        listed = set(weight_map.values())
        for name in self.ckpt.files:
            if name.endswith(".safetensors") and name not in listed:
                self.add("DSP404", f"{name} is not named by model.safetensors.index.json, so vLLM ignores it.",
                         "Remove the stray file, or add its tensors to the index if they belong to the draft.")

    def canonical_names(self) -> None:
        prefixed = [n for n in self.on_disk if n.startswith("model.")]
        if prefixed:
            self.add("DSP209", f"{len(prefixed)} tensor names start with 'model.' (e.g. {prefixed[0]!r}); vLLM "
                     "prepends 'model.' itself and would look for 'model.model.*'.",
                     "Save the draft's state dict without the 'model.' prefix (DeepSpec's naming).")
        aliased = []
        for name, info in self.on_disk.items():
            canonical = name.removeprefix("model.")
            for old, new in DFLASH_ALIASES:
                if canonical.startswith(old):
                    canonical = new + canonical[len(old):]
                    aliased.append(name)
            self.tensors[canonical] = info
        if aliased:
            self.add("DSP208", f"{len(aliased)} tensors use DFlash alias names (e.g. {aliased[0]!r}) that vLLM "
                     "renames to layers.0.* / fc.* / hidden_norm.* on load.",
                     "Nothing to do; they are checked under the vLLM names.")
        for name in self.tensors:
            if name.startswith("t2d"):
                self.add("DSP206", f"tensor {name!r} is skipped by vLLM (training-only target-to-draft map).",
                         "Nothing to do; vLLM uses d2t.")
            elif name == "mask_embedding" or name.startswith("mask_embedding."):
                self.add("DSP207", f"tensor {name!r} is dropped by vLLM (DSpark masks via the mask token's "
                         "embedding row).",
                         "Nothing to do, unless the draft was trained with a learned mask embedding.")

    # -- config (DSP0xx) --

    def check_format(self) -> bool:
        """False when the checkpoint is not a draft these rules apply to (the config rules are then skipped)."""
        fmt, archs = self.config.format, self.ckpt.config.get("architectures")
        if fmt == "unknown":
            self.add("DSP001", f"config.json architectures {archs!r} is not a DSpark or DFlash draft.",
                     "Pass the draft checkpoint (architectures Qwen3DSparkModel or DFlashDraftModel), not the target.")
        elif fmt == "deepseek-v4":
            self.add("DSP001", f"config.json describes a DeepSeek-V4 DSpark drafter ({archs!r}, model_type "
                     f"{self.ckpt.config.get('model_type')!r}), which dspark does not validate.",
                     "dspark validates Qwen3-style DSpark and DFlash drafts; DeepSeek-V4 ships its drafter inside "
                     "the target checkpoint.")
        else:
            if self.config.kind == "dflash":
                self.add("DSP002", f"this is a DFlash draft ({FORMAT_NAMES[fmt]}) without a Markov head, so the "
                         "Markov and confidence rules are off.",
                         "Serve it with method 'dflash' and num_speculative_tokens = block_size - 1.")
                self.skip("DSP011, DSP012, DSP021-DSP023", "a DFlash draft has no Markov or confidence head")
            if fmt == "other-dspark":
                self.add("DSP003", f"{self.config.architecture} is a DSpark draft of another model family; it is "
                         "checked with the Qwen3 rules, which may not fit it.", "Treat findings about tensor "
                         "names and shapes with care; the config rules still apply.")
            return True
        self.skip("DSP002-DSP314", "the checkpoint is not a DSpark or DFlash draft (DSP001)")
        return False

    def check_geometry(self) -> bool:
        """DSP010 per bad key; True when the tensor shapes can be derived from the config."""
        view, ok = self.config.vllm_config, True
        derived = {"num_key_value_heads", "head_dim", "target_hidden_size", "draft_vocab_size"}  # have defaults
        for key in (*GEOMETRY_KEYS, "target_hidden_size", "draft_vocab_size"):
            value = view.get(key)
            if _positive_int(value) or (value is None and key in derived):
                continue
            what = "is missing" if value is None else f"is {value!r}"
            nested = self.config.format.startswith("speculators") and key in GEOMETRY_KEYS
            where = f"transformer_layer_config.{key}" if nested else key
            self.add("DSP010", f"config.json key {where!r} {what}; it must be a positive integer.",
                     "Copy it from the config the draft was trained with (DeepSpec copies the target's).")
            ok = False
        layers = self.config.num_hidden_layers
        if layers and layers > MAX_DRAFT_LAYERS:
            self.add("DSP010", f"config.json key 'num_hidden_layers' is {layers}, more than the {MAX_DRAFT_LAYERS} "
                     "draft layers dspark checks (DeepSpec drafts have 5).", "Set it to the number of draft layers.")
            ok = False
        heads, kv = self.config.num_attention_heads, self.config.num_key_value_heads
        if heads and kv and heads % kv:
            self.add("DSP026", f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}.",
                     "Fix the head counts; grouped-query attention needs each key/value head to serve whole groups.")
        return ok and self.config.head_dim is not None

    def check_dspark_keys(self) -> None:
        config, view = self.config, self.config.vllm_config
        if config.kind != "dspark":
            return
        if "markov_rank" in config.nested_only:
            self.add("DSP004", "markov_rank is only under dflash_config (SpecForge layout); vLLM reads it from the "
                     "top level unconditionally and fails.", "Hoist markov_rank, markov_head_type, "
                     "enable_confidence_head and confidence_head_with_markov to the top level and set "
                     "architectures to ['Qwen3DSparkModel'] (SpecForge's normalize_dflash_export does this).")
        for key in config.nested_only:
            if key != "markov_rank":
                self.add("DSP005", f"{key} is only under dflash_config (SpecForge layout); vLLM reads it from the "
                         "top level and uses its default instead.", f"Copy dflash_config.{key} to the top level.")
        if config.format == "speculators-dspark" and config.sample_from_anchor:
            self.add("DSP006", "this speculators DSpark head uses sample_from_anchor; vLLM releases before PR "
                     "#48639 (e.g. 0.26) hard-code the bonus-anchor layout and serve it one slot off, silently.",
                     "Serve it with a vLLM that includes PR #48639, or convert it to DeepSpec's format.")
        rank = view.get("markov_rank")
        if rank == 0 and type(rank) is int:
            self.add("DSP007", "markov_rank is 0: this is DeepSpec's DFlash ablation (the DSpark layout without a "
                     "Markov head), as `dspark train --markov-rank 0` writes it; dspark generate runs it, but vLLM's "
                     "dspark method always builds a Markov head of markov_rank and is not known to serve rank 0.",
                     "Use it for comparisons and with dspark generate; to serve with vLLM, train a Markov head "
                     "(markov_rank > 0).")
            self.skip("DSP011", "markov_rank is 0: there is no Markov head")
        elif "markov_rank" not in config.nested_only and not _positive_int(rank):
            what = "is missing" if rank is None else f"is {rank!r}"
            self.add("DSP011", f"config.json key 'markov_rank' {what}; vLLM reads it unconditionally and needs a "
                     "positive integer.", "Set markov_rank to the rank of markov_head.markov_w1/markov_w2 (e.g. 256).")
        if config.markov_head_type not in (None, "vanilla"):
            self.add("DSP012", f"markov_head_type is {config.markov_head_type!r}; vLLM implements only 'vanilla' "
                     "(first-order) Markov heads.", "Retrain with markov_head_type 'vanilla'; gated and rnn heads "
                     "cannot be served by vLLM.")
        if not config.sample_from_anchor:
            self.add("DSP030", "the draft uses the 1+N query layout (sample_from_anchor false / dspark_bonus_anchor "
                     "true): mask slot j predicts the token at its own position.", "Make sure it was trained that "
                     "way; serving a checkpoint in the wrong layout shifts every proposal by one position.")
        topk = view.get("dspark_draft_topk")
        vd = config.draft_vocab_size
        if topk is not None and not (_positive_int(topk) and (vd is None or topk <= vd)):
            self.add("DSP027", f"dspark_draft_topk is {topk!r}; vLLM needs 1 <= k <= draft_vocab_size ({vd}).",
                     "Set it inside that range or remove it.")

    def check_block_mask_layers(self) -> None:
        config, view = self.config, self.config.vllm_config
        block = config.block_size
        if block.source is None:
            self.add("DSP014", "config.json has no block_size; the trained block length is unknown.",
                     "Add block_size (DeepSpec's Qwen3 drafts use 7) and pass the same num_speculative_tokens to vLLM.")
        elif not _positive_int(block.value):
            self.add("DSP013", f"{block.source} is {_lookup(view, block.source)!r}; it must be a positive integer.",
                     "Set it to the block length the draft was trained with.")
        self.check_mask()
        self.check_layer_ids()
        types = view.get("layer_types")
        if isinstance(types, list) and "sliding_attention" in types:
            dflash = _dict(view.get("dflash_config"))
            if not (dflash.get("swa_window_size") or view.get("sliding_window")):
                self.add("DSP028", "layer_types has sliding_attention layers but no window size; vLLM raises "
                         "'DFlash sliding attention requires a window size configured in "
                         "dflash_config.swa_window_size or the top-level sliding_window'.",
                         "Set sliding_window (or dflash_config.swa_window_size), or make every layer full_attention.")
        if not config.use_aux_hidden_state:
            self.add("DSP029", "use_aux_hidden_state is false: vLLM builds no fc, drops fc.* and uses only the "
                     "target's last hidden state as context.", "Remove the key unless the draft was trained that way.")

    def check_mask(self) -> None:
        mask = self.config.mask_token
        if mask.source is None:
            self.add("DSP015", "config.json names no mask token; vLLM fails because the model config must specify "
                     f"one of dflash_config.mask_token_id, {', '.join(MASK_TOKEN_KEYS)} for parallel drafting.",
                     "Add mask_token_id (DeepSpec's Qwen3 drafts use 151669).")
            return
        vocab, target_vocab = self.config.vocab_size, self.target.vocab_size if self.target else None
        bounds = [v for v in (vocab, target_vocab) if v]
        if not _nonneg_int(mask.value) or any(mask.value >= v for v in bounds):
            raw = _lookup(self.config.vllm_config, mask.source)
            limit = min(bounds) if bounds else "vocab_size"
            self.add("DSP016", f"{mask.source} is {raw!r}; it must be a token id in [0, {limit}).",
                     "Use the id of the tokenizer's mask/pad token that the draft was trained with.")

    def check_layer_ids(self) -> None:
        ids = self.config.target_layer_ids
        if ids.value is None or not ids.value:
            raw = _lookup(self.config.vllm_config, ids.source) if ids.source else None
            what = "is missing" if ids.source is None else f"{ids.source} is {raw!r}"
            self.add("DSP017", f"target_layer_ids {what}; it must be a non-empty list of target layer indices.",
                     "Add target_layer_ids (0-based target layers whose outputs feed fc; DeepSpec Qwen3: "
                     "[1, 9, 17, 25, 33]).")
            return
        values = ids.value
        if any(b <= a for a, b in zip(values, values[1:])):
            self.add("DSP018", f"target layer ids {values} (from {ids.source}) are not strictly increasing; vLLM "
                     "concatenates the captured features in ascending order.", "Sort them (and the matching fc "
                     "input blocks) or retrain.")
        depth, source = self.target_depth()
        if depth is None:
            self.skip("DSP019", "the target's depth is unknown: pass --target (or set num_target_layers)")
            return
        outside = [v for v in values if not -1 <= v < depth]
        if outside:
            self.add("DSP019", f"target layer ids {outside} (from {ids.source}) are outside the target's "
                     f"{depth} layers (valid: -1 .. {depth - 1}; depth from {source}).",
                     "Use ids of layers the target has; -1 means the embedding output.")

    def target_depth(self) -> tuple[int | None, str | None]:
        if self.target:
            return self.target.num_hidden_layers, "--target num_hidden_layers"
        if self.config.num_target_layers:
            return self.config.num_target_layers, "the draft's num_target_layers"
        return None, None

    def check_target(self) -> None:
        config, target = self.config, self.target
        if target is None:
            self.skip("DSP024, DSP025, DSP031", "they compare the draft with the target: pass --target")
            return
        width = config.target_hidden_size
        if width and width != target.hidden_size:
            key = "target_hidden_size" if "target_hidden_size" in config.vllm_config else "hidden_size"
            self.add("DSP024", f"the draft expects target features of width {width} ({key}) but the target's "
                     f"hidden_size is {target.hidden_size}; vLLM fails with 'DFlash drafter expects ... "
                     "concatenated aux hidden features'.", "Use the target this draft was trained for, or set "
                     "target_hidden_size to the target's hidden_size if that is what fc was trained on.")
        if config.vocab_size and config.vocab_size < target.vocab_size:
            self.add("DSP025", f"vocab_size {config.vocab_size} is smaller than the target vocabulary "
                     f"{target.vocab_size}; markov_w1 (and embed_tokens) are indexed by target token ids, so a "
                     "target token beyond it is out of range.", "Use a draft built for this target's vocabulary.")
        declared = config.num_target_layers
        if declared and declared != target.num_hidden_layers:
            self.add("DSP031", f"num_target_layers is {declared} but the target has {target.num_hidden_layers} "
                     "layers; the draft was probably trained for another target.", "Check that --target is the "
                     "model the draft was distilled from.")

    def check_confidence_flags(self) -> None:
        config = self.config
        if config.kind != "dspark":
            return
        has_weights = any(name.startswith("confidence_head.") for name in self.tensors)
        if config.enable_confidence_head and not has_weights:
            self.add("DSP021", "enable_confidence_head is true but there are no confidence_head.* tensors; vLLM "
                     "silently removes the head (older versions fail with adaptive_verification).",
                     "Ship confidence_head.proj.weight/bias, or set enable_confidence_head to false.")
        if has_weights and not config.enable_confidence_head:
            self.add("DSP022", "confidence_head.* tensors are present but enable_confidence_head is not true; vLLM "
                     "does not build the head, so the weights are unused.",
                     "Set enable_confidence_head to true to use them (and confidence_head_with_markov to match).")
        if has_weights and config.has_markov and "confidence_head_with_markov" not in config.vllm_config and (
            "confidence_head_with_markov" not in config.nested_only
        ):
            self.add("DSP023", "confidence_head_with_markov is missing; vLLM's default changed (True in older "
                     "versions, False in newer), so the head's input width depends on the vLLM version.",
                     "Write confidence_head_with_markov explicitly (true when the proj weight has "
                     "hidden_size + markov_rank columns).")

    # -- vLLM load errors (DSP1xx) --

    def check_load_errors(self) -> None:
        config, T = self.config, self.target_vocab
        V, vd = config.vocab_size, config.draft_vocab_size
        if not (_positive_int(V) and _positive_int(vd)):
            self.skip("DSP020, DSP100-DSP106", "vocab_size or draft_vocab_size is invalid (see DSP010)")
            return
        if self.target is None:
            self.add("DSP100", f"no --target: the target vocabulary is assumed to be vocab_size ({V}) for DSP020, "
                     "DSP102, DSP103 and DSP106.", "Pass --target to check against the real target vocabulary.")
            self.skip("DSP101", "it needs the target vocabulary: pass --target")
        has_embed = any("embed_tokens" in name for name in self.tensors)
        has_lm_head = any(name.startswith("lm_head") for name in self.tensors)
        has_d2t = "d2t" in self.tensors
        if self.target and V > T and not has_embed:
            self.add("DSP101", f"vocab_size {V} is larger than the target vocabulary {T} and there is no "
                     "embed_tokens.weight; vLLM fails with: 'Qwen3 DSpark checkpoints whose input vocab_size is "
                     "larger than the target vocabulary must include embed_tokens weights.'",
                     "Ship embed_tokens.weight [vocab_size, hidden_size] with the draft.")
        if vd > T:
            self.add("DSP020", f"draft_vocab_size {vd} is larger than the target vocabulary {T}"
                     + ("." if self.target else " (assumed = vocab_size)."), "A draft can only propose target "
                     "tokens: draft_vocab_size must be <= the target's vocab_size.")
        reduced = vd != T
        if reduced and not has_lm_head:
            self.add("DSP102", f"the draft vocabulary ({vd}) differs from the target's ({T}) and there is no "
                     "lm_head.weight; vLLM fails with: 'Reduced-vocabulary Qwen3 DSpark checkpoints must include "
                     "lm_head weights; the full target lm_head cannot be shared.'",
                     "Ship lm_head.weight [draft_vocab_size, hidden_size].")
        if reduced and not has_d2t:
            self.add("DSP103", f"the draft vocabulary ({vd}) differs from the target's ({T}) and there is no d2t; "
                     "vLLM fails with: 'Reduced-vocabulary Qwen3 DSpark checkpoints must include a d2t mapping so "
                     "sampled draft ids can be converted to target ids.'",
                     "Ship d2t (int64 [draft_vocab_size], target_id = draft_id + d2t[draft_id]).")
        if not has_embed and V <= T:
            mask = config.mask_token_id
            self.add("DSP104", "there is no embed_tokens.weight: vLLM shares the target's embedding"
                     + (f", so the mask token's embedding is the target's row {mask}." if mask is not None else "."),
                     "Nothing to do if the draft was trained with the target's frozen embedding (DeepSpec does).")
        if not has_lm_head and not reduced:
            self.add("DSP105", "there is no lm_head.weight: vLLM shares the target's lm_head.",
                     "Nothing to do if the draft was trained with the target's frozen lm_head (DeepSpec does).")
        if has_d2t and not reduced:
            self.add("DSP106", f"d2t is shipped but the draft vocabulary equals the target's ({T}); newer vLLM "
                     "allocates no draft_id_to_target_id for it, so the tensor is unused or fails to load.",
                     "Drop d2t, or set draft_vocab_size to the reduced vocabulary it maps.")

    # -- tensors (DSP2xx) --

    def find_nvfp4_weights(self) -> None:
        for module in linear_modules(self.config):
            for name in module.weights:
                info = self.tensors.get(name)
                if info is not None and info.dtype == "U8":
                    self.nvfp4_weights.add(name)

    def check_tensors(self) -> None:
        expected = expected_draft_tensors(self.config)
        if "confidence_head.proj.bias" in expected and "confidence_head.proj.weight" in self.tensors:
            # vLLM builds the projection with a bias; without it the bias stays uninitialised
            expected["confidence_head.proj.bias"] = replace(expected["confidence_head.proj.bias"], required=True)
        for name, spec in expected.items():
            info = self.tensors.get(name)
            if info is None:
                if spec.required:
                    self.add("DSP201", f"required tensor {name!r} {spec.formula} is missing.",
                             "Re-export the draft's full state dict (DeepSpec names, no 'model.' prefix).")
            elif name not in self.nvfp4_weights:
                self.check_tensor(spec, info)
        nvfp4_extras = {f"{w.rsplit('.', 1)[0]}.{suffix}" for w in self.nvfp4_weights for suffix in NVFP4_SUFFIXES}
        for name in sorted(self.tensors):
            if name in expected or name in nvfp4_extras or name.startswith(IGNORED_BY_VLLM):
                continue
            self.add("DSP205", f"unexpected tensor {name!r} {list(self.tensors[name].shape)} is not part of a "
                     f"{FORMAT_NAMES[self.config.format]} draft.", "Remove it; vLLM may fail on weights its model "
                     "does not have (check the config, e.g. attention_bias, markov_head_type).")

    def check_tensor(self, spec: ExpectedTensor, info: TensorInfo) -> None:
        if spec.dtype and info.dtype != spec.dtype:
            self.add("DSP204", f"{spec.name} has dtype {info.dtype}; vLLM needs int64 offsets.",
                     "Store d2t as int64 (torch.long).")
        elif spec.dtype is None and not info.is_float:
            self.add("DSP203", f"{spec.name} has dtype {info.dtype}; vLLM loads it into a floating-point "
                     "parameter.", "Store it as bf16 (or quantize only markov_w2 with dspark quantize).")
        if not spec.matches(info.shape):
            shape = [d if d is not None else "?" for d in spec.shape]
            self.add("DSP202", f"{spec.name} has shape {list(info.shape)} but the config implies {shape} "
                     f"= {spec.formula}.", self.shape_hint(spec, info))

    def shape_hint(self, spec: ExpectedTensor, info: TensorInfo) -> str:
        config = self.config
        if spec.name == "confidence_head.proj.weight" and config.hidden_size and config.markov_rank:
            if info.shape == (1, config.hidden_size + config.markov_rank):
                return "The weight takes hidden_size + markov_rank inputs: set confidence_head_with_markov to true."
            if info.shape == (1, config.hidden_size):
                return "The weight takes hidden_size inputs: set confidence_head_with_markov to false."
        if spec.name == "fc.weight":
            return ("fc's input width must be len(target_layer_ids) * target_hidden_size; check target_layer_ids "
                    "and target_hidden_size against the training config.")
        return "Fix the config key named in the formula, or re-export the tensor from the trained model."

    # -- NVFP4 and quantization config (DSP3xx) --

    def check_quantization(self, geometry_ok: bool) -> None:
        quant = self.read_quant_configs()
        usable = quant is not None and not quant.problems and not self.foreign_quant
        self.quant = quant if usable else None
        if geometry_ok:
            expected = expected_draft_tensors(self.config)
            for name in sorted(self.nvfp4_weights):
                self.check_nvfp4_tensors(name, expected.get(name))
        for module in linear_modules(self.config):
            if not all(w in self.tensors for w in module.weights):
                continue
            claimed = _claimed_algo(module, self.quant) if self.quant else None
            nvfp4 = [w for w in module.weights if w in self.nvfp4_weights]
            if nvfp4 and (quant is None or self.quant is not None):  # else DSP307/DSP313 explain the config
                self.check_nvfp4_claim(module, nvfp4[0], claimed)
            elif not nvfp4 and claimed is not None:
                self.add("DSP310", f"{self.quant.where} makes vLLM quantize {module.prefix} as {claimed}, but "
                         f"{module.weights[0]} is stored as {self.tensors[module.weights[0]].dtype}.",
                         "Exclude the layer from quantization: use MIXED_PRECISION with quantized_layers naming only "
                         "model.markov_head.markov_w2 (what dspark quantize writes).")
            if module.weights == (MARKOV_W2,):
                self.head_claim = claimed if nvfp4 else None
        if self.head_claim == "W4A16_NVFP4":
            mixed = self.quant.algo == "MIXED_PRECISION"
            self.add("DSP314", f"markov_w2 is NVFP4 W4A16 ({self.quant.algo}); vLLM runs it with the Marlin kernel, "
                     f"which needs compute capability >= {'8.9 for MIXED_PRECISION' if mixed else '7.5'}.",
                     "Nothing to do on Ada, Hopper or Blackwell GPUs.")

    def read_quant_configs(self) -> QuantConfig | None:
        """Check config.json's quantization_config and hf_quant_config.json; return the one vLLM uses."""
        raw_json = self.ckpt.config.get("quantization_config")
        json_quant = _config_json_quant(raw_json) if raw_json is not None else None
        legacy = _legacy_quant(self.ckpt.hf_quant_config) if self.ckpt.hf_quant_config is not None else None
        if json_quant and json_quant.method and not json_quant.method.startswith("modelopt"):
            self.foreign_quant = True
            self.add("DSP313", f"config.json quantization_config has quant_method {json_quant.method!r}; dspark "
                     "checks only ModelOpt NVFP4 configs.", "Validate this checkpoint with its quantizer's tools.")
            return json_quant
        for quant in (json_quant, legacy):
            for problem in quant.problems if quant else []:
                self.add("DSP307", f"{quant.where}: {problem}.", "Rewrite it as dspark quantize does: "
                         "MIXED_PRECISION with quantized_layers {'model.markov_head.markov_w2': {'quant_algo': "
                         "'W4A16_NVFP4', 'group_size': 16}}.")
        if json_quant is None and legacy is not None:
            self.add("DSP312", "the quantization config is only in hf_quant_config.json; some vLLM versions do not "
                     "accept W4A16_NVFP4 / MIXED_PRECISION there.", "Also write it to config.json as "
                     "quantization_config with quant_method 'modelopt' (dspark quantize writes both).")
        elif json_quant is not None and legacy is not None:
            self.check_agreement(json_quant, legacy)
        return json_quant or legacy

    def check_agreement(self, a: QuantConfig, b: QuantConfig) -> None:
        fields = {
            "quant_algo": (a.algo, b.algo),
            "exclusions (ignore / exclude_modules)": (sorted(a.exclude), sorted(b.exclude)),
            "quantized_layers": (a.layers, b.layers),
        }
        if a.group_size is not None and b.group_size is not None:
            fields["group_size"] = (a.group_size, b.group_size)
        for what, (left, right) in fields.items():
            if left != right:
                self.add("DSP309", f"{what} differs between config.json ({left!r}) and hf_quant_config.json "
                         f"({right!r}).", "Make both files describe the same quantization (vLLM reads config.json; "
                         "other tools read hf_quant_config.json).")

    def check_nvfp4_tensors(self, name: str, spec: ExpectedTensor | None) -> None:
        """uint8 [N, K/2] weight, float8_e4m3fn [N, K/16] weight_scale, float32 scalar weight_scale_2."""
        base = name.rsplit(".", 1)[0]
        info = self.tensors[name]
        n, k = spec.shape if spec and len(spec.shape) == 2 else (None, None)
        label = "markov_rank" if name == MARKOV_W2 else "input features"
        if k is not None and k % NVFP4_GROUP:
            self.add("DSP304", f"{name} is NVFP4 but its {label} ({k}) is not a multiple of 16.",
                     "NVFP4 quantizes blocks of 16 inputs: keep this layer in bf16 or retrain with a rank that is a "
                     "multiple of 64.")
        elif k is not None and k % MARLIN_K_MULTIPLE:
            self.add("DSP305", f"{name} is NVFP4 with {label} {k}, not a multiple of 64; vLLM's Marlin W4A16 "
                     "kernel may reject it.", "Prefer a multiple of 64 (e.g. 256), or keep this layer in bf16.")
        packed_ok = info.shape == (n, k // 2) if k is not None else len(info.shape) == 2
        if not packed_ok:
            expected = f"[{n}, {k // 2}]" if k is not None else "[N, K/2]"
            self.add("DSP301", f"{name} is uint8 (NVFP4-packed) with shape {list(info.shape)}; expected {expected} "
                     "(two E2M1 codes per byte along the input dimension).",
                     "Re-quantize from the bf16 checkpoint with dspark quantize.")
        scale = self.tensors.get(f"{base}.weight_scale")
        want_scale = f"[{n}, {k // NVFP4_GROUP}]" if k is not None else "[N, K/16]"
        if scale is None:
            self.add("DSP302", f"{base}.weight_scale is missing; an NVFP4 weight needs its float8_e4m3fn block "
                     f"scales {want_scale}.", "Re-quantize with dspark quantize.")
        elif scale.dtype != "F8_E4M3":
            hint = (" Stored as uint8 bytes, vLLM would convert them numerically instead of reinterpreting them."
                    if scale.dtype == "U8" else "")
            self.add("DSP302", f"{base}.weight_scale has dtype {scale.dtype}; vLLM needs F8_E4M3.{hint}",
                     "Store the block scales as torch.float8_e4m3fn.")
        elif k is not None and scale.shape != (n, k // NVFP4_GROUP):
            self.add("DSP302", f"{base}.weight_scale has shape {list(scale.shape)}; expected {want_scale} (one "
                     "scale per 16 inputs, linear layout).", "Write linear (unswizzled) scales; re-quantize with "
                     "dspark quantize.")
        global_scale = self.tensors.get(f"{base}.weight_scale_2")
        if global_scale is None:
            self.add("DSP303", f"{base}.weight_scale_2 is missing; an NVFP4 weight needs its float32 global scale.",
                     "Re-quantize with dspark quantize.")
        elif global_scale.dtype != "F32" or global_scale.shape not in ((), (1,)):
            self.add("DSP303", f"{base}.weight_scale_2 is {global_scale.dtype}{list(global_scale.shape)}; vLLM "
                     "needs a float32 scalar (shape [] or [1]).", "Store it as a 0-dim float32 tensor.")

    def check_nvfp4_claim(self, module: LinearModule, weight: str, claimed: str | None) -> None:
        quant = self.quant
        if quant is None:
            self.add("DSP306", f"{weight} is stored as NVFP4 (uint8) but the checkpoint has no quantization config "
                     "(config.json quantization_config or hf_quant_config.json); vLLM builds a bf16 layer and the "
                     "load fails.", "Add the config dspark quantize writes (MIXED_PRECISION, quantized_layers "
                     "{'model.markov_head.markov_w2': {'quant_algo': 'W4A16_NVFP4', 'group_size': 16}}).")
        elif claimed is None:
            self.add("DSP308", f"{weight} is stored as NVFP4 but {quant.where} leaves {module.prefix} unquantized "
                     "(excluded, or not in quantized_layers), so vLLM loads uint8 into a bf16 layer and fails.",
                     f"Name {module.prefix!r} in quantized_layers with quant_algo W4A16_NVFP4 (the key is the vLLM "
                     "prefix, with 'model.').")
        elif claimed not in ("W4A16_NVFP4", "NVFP4"):
            self.add("DSP308", f"{weight} is stored as NVFP4 but {quant.where} quantizes {module.prefix} as "
                     f"{claimed}.", f"Set {module.prefix!r} to quant_algo W4A16_NVFP4.")
        elif claimed == "NVFP4" and f"{weight.rsplit('.', 1)[0]}.input_scale" not in self.tensors:
            self.add("DSP311", f"{quant.where} quantizes {module.prefix} as NVFP4 (W4A4), which needs "
                     f"{weight.rsplit('.', 1)[0]}.input_scale, and the checkpoint has none.",
                     "Use quant_algo W4A16_NVFP4 (weight-only; what dspark quantize writes).")

    # -- deep value checks (DSP6xx) --

    def check_values(self) -> None:
        """Load each tensor that has a value rule, one at a time, in file order."""
        for info in sorted(self.on_disk.values(), key=lambda i: (i.file, i.begin)):
            is_global_scale = info.name.endswith(".weight_scale_2") and info.dtype == "F32"
            is_block_scale = info.name.endswith(".weight_scale") and info.dtype == "F8_E4M3"
            is_d2t = info.name == "d2t" and info.dtype == "I64" and len(info.shape) == 1
            if is_global_scale:
                self.check_global_scale(info, self.load(info))
            elif info.dtype in FLOAT_MATRIX_DTYPES:
                self.check_float_values(info, self.load(info))
            elif is_block_scale:
                self.check_block_scales(info, self.load(info))
            elif is_d2t:
                self.check_d2t(self.load(info))

    def load(self, info: TensorInfo):
        try:
            return self.ckpt.load_tensor(info.name)
        except CheckpointError:
            raise
        except Exception as error:  # safetensors / OS errors while reading tensor bytes
            raise CheckpointError(
                "DSP514", f"tensor {info.name!r} in {info.file} could not be loaded ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else 'no detail'}); re-download the file."
            ) from None

    def check_global_scale(self, info: TensorInfo, tensor) -> None:
        import torch

        value = tensor.reshape(-1)
        if value.numel() == 0 or not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
            self.add("DSP606", f"{info.name} is {value.tolist()}; the global scale must be finite and positive.",
                     "Re-quantize; an all-zero weight needs weight_scale_2 = 1 (dspark quantize handles it).")

    def check_block_scales(self, info: TensorInfo, tensor) -> None:
        import torch

        bad = _count(tensor, lambda t: ~torch.isfinite(t.float()) | (t.float() < 0))
        if bad:
            self.add("DSP605", f"{info.name} has {bad} block scales that are NaN, Inf or negative.",
                     "Re-quantize from the bf16 weights with dspark quantize.")

    def check_float_values(self, info: TensorInfo, tensor) -> None:
        import torch

        bad = _count(tensor, lambda t: ~torch.isfinite(t))
        if bad:
            self.add("DSP601", f"{info.name} has {bad} NaN/Inf values.",
                     "Re-export the tensor from a healthy training step; NaN weights poison every draft.")
        if tensor.dim() == 2 and tensor.numel() and _count(tensor, lambda t: t != 0) == 0:
            self.add("DSP602", f"{info.name} {list(info.shape)} is all zeros.",
                     "Check that the trained weights were saved (an untrained or unsaved layer drafts nothing useful).")

    def check_d2t(self, d2t) -> None:
        import torch

        targets = torch.arange(d2t.numel(), dtype=torch.long) + d2t  # [Vd] target ids
        T = self.target_vocab
        if T:
            outside = int(((targets < 0) | (targets >= T)).sum())
            if outside:
                self.add("DSP603", f"d2t maps {outside} draft ids outside the target vocabulary [0, {T}) "
                         "(target_id = draft_id + d2t[draft_id]).", "Rebuild d2t as offsets: target_id - draft_id.")
        duplicates = targets.numel() - int(torch.unique(targets).numel())
        if duplicates:
            self.add("DSP604", f"d2t maps {duplicates} draft ids onto target ids another draft id already has.",
                     "Rebuild d2t from a one-to-one draft-to-target vocabulary map.")

    # -- resolved values --

    def resolve(self) -> None:
        config, resolved = self.config, self.report.resolved
        resolved["format"] = FORMAT_NAMES[config.format]
        resolved["architecture"] = config.architecture
        if config.format in ("unknown", "deepseek-v4"):
            return
        resolved["mask_token"] = {"value": config.mask_token.value, "source": config.mask_token.source}
        resolved["target_layer_ids"] = {
            "value": config.layer_ids, "source": config.target_layer_ids.source,
            "hidden_states_indices": config.hidden_state_indices,
        }  # fmt: skip
        resolved["block_size"] = {"value": config.block_size.value, "source": config.block_size.source}
        resolved["vocab_size"] = config.vocab_size
        resolved["draft_vocab_size"] = {
            "value": config.draft_vocab_size,
            "source": "draft_vocab_size" if "draft_vocab_size" in config.vllm_config else "vocab_size (default)",
        }
        resolved["target_vocab_size"] = {
            "value": self.target_vocab, "source": "--target" if self.target else "assumed = vocab_size",
        }  # fmt: skip
        depth, depth_source = self.target_depth()
        resolved["target_depth"] = {"value": depth, "source": depth_source}
        resolved["markov_rank"] = config.markov_rank
        resolved["head_format"] = self.head_format()
        resolved["confidence_head"] = self.confidence_summary()
        resolved["layout"] = "N queries, slot j predicts p+j+1" if config.sample_from_anchor else (
            "1+N queries, mask slot j predicts p+j")
        resolved["embed_tokens"] = "own" if any("embed_tokens" in n for n in self.tensors) else "shared from target"
        resolved["lm_head"] = "own" if any(n.startswith("lm_head") for n in self.tensors) else "shared from target"
        resolved["tensors"] = len(self.on_disk)
        resolved["shards"] = len(self.ckpt.shards)
        resolved["bytes"] = sum(info.nbytes for info in self.on_disk.values())

    def head_format(self) -> str | None:
        w2 = self.tensors.get(MARKOV_W2)
        if w2 is None:
            return None
        if MARKOV_W2 not in self.nvfp4_weights:
            return w2.dtype.lower()
        if self.head_claim == "W4A16_NVFP4":
            return f"nvfp4 (W4A16, {self.quant.algo})"
        return "nvfp4 (not loadable by vLLM, see the DSP3xx findings)"

    def confidence_summary(self) -> str:
        config = self.config
        if config.kind != "dspark" or not config.enable_confidence_head:
            return "off"
        return "on, input [hidden; markov]" if config.confidence_head_with_markov else "on, input [hidden]"


def _count(tensor, predicate, chunk: int = 1 << 24) -> int:
    """Number of elements where predicate holds, in flat chunks so a large tensor needs little extra memory."""
    flat = tensor.reshape(-1)
    return sum(int(predicate(flat[i : i + chunk]).sum()) for i in range(0, flat.numel(), chunk))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _nonneg_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _lookup(config: dict[str, Any], dotted: str | None) -> Any:
    table: Any = config
    for part in (dotted or "").split("."):
        table = table.get(part) if isinstance(table, dict) else None
    return table
