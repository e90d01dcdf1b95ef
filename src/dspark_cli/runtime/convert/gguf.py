"""A DSpark/DFlash draft as a llama.cpp `dflash` GGUF (llama.cpp release b11434), written with the `gguf` package.

What llama.cpp expects was read from its source at b11434:
- conversion/qwen.py, DSparkModel and DFlashModel: the keys (`dflash.block_size`, `dflash.target_layers` as
  DeepSpec's 0-based "output of layer k" ids plus one, `dflash.sample_from_anchor`, `dflash.has_confidence_head`,
  `tokenizer.ggml.mask_token_id`), the tokenizer taken from the target, a Markov head other than "vanilla" refused,
  `d2t` written as absolute target ids (I64); conversion/base.py TextModel.set_gguf_parameters for the common keys.
- gguf-py/gguf/constants.py and tensor_mapping.py: the tensor names (`markov_w1`, `markov_w2`, `conf_proj`, `fc`,
  `enc.output_norm` for hidden_norm, `blk.N.*` for the decoder layers).
- src/models/dflash.cpp, llama_model_dflash::load_arch_tensors: `conf_proj.weight` is [hidden + markov_rank, 1]
  (the confidence head must read the Markov state), `markov_w2` has at most a per-tensor `.scale` (no NVFP4 block
  scales), `output.weight` is optional (a full-vocabulary draft without one uses its token embeddings).
- common/speculative.cpp, the draft-dflash constructor: `dflash.attention.causal`, one bool for the whole draft
  (non-causal when absent); nothing selects causality per layer.
The draft's tensors are carried exactly: matrices in their own dtype, vectors as F32 (what llama.cpp's converter
does with 1-D tensors; BF16 and F16 widen to F32 without rounding). A Linear weight `dspark quantize --scope draft`
stored as ModelOpt NVFP4 or FP8 is written dequantized, as F32 (exact: the value vLLM's kernel and dspark's runtime
multiply with; convert/dequant.py), its scale tensors not written; FP8's static input_scale has no GGUF counterpart
and is dropped. A draft lm_head is kept as `output.weight`
(llama.cpp's converter drops a full-vocabulary one to share the target's; keeping it changes nothing for a draft
whose head is the target's and keeps one that is not).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.fingerprint import SOURCE_KEY, folder_fingerprint
from dspark_cli.runtime.checkpoint.gguf_read import LAYER_IDS_KEY
from dspark_cli.runtime.checkpoint.layout import MARKOV_W2_SCALE, canonical_name
from dspark_cli.runtime.checkpoint.read import Checkpoint, TensorInfo, open_checkpoint
from dspark_cli.runtime.convert import dflash2_gguf
from dspark_cli.runtime.convert.dequant import QuantizedLinear, dequantize, quantized_linears
from dspark_cli.runtime.convert.gguf_vocab import read_vocab, write_vocab
from dspark_cli.runtime.engines import llamacpp
from dspark_cli.runtime.io.outputs import atomic_output_file, check_output_file, local_inputs

ARCH = "dflash"  # gguf-py/gguf/constants.py MODEL_ARCH_NAMES[MODEL_ARCH.DFLASH]
LAYER_TENSORS = {  # DeepSpec name inside layers.N -> llama.cpp name inside blk.N (gguf-py tensor_mapping.py)
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_TENSORS = {
    "embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "norm.weight": "output_norm.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "fc.weight": "fc.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
SKIPPED = ("t2d", "mask_embedding")  # not read at runtime (conversion/qwen.py DSparkModel.filter_tensors)
FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_BF16


def convert_to_gguf(draft: str, out: str | os.PathLike, target: str, force: bool = False) -> dict[str, Any]:
    """Write the draft as a llama.cpp dflash GGUF at `out` (exclusive unless `force`); a summary of what was
    written. DsparkError, before anything is written, when the conversion cannot be faithful."""
    out = Path(out)
    check_output_file(out, local_inputs("draft", [draft]) + local_inputs("target", [target]), "the output")
    ckpt = open_checkpoint(draft)
    config = DraftConfig.from_dict(ckpt.config)
    target_dir = _target_folder(target)
    refuse_unfaithful(config, ckpt)
    linears = quantized_linears(ckpt)
    names = gguf_tensor_names(ckpt, linears)
    vocab = read_vocab(target_dir, config.vocab_size)
    with atomic_output_file(out, force) as tmp:
        writer = _writer(tmp)
        write_keys(writer, config, names, ckpt, Path(draft).name, linears)
        write_source(writer, ckpt)
        write_vocab(writer, vocab)
        for source, name in names.items():
            if source in linears:
                writer.add_tensor(name, dequantize(ckpt, linears[source]))
            else:
                add_tensor(writer, name, ckpt, ckpt.tensors[source])
        _add_d2t(writer, ckpt)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return {"output": str(out), "architecture": ARCH, "tensors": len(names) + (_d2t_name(ckpt) is not None),
            "target_layers": llamacpp_target_layers(config.layer_ids), **dequantized_summary(linears)}


def dequantized_summary(linears: dict[str, QuantizedLinear]) -> dict:
    """What the conversion dequantized: {"dequantized": {"fp8": 8}, "dropped": [FP8 input_scale names]}, or {}."""
    if not linears:
        return {}
    counts: dict[str, int] = {}
    for linear in linears.values():
        counts[linear.format] = counts.get(linear.format, 0) + 1
    return {"dequantized": counts, "dropped": sorted(name for linear in linears.values() for name in linear.dropped)}


def refuse_unfaithful(config: DraftConfig, ckpt: Checkpoint) -> None:
    """DsparkError naming why llama.cpp's dflash model would not run this draft as dspark does."""
    reason = unfaithful_reason(config, ckpt)
    if reason:
        raise DsparkError(f"{ckpt.source} cannot be converted to a llama.cpp GGUF faithfully: {reason}.")


def unfaithful_reason(config: DraftConfig, ckpt: Checkpoint) -> str | None:
    """Why the conversion would change the draft (src/models/dflash.cpp, conversion/qwen.py), or None."""
    dflash2 = dflash2_gguf.dflash2_keys(config.raw)
    if config.kind not in ("dspark", "dflash") and dflash2 is None:
        return "its config is not a DSpark, DFlash or DFlash2 draft's"
    if config.family not in llamacpp.FAMILIES:  # the verdict's DSP721, the Markov head its DSP012, the same lists
        return f"it is a {config.family_title} draft, and dspark converts Qwen3-family drafts only"
    if config.has_markov and llamacpp.ENGINE.refuses_head(config.markov_head_type):
        return (f"its Markov head is {config.markov_head_type!r}, and llama.cpp's dflash model has the vanilla head "
                "only (markov_w1 and markov_w2), so the head's extra layers would be dropped")
    if _quantized_head(ckpt):
        return ("its markov_w2 is NVFP4-quantized, and llama.cpp's dflash model reads no block scales; convert the "
                "draft before quantizing it")
    confidence = llamacpp.conf_proj_refusal(config, _has_confidence(ckpt))  # the verdict's DSP724
    if confidence:
        return confidence
    if not config.layer_ids:
        return "its config names no target_layer_ids"
    attention = attention_refusal(config)
    if attention:
        return attention
    if dflash2 is not None:
        return dflash2_gguf.startup_refusal(dflash2, config.hidden_size, config.block_size.value)
    return None


def attention_refusal(config: DraftConfig) -> str | None:
    """Why llama.cpp's dflash model cannot attend as vLLM does (DraftConfig.layer_attention, docs/format.md §2.3):
    vLLM could not build the layers, or they differ in causality, which llama.cpp reads once for the whole draft
    (engines/llamacpp.causality_refusal, validate's DSP727); None when it can."""
    layers = config.layer_attention
    if layers is None:
        return ("its layer_types is not one full_attention or sliding_attention entry per layer, or it has sliding "
                "layers and no window size (sliding_window or dflash_config.swa_window_size)")
    return llamacpp.causality_refusal(config)  # the verdict's DSP727


def write_source(writer, ckpt: Checkpoint) -> None:
    """The converted folder's fingerprint (checkpoint/fingerprint.py), which `dspark plan` matches to eval runs."""
    source = folder_fingerprint(ckpt.local_dir) if ckpt.local_dir is not None else None
    if source is not None:
        writer.add_string(SOURCE_KEY, source)


def window_keys(config: DraftConfig) -> tuple[int, list[bool]] | None:
    """The sliding window and which layers use it, from DraftConfig.layer_attention (vLLM's resolution), as
    llama.cpp's dflash model reads them (src/models/dflash.cpp load_arch_hparams: `dflash.attention.sliding_window`,
    then `dflash.attention.sliding_window_pattern`, one bool per layer); None for a draft whose layers are all full
    attention."""
    sliding = [layer.window is not None for layer in config.layer_attention]
    if not any(sliding):
        return None
    return next(layer.window for layer in config.layer_attention if layer.window is not None), sliding


def write_attention(writer, config: DraftConfig) -> None:
    """The window keys, and `dflash.attention.causal` true when the layers are causal (attention_refusal made them
    all alike); llama.cpp reads the key's absence as non-causal, the DeepSpec default, so nothing is written then."""
    window = window_keys(config)
    if window is not None:
        writer.add_uint32(f"{ARCH}.attention.sliding_window", window[0])
        writer.add_array(f"{ARCH}.attention.sliding_window_pattern", window[1])
    if config.layer_attention[0].causal:
        writer.add_bool(f"{ARCH}.attention.causal", True)


def llamacpp_target_layers(layer_ids: list[int]) -> list[int]:
    """DeepSpec's target_layer_ids (0-based, "output of layer k", HF hidden_states[k + 1]) as llama.cpp's
    extract layers (conversion/qwen.py DFlashModel.set_gguf_parameters: `[i + 1 for i in target_layer_ids]`)."""
    return [i + 1 for i in layer_ids]


def gguf_tensor_names(ckpt: Checkpoint, linears: dict[str, QuantizedLinear] | None = None) -> dict[str, str]:
    """On-disk name -> llama.cpp name for every tensor written (d2t and the scales of quantized Linear layers,
    `linears`, apart: those weights are written dequantized); DsparkError for one llama.cpp does not load."""
    scales = {name for linear in (linears or {}).values() for name in linear.scales}
    names = {}
    for source in ckpt.tensors:
        name = canonical_name(source)
        if name in SKIPPED or name == "d2t" or source in scales:
            continue
        mapped = _llamacpp_name(name)
        if mapped is None:
            raise DsparkError(f"{ckpt.source} cannot be converted to a llama.cpp GGUF faithfully: llama.cpp's dflash "
                              f"model loads no tensor like {source}.")
        names[source] = mapped
    return names


def write_keys(writer, config: DraftConfig, names: dict[str, str], ckpt: Checkpoint, title: str,
               linears: dict[str, QuantizedLinear] | None = None) -> None:
    """The keys llama.cpp's converter writes for a DSpark draft (conversion/base.py, conversion/qwen.py)."""
    writer.add_type("model")
    writer.add_name(title)
    for key, value in _uint_keys(config, ckpt, linears or {}).items():
        writer.add_uint32(key, value)
    writer.add_float32(f"{ARCH}.rope.freq_base", config.rope_theta)
    writer.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_array(f"{ARCH}.target_layers", llamacpp_target_layers(config.layer_ids))
    writer.add_array(LAYER_IDS_KEY, list(config.layer_ids))  # DeepSpec's ids: validate checks the +1 against them
    write_attention(writer, config)
    dflash2 = dflash2_gguf.dflash2_keys(config.raw)
    if dflash2 is None:
        writer.add_bool(f"{ARCH}.sample_from_anchor", config.sample_from_anchor)
        writer.add_bool(f"{ARCH}.has_confidence_head", "conf_proj.weight" in names.values())
    else:  # conversion/qwen.py's DFlashModel: the selector's keys, no DSpark ones
        uints, floats = dflash2_gguf.gguf_keys(dflash2)
        for key, value in uints.items():
            writer.add_uint32(key, value)
        for key, value in floats.items():
            writer.add_float32(key, value)
    writer.add_uint32("general.quantization_version", 2)


def _uint_keys(config: DraftConfig, ckpt: Checkpoint, linears: dict[str, QuantizedLinear]) -> dict[str, int]:
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    keys = {
        f"{ARCH}.block_count": config.num_hidden_layers,
        f"{ARCH}.context_length": config.raw.get("max_position_embeddings"),
        f"{ARCH}.embedding_length": config.hidden_size,
        f"{ARCH}.feed_forward_length": config.intermediate_size,
        f"{ARCH}.attention.head_count": config.num_attention_heads,
        f"{ARCH}.attention.head_count_kv": config.num_key_value_heads,
        f"{ARCH}.attention.key_length": head_dim,
        f"{ARCH}.attention.value_length": head_dim,
        "general.file_type": file_type(ckpt, linears),
        f"{ARCH}.block_size": config.block_size.value,
        "tokenizer.ggml.mask_token_id": config.mask_token_id,
    }
    return {key: int(value) for key, value in keys.items() if value is not None}


def _llamacpp_name(name: str) -> str | None:
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        mapped = LAYER_TENSORS.get(rest)
        return f"blk.{index}.{mapped}" if mapped else dflash2_gguf.llamacpp_name(name)
    return TOP_TENSORS.get(name) or dflash2_gguf.llamacpp_name(name)


def file_type(ckpt: Checkpoint, dequantized: dict[str, QuantizedLinear] | None = None) -> int:
    """llama.cpp's general.file_type for the draft's matrices as written: the dtype most of their bytes are in (a
    `dequantized` weight as the F32 it is written in, its scales not at all)."""
    dequantized = dequantized or {}
    scales = {name for linear in dequantized.values() for name in linear.scales}
    sizes: dict[str, int] = {}
    for info in ckpt.tensors.values():
        if info.name in dequantized:
            numel = info.numel * (2 if dequantized[info.name].format == "nvfp4" else 1)  # two codes a byte
            sizes["F32"] = sizes.get("F32", 0) + 4 * numel
        elif len(info.shape) == 2 and info.name not in scales:
            sizes[info.dtype] = sizes.get(info.dtype, 0) + info.nbytes
    return FILE_TYPES.get(max(sizes, key=sizes.get), 0)


def _quantized_head(ckpt: Checkpoint) -> bool:
    """markov_w2 with NVFP4 block scales beside it, or stored packed (not F32 / F16 / BF16)."""
    dtypes = {canonical_name(name): info.dtype for name, info in ckpt.tensors.items()}
    return MARKOV_W2_SCALE in dtypes or dtypes.get("markov_head.markov_w2.weight", "F32") not in FILE_TYPES


def _has_confidence(ckpt: Checkpoint) -> bool:
    return any(canonical_name(name).startswith("confidence_head.") for name in ckpt.tensors)


def _writer(path: Path):
    import gguf

    return gguf.GGUFWriter(path, ARCH)


def _array(ckpt: Checkpoint, info: TensorInfo):
    """The tensor's values as numpy, exactly: BF16 as its raw 16 bits (uint16)."""
    import numpy as np

    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64}
    if info.dtype not in dtypes:
        raise DsparkError(f"{ckpt.source}: {info.name} is stored as {info.dtype}, which dspark does not convert.")
    data = np.fromfile(ckpt.file_path(info.file), dtype=dtypes[info.dtype],
                       count=info.numel, offset=info.begin)
    return data.reshape(info.shape)


def add_tensor(writer, name: str, ckpt: Checkpoint, info: TensorInfo) -> None:
    """Matrices in their own dtype; vectors and the tensors llama.cpp's converter keeps F32 (DFlash2's conv base
    kernels) widened to F32, exactly (BF16's bits are the top half of F32's)."""
    import gguf
    import numpy as np

    data = _array(ckpt, info)
    if len(info.shape) == 1 or dflash2_gguf.kept_f32(name):
        data = (data.astype(np.uint32) << 16).view(np.float32) if info.dtype == "BF16" else data.astype(np.float32)
        writer.add_tensor(name, data)
    elif info.dtype == "BF16":
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        writer.add_tensor(name, data)


def _d2t_name(ckpt: Checkpoint) -> str | None:
    return next((name for name in ckpt.tensors if canonical_name(name) == "d2t"), None)


def _add_d2t(writer, ckpt: Checkpoint) -> None:
    """A reduced vocabulary's d2t as absolute target ids (conversion/qwen.py DSparkModel.prepare_tensors)."""
    import gguf
    import numpy as np

    source = _d2t_name(ckpt)
    if source is None:
        return
    offsets = _array(ckpt, ckpt.tensors[source]).reshape(-1).astype(np.int64)
    writer.add_tensor("d2t", offsets + np.arange(offsets.size, dtype=np.int64),
                      raw_dtype=gguf.GGMLQuantizationType.I64)


def _target_folder(target: str) -> Path:
    path = Path(target).expanduser()
    if not path.is_dir():
        raise DsparkError(f"the target {target} is not a local folder; the GGUF takes its tokenizer from the "
                          "target's folder, so pass that folder.")
    return path

