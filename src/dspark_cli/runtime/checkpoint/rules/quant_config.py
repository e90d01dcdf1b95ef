"""Quantization configs as vLLM's ModelOpt loader reads them: config.json's quantization_config and
hf_quant_config.json parsed into one shape, with the reasons vLLM would refuse them, and the algorithm vLLM would
give a Linear layer (docs/validate.md, "Where each rule comes from", names the vLLM functions mirrored).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from dspark_cli.runtime.checkpoint.layout import NVFP4_GROUP, LinearModule
from dspark_cli.runtime.checkpoint.rules.values import as_dict

VLLM_QUANT_ALGOS = {"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION"}
# Per-layer algorithms ModelOptMixedPrecisionConfig.get_quant_method turns into a quantized linear method.
MIXED_LAYER_ALGOS = {"FP8", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4", "MXFP8"}


@dataclass(frozen=True)
class QuantConfig:
    where: str  # "config.json quantization_config" or "hf_quant_config.json"
    method: str | None
    algo: str | None  # upper-cased
    group_size: Any
    exclude: list[str]
    layers: dict[str, dict[str, Any]]  # quantized_layers (MIXED_PRECISION)
    problems: list[str]  # why vLLM would refuse it


def config_json_quant(raw: Any) -> QuantConfig:
    where = "config.json quantization_config"
    if not isinstance(raw, dict):
        return QuantConfig(where, None, None, None, [], {}, ["it is not a JSON object"])
    group = raw.get("group_size")
    for group_config in as_dict(raw.get("config_groups")).values():
        weights = as_dict(as_dict(group_config).get("weights"))
        if group is None and "group_size" in weights:
            group = weights["group_size"]
    exclude = raw.get("ignore", raw.get("exclude_modules"))
    quant = _quant(where, raw.get("quant_method"), raw.get("quant_algo"), group, exclude, raw.get("quantized_layers"))
    if quant.method is None:
        quant.problems.append("quant_method is missing; vLLM needs 'modelopt'")
    return quant


def legacy_quant(raw: dict[str, Any]) -> QuantConfig:
    where = "hf_quant_config.json"
    section = raw.get("quantization")
    if not isinstance(section, dict):
        return QuantConfig(where, None, None, None, [], {}, ["it has no 'quantization' object"])
    method = "modelopt" if as_dict(raw.get("producer")).get("name") == "modelopt" else None
    quant = _quant(where, method, section.get("quant_algo"), section.get("group_size"),
                   section.get("exclude_modules"), section.get("quantized_layers"))
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
                                    f"unquantized (it accepts {', '.join(sorted(MIXED_LAYER_ALGOS))})")
                    continue
                layer_group = entry.get("group_size", NVFP4_GROUP)
                if "NVFP4" in layer_algo.upper() and layer_group != NVFP4_GROUP:
                    problems.append(f"quantized_layers[{key!r}] has group_size {layer_group!r}; NVFP4 needs 16")
                clean_layers[key] = {"quant_algo": layer_algo.upper(), "group_size": layer_group}
    return QuantConfig(where, method if isinstance(method, str) else None, algo_name, group, list(exclude or []),
                       clean_layers, problems)


def is_excluded(prefixes: tuple[str, ...], patterns: list[str]) -> bool:
    """vLLM's is_layer_excluded: exact, substring, then fnmatch; a trailing `x*` also means `x` and `x.*`."""
    expanded: list[str] = []
    for pattern in patterns:
        expanded += [pattern[:-1], pattern[:-1] + ".*"] if pattern.endswith("*") and len(pattern) > 1 else [pattern]
    return any(p == c or (p and p in c) or fnmatch.fnmatchcase(c, p) for p in expanded for c in prefixes)


def claimed_algo(module: LinearModule, quant: QuantConfig) -> str | None:
    """The algorithm vLLM would quantize this layer with, or None when it stays unquantized."""
    prefixes = (module.prefix, *module.shard_prefixes)
    if is_excluded(prefixes, quant.exclude):
        return None
    if quant.algo != "MIXED_PRECISION":
        return quant.algo
    for key, entry in quant.layers.items():
        key = "lm_head" if key.endswith(".lm_head") else key
        if key in prefixes or key.startswith(module.prefix + "."):
            return entry["quant_algo"]
    return None
