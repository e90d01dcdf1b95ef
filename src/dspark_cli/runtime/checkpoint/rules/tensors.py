"""Tensor rules (DSP2xx): names vLLM renames or drops, and the tensors a draft's config implies.

Preconditions: `tensor_names` runs on every checkpoint; `expected_tensors` only on a draft (`ctx.is_draft`).
"""

from __future__ import annotations

from dataclasses import replace

from dspark_cli.runtime.checkpoint.read import TensorInfo
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.formats import FORMAT_NAMES
from dspark_cli.runtime.checkpoint.layout import IGNORED_BY_VLLM, QUANT_SUFFIXES, ExpectedTensor, canonical_name
from dspark_cli.runtime.checkpoint.rules.codes import Results
from dspark_cli.runtime.checkpoint.rules.context import RuleContext

INTEGER_DTYPES = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"}  # default_weight_loader copies by value


def tensor_names(ctx: RuleContext) -> Results:
    """Names vLLM renames or drops: a `model.` prefix, DFlash aliases, t2d, mask_embedding. Runs on every checkpoint."""
    out = Results()
    prefixed = [n for n in ctx.on_disk if n.startswith("model.")]
    if prefixed:
        out.add("DSP209", f"{len(prefixed)} tensor names start with 'model.' (e.g. {prefixed[0]!r}); vLLM "
                "prepends 'model.' itself and would look for 'model.model.*'.",
                "Save the draft's state dict without the 'model.' prefix (DeepSpec's naming).")
    aliased = [name for name in ctx.on_disk if canonical_name(name) != name.removeprefix("model.")]
    if aliased:
        out.add("DSP208", f"{len(aliased)} tensors use DFlash alias names (e.g. {aliased[0]!r}) that vLLM "
                "renames to layers.0.* / fc.* / hidden_norm.* on load.",
                "Nothing to do; they are checked under the vLLM names.")
    for name in ctx.tensors:
        if name.startswith("t2d"):
            out.add("DSP206", f"tensor {name!r} is skipped by vLLM (training-only target-to-draft map).",
                    "Nothing to do; vLLM uses d2t.")
        elif name == "mask_embedding" or name.startswith("mask_embedding."):
            out.add("DSP207", f"tensor {name!r} is dropped by vLLM (DSpark masks via the mask token's "
                    "embedding row).",
                    "Nothing to do, unless the draft was trained with a learned mask embedding.")
    return out


def expected_tensors(ctx: RuleContext) -> Results:
    """Each tensor the config implies is present with its shape and dtype; nothing vLLM has no parameter for.

    Precondition: a draft. Without a trustworthy geometry (`ctx.geometry_ok`) the shapes are unknown: skipped.
    """
    out = Results()
    if not ctx.geometry_ok:
        out.skip("DSP201-DSP205", "the config's geometry is incomplete (see DSP010)")
        return out
    expected = dict(ctx.expected)
    if "confidence_head.proj.bias" in expected and "confidence_head.proj.weight" in ctx.tensors:
        # vLLM builds the projection with a bias; without it the bias stays uninitialised
        expected["confidence_head.proj.bias"] = replace(expected["confidence_head.proj.bias"], required=True)
    for name, spec in expected.items():
        info = ctx.tensors.get(name)
        if info is None:
            if spec.required:
                out.add("DSP201", f"required tensor {name!r} {spec.formula} is missing.",
                        "Re-export the draft's full state dict (DeepSpec names, no 'model.' prefix).")
        elif name not in ctx.nvfp4_weights | ctx.fp8_weights:  # quant.py checks the quantized weights
            out += _tensor(ctx, spec, info)
    quant_extras = {f"{w.rsplit('.', 1)[0]}.{suffix}" for w in ctx.nvfp4_weights | ctx.fp8_weights
                    for suffix in QUANT_SUFFIXES}
    modules = {name.rsplit(".", 1)[0] for name in expected}
    for name in sorted(ctx.tensors):
        if name in expected or name in quant_extras or name.startswith(IGNORED_BY_VLLM):
            continue
        shape = list(ctx.tensors[name].shape)
        if name.endswith(".bias") and name.removesuffix(".bias") in modules:
            out.add("DSP210", f"tensor {name!r} {shape} has no parameter in vLLM's model (this config builds "
                    "that layer without a bias): vLLM releases that look every name up fail to load it, and those that "
                    "skip unexpected biases drop the trained bias silently, so vLLM would not run the draft that was "
                    "trained.",
                    "If the draft was trained with attention biases, set attention_bias to true; otherwise remove "
                    "the tensor.")
            continue
        out.add("DSP205", f"tensor {name!r} {shape} has no parameter in vLLM's "
                f"{FORMAT_NAMES[ctx.config.format]} model; its weight loader fails with 'There is no module or "
                "parameter named ...'.", "Remove it, or fix the config that should create it (e.g. "
                "num_hidden_layers, markov_rank, markov_head_type).")
    return out


def _tensor(ctx: RuleContext, spec: ExpectedTensor, info: TensorInfo) -> Results:
    out = Results()
    if spec.dtype and info.dtype != spec.dtype and info.dtype not in INTEGER_DTYPES:
        out.add("DSP204", f"{spec.name} has dtype {info.dtype}; vLLM copies it into an int64 parameter by value, "
                "so fractional or large offsets are silently rounded.", "Store d2t as int64 (torch.long).")
    elif spec.dtype is None and not info.is_float:
        out.add("DSP203", f"{spec.name} has dtype {info.dtype}; vLLM loads it into a floating-point "
                "parameter.", "Store it as bf16 (or quantize only markov_w2 with dspark quantize).")
    if not spec.matches(info.shape):
        shape = [d if d is not None else "?" for d in spec.shape]
        out.add("DSP202", f"{spec.name} has shape {list(info.shape)} but the config implies {shape} "
                f"= {spec.formula}.", _shape_hint(ctx.config, spec, info))
    return out


def _shape_hint(config: DraftConfig, spec: ExpectedTensor, info: TensorInfo) -> str:
    if spec.name == "confidence_head.proj.weight" and config.hidden_size and config.markov_rank:
        if info.shape == (1, config.hidden_size + config.markov_rank):
            return "The weight takes hidden_size + markov_rank inputs: set confidence_head_with_markov to true."
        if info.shape == (1, config.hidden_size):
            return "The weight takes hidden_size inputs: set confidence_head_with_markov to false."
    if spec.name == "fc.weight":
        return ("fc's input width must be len(target_layer_ids) * target_hidden_size; check target_layer_ids "
                "and target_hidden_size against the training config.")
    return "Fix the config key named in the formula, or re-export the tensor from the trained model."
