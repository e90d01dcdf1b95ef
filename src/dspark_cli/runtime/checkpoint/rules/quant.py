"""NVFP4, FP8 and quantization-config rules (DSP3xx): the quantized tensors, and whether the config vLLM reads gives
each NVFP4 layer a weight-only NVFP4 method and each FP8 layer ModelOpt's FP8 method. Precondition: a draft (`ctx.is_draft`); the parsed configs, the NVFP4
weights and the algorithm vLLM gives markov_w2 are facts of the context (rules/context.py).
"""

from __future__ import annotations

from dspark_cli.runtime.checkpoint.layout import MARKOV_W2, MARLIN_K_MULTIPLE, NVFP4_GROUP, ExpectedTensor, LinearModule
from dspark_cli.runtime.checkpoint.rules.codes import Results
from dspark_cli.runtime.checkpoint.rules.context import RuleContext
from dspark_cli.runtime.checkpoint.rules.quant_config import QuantConfig, claimed_algo

MARLIN_FP4_MIN_CAPABILITY = "7.5"  # ModelOptMixedPrecisionConfig / ModelOptNvFp4Config get_min_capability: 75


def quant_configs(ctx: RuleContext) -> Results:
    """config.json's quantization_config and hf_quant_config.json: parseable by vLLM, ModelOpt's, in agreement."""
    out, json_quant, legacy = Results(), ctx.json_quant, ctx.legacy_quant
    if ctx.foreign_quant:
        out.add("DSP313", f"config.json quantization_config has quant_method {json_quant.method!r}; dspark "
                "checks only ModelOpt NVFP4 configs.", "Validate this checkpoint with its quantizer's tools.")
        return out
    used = ctx.quant_read  # vLLM reads config.json's quantization_config first
    for problem in used.problems if used else []:
        out.add("DSP307", f"{used.where}: {problem}.", "Rewrite it as dspark quantize does: "
                "MIXED_PRECISION with quantized_layers {'model.markov_head.markov_w2': {'quant_algo': "
                "'W4A16_NVFP4', 'group_size': 16}}.")
    for problem in legacy.problems if legacy and json_quant else []:
        out.add("DSP309", f"hf_quant_config.json: {problem}; vLLM ignores that file because config.json has a "
                "quantization_config, but other tools read it.", "Make hf_quant_config.json describe the "
                "quantization config.json describes (dspark quantize writes both).")
    if json_quant is None and legacy is not None:
        out.add("DSP312", "the quantization config is only in hf_quant_config.json; some vLLM versions do not "
                "accept W4A16_NVFP4 / MIXED_PRECISION there.", "Also write it to config.json as "
                "quantization_config with quant_method 'modelopt' (dspark quantize writes both).")
    elif json_quant is not None and legacy is not None:
        out += _agreement(json_quant, legacy)
    return out


def _agreement(a: QuantConfig, b: QuantConfig) -> Results:
    out = Results()
    fields = {
        "quant_algo": (a.algo, b.algo),
        "exclusions (ignore / exclude_modules)": (sorted(a.exclude), sorted(b.exclude)),
        "quantized_layers": (a.layers, b.layers),
    }
    if a.group_size is not None and b.group_size is not None:
        fields["group_size"] = (a.group_size, b.group_size)
    for what, (left, right) in fields.items():
        if left != right:
            out.add("DSP309", f"{what} differs between config.json ({left!r}) and hf_quant_config.json "
                    f"({right!r}); vLLM uses config.json's and ignores the other file.", "Make both files "
                    "describe the same quantization (other tools read hf_quant_config.json).")
    return out


def nvfp4_tensors(ctx: RuleContext) -> Results:
    """The packed weight and its scales, for each NVFP4 weight (shapes need `ctx.geometry_ok`)."""
    out = Results()
    if ctx.geometry_ok:
        for name in sorted(ctx.nvfp4_weights):
            out += _nvfp4_tensors(ctx, name, ctx.expected.get(name))
    return out


def _nvfp4_tensors(ctx: RuleContext, name: str, spec: ExpectedTensor | None) -> Results:
    """uint8 [N, K/2] weight, float8_e4m3fn [N, K/16] weight_scale, float32 scalar weight_scale_2."""
    out = Results()
    base = name.rsplit(".", 1)[0]
    info = ctx.tensors[name]
    n, k = spec.shape if spec and len(spec.shape) == 2 else (None, None)
    label = "markov_rank" if name == MARKOV_W2 else "input features"
    if k is not None and k % NVFP4_GROUP:
        out.add("DSP304", f"{name} is NVFP4 but its {label} ({k}) is not a multiple of 16.",
                "NVFP4 quantizes blocks of 16 inputs: keep this layer in bf16 or retrain with a rank that is a "
                "multiple of 64.")
    elif k is not None and k % MARLIN_K_MULTIPLE:
        out.add("DSP305", f"{name} is NVFP4 with {label} {k}, not a multiple of 64; vLLM's Marlin W4A16 "
                "kernel may reject it.", "Prefer a multiple of 64 (e.g. 256), or keep this layer in bf16.")
    packed_ok = info.shape == (n, k // 2) if k is not None else len(info.shape) == 2
    if not packed_ok:
        expected = f"[{n}, {k // 2}]" if k is not None else "[N, K/2]"
        out.add("DSP301", f"{name} is uint8 (NVFP4-packed) with shape {list(info.shape)}; expected {expected} "
                "(two E2M1 codes per byte along the input dimension).",
                "Re-quantize from the bf16 checkpoint with dspark quantize.")
    scale = ctx.tensors.get(f"{base}.weight_scale")
    want_scale = f"[{n}, {k // NVFP4_GROUP}]" if k is not None else "[N, K/16]"
    if scale is None:
        out.add("DSP302", f"{base}.weight_scale is missing; an NVFP4 weight needs its float8_e4m3fn block "
                f"scales {want_scale}.", "Re-quantize with dspark quantize.")
    elif scale.dtype != "F8_E4M3":
        hint = (" Stored as uint8 bytes, vLLM would convert them numerically instead of reinterpreting them."
                if scale.dtype == "U8" else "")
        out.add("DSP302", f"{base}.weight_scale has dtype {scale.dtype}; vLLM needs F8_E4M3.{hint}",
                "Store the block scales as torch.float8_e4m3fn.")
    elif k is not None and scale.shape != (n, k // NVFP4_GROUP):
        out.add("DSP302", f"{base}.weight_scale has shape {list(scale.shape)}; expected {want_scale} (one "
                "scale per 16 inputs, linear layout).", "Write linear (unswizzled) scales; re-quantize with "
                "dspark quantize.")
    global_scale = ctx.tensors.get(f"{base}.weight_scale_2")
    if global_scale is None:
        out.add("DSP303", f"{base}.weight_scale_2 is missing; an NVFP4 weight needs its float32 global scale.",
                "Re-quantize with dspark quantize.")
    elif global_scale.dtype != "F32" or global_scale.shape not in ((), (1,)):
        out.add("DSP303", f"{base}.weight_scale_2 is {global_scale.dtype}{list(global_scale.shape)}; vLLM "
                "needs a float32 scalar (shape [] or [1]).", "Store it as a 0-dim float32 tensor.")
    return out


def fp8_tensors(ctx: RuleContext) -> Results:
    """Each FP8 weight (float8_e4m3fn [N, K]) with its float32 scalar weight_scale and input_scale, the per-tensor
    W8A8 layout vLLM's ModelOpt FP8 method registers (docs/quantize.md, "FP8")."""
    out = Results()
    for name in sorted(ctx.fp8_weights):
        base = name.rsplit(".", 1)[0]
        spec = ctx.expected.get(name) if ctx.geometry_ok else None
        shape = ctx.tensors[name].shape
        if spec is not None and tuple(shape) != tuple(spec.shape):
            out.add("DSP316", f"{name} is FP8 with shape {list(shape)}; the config implies {list(spec.shape)} "
                    "(FP8 keeps the weight's shape, one byte per element).", "Re-quantize from the bf16 checkpoint "
                    "with dspark quantize.")
        for scale, role, code in (("weight_scale", "its per-tensor weight scale", "DSP317"),
                                  ("input_scale", "the static scale of its input activation", "DSP318")):
            info = ctx.tensors.get(f"{base}.{scale}")
            if info is None:
                missing = (" vLLM initialises the parameter to the float32 minimum (-3.4e38) and keeps the "
                           "largest value loaded, so the layer would run with that scale.")
                out.add(code, f"{base}.{scale} is missing; an FP8 layer needs {role}.{missing}",
                        "Re-quantize with dspark quantize (FP8 calibrates the input scale on prompts through the "
                        "target).")
            elif info.dtype != "F32" or tuple(info.shape) not in ((), (1,)):
                out.add(code, f"{base}.{scale} is {info.dtype}{list(info.shape)}; vLLM's ModelOpt FP8 method reads "
                        "one float32 scalar per layer (per-channel or per-block scales are other algorithms).",
                        "Store it as a 0-dim float32 tensor, or name the algorithm that matches the scales.")
    return out


def layer_claims(ctx: RuleContext) -> Results:
    """Each Linear layer's storage (NVFP4, FP8 or float) against the algorithm the quantization config gives it."""
    out, quant = Results(), ctx.quant
    for module in ctx.modules:
        if not all(w in ctx.tensors for w in module.weights):
            continue
        claimed = claimed_algo(module, quant) if quant else None
        nvfp4 = [w for w in module.weights if w in ctx.nvfp4_weights]
        fp8 = [w for w in module.weights if w in ctx.fp8_weights]
        config_explained = ctx.quant_read is None or quant is not None  # else DSP307/DSP313 explain the config
        if nvfp4 and config_explained:
            out += _nvfp4_claim(ctx, module, nvfp4[0], claimed)
        elif fp8 and config_explained and claimed != "FP8":
            out += _fp8_claim(ctx, module, fp8[0], claimed)
        elif not (nvfp4 or fp8) and claimed is not None and ctx.tensors[module.weights[0]].is_float:
            out.add("DSP310", f"{quant.where} makes vLLM quantize {module.prefix} as {claimed}, but "
                    f"{module.weights[0]} is stored as {ctx.tensors[module.weights[0]].dtype}.",
                    "Exclude the layer from quantization: use MIXED_PRECISION with quantized_layers naming only "
                    "model.markov_head.markov_w2 (what dspark quantize writes).")
    return out


def _nvfp4_claim(ctx: RuleContext, module: LinearModule, weight: str, claimed: str | None) -> Results:
    out, quant = Results(), ctx.quant
    if quant is None:
        out.add("DSP306", f"{weight} is stored as NVFP4 (uint8) but the checkpoint has no quantization config "
                "(config.json quantization_config or hf_quant_config.json); vLLM builds a bf16 layer and the "
                "load fails.", "Add the config dspark quantize writes (MIXED_PRECISION, quantized_layers "
                "{'model.markov_head.markov_w2': {'quant_algo': 'W4A16_NVFP4', 'group_size': 16}}).")
    elif claimed is None:
        out.add("DSP308", f"{weight} is stored as NVFP4 but {quant.where} leaves {module.prefix} unquantized "
                "(excluded, or not in quantized_layers), so vLLM loads uint8 into a bf16 layer and fails.",
                f"Name {module.prefix!r} in quantized_layers with quant_algo W4A16_NVFP4 (the key is the vLLM "
                "prefix, with 'model.').")
    elif claimed not in ("W4A16_NVFP4", "NVFP4"):
        out.add("DSP308", f"{weight} is stored as NVFP4 but {quant.where} quantizes {module.prefix} as "
                f"{claimed}.", f"Set {module.prefix!r} to quant_algo W4A16_NVFP4.")
    elif claimed == "W4A16_NVFP4" and f"{weight.rsplit('.', 1)[0]}.input_scale" in ctx.tensors:
        out.add("DSP315", f"{weight.rsplit('.', 1)[0]}.input_scale is shipped beside a W4A16 layer: vLLM "
                "versions whose W4A16 method registers no input_scale fail with 'There is no module or parameter "
                "named ...', and the others load it into a placeholder they never read.",
                "Remove the input_scale (weight-only W4A16 has no activation scale; dspark quantize writes none).")
    elif claimed == "NVFP4" and f"{weight.rsplit('.', 1)[0]}.input_scale" not in ctx.tensors:
        out.add("DSP311", f"{quant.where} quantizes {module.prefix} as NVFP4 (W4A4), which needs "
                f"{weight.rsplit('.', 1)[0]}.input_scale, and the checkpoint has none.",
                "Use quant_algo W4A16_NVFP4 (weight-only; what dspark quantize writes).")
    return out


def _fp8_claim(ctx: RuleContext, module: LinearModule, weight: str, claimed: str | None) -> Results:
    out, quant = Results(), ctx.quant
    if quant is None:
        why = ("the checkpoint has no quantization config (config.json quantization_config or "
               "hf_quant_config.json), so vLLM builds a bf16 layer")
    elif claimed is None:
        why = f"{quant.where} leaves {module.prefix} unquantized (excluded, or not in quantized_layers)"
    else:
        why = f"{quant.where} quantizes {module.prefix} as {claimed}"
    out.add("DSP319", f"{weight} is stored as FP8 (float8_e4m3fn) but {why}; vLLM would load or scale it wrongly.",
            f"Name {module.prefix!r} in quantized_layers with quant_algo FP8 (MIXED_PRECISION; what dspark quantize "
            "writes with the fp8 format).")
    return out


def marlin_head(ctx: RuleContext) -> Results:
    """DSP314: an NVFP4 W4A16 markov_w2 runs on vLLM's Marlin FP4 kernel."""
    out = Results()
    if ctx.head_claim == "W4A16_NVFP4":
        out.add("DSP314", f"markov_w2 is NVFP4 W4A16 ({ctx.quant.algo}); vLLM runs it with the Marlin FP4 "
                f"kernel, which needs compute capability >= {MARLIN_FP4_MIN_CAPABILITY} (vLLM releases whose "
                "ModelOpt MIXED_PRECISION config still asks for 8.9 refuse it on Turing and Ampere).",
                "Nothing to do on Turing or newer GPUs with a current vLLM; on Turing/Ampere with an older vLLM, "
                "serve the bf16 draft.")
    return out
