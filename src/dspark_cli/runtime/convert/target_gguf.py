"""A Hugging Face Qwen3 or Qwen2 target (attention-only, text-only) as the `qwen3` / `qwen2` GGUF llama.cpp b11434
loads as `-m`, written with the `gguf` package; torch-free (tensors read from the safetensors files as numpy).

What llama.cpp expects was read from its source at b11434: src/llama-arch.cpp (LLM_ARCH_QWEN3 "qwen3", LLM_ARCH_QWEN2
"qwen2", the keys `ARCH.block_count` ... `ARCH.attention.value_length` and tensor names), src/models/qwen3.cpp (Q/K
RMS norms), src/models/qwen2.cpp (Q/K/V biases, no norms); `output.weight` is optional in both (a tied model uses
`token_embd.weight`); conversion/qwen.py and conversion/base.py for what llama.cpp's converter writes (matrices in
their dtype, vectors as F32, no Q/K permutation: Qwen's rotary embedding is llama.cpp's NEOX one, llama-model.cpp
llama_model_rope_type). The tokenizer is gguf_vocab.py's. Anything llama.cpp's model would run differently
(rope scaling, sliding windows, other attention biases, stateful or multimodal models, quantized weights) is
refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import detect_format
from dspark_cli.runtime.checkpoint.read import Checkpoint, open_checkpoint
from dspark_cli.runtime.checkpoint.stateful import family_of_config_dict
from dspark_cli.runtime.checkpoint.target_files import check_target_files
from dspark_cli.runtime.convert.gguf import FILE_TYPES, LAYER_TENSORS, add_tensor, file_type, write_source
from dspark_cli.runtime.convert.gguf_vocab import read_vocab, write_vocab
from dspark_cli.runtime.io.outputs import atomic_output_file, check_output_file, local_inputs



@dataclass(frozen=True)
class Family:
    """A target family dspark writes: llama.cpp's architecture name and what its layers hold beyond LAYER_TENSORS."""

    architecture: str  # the HF config's architectures[0]
    qk_norm: bool  # attn_q_norm / attn_k_norm (src/models/qwen3.cpp)
    qkv_bias: bool  # attn_q / attn_k / attn_v biases (src/models/qwen2.cpp, create_tensor_qkv)


FAMILIES = {  # by model_type = llama-arch.cpp's architecture name
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, qkv_bias=False),
    "qwen2": Family("Qwen2ForCausalLM", qk_norm=False, qkv_bias=True),
}
QK_NORMS = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
QKV_BIASES = {"self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.bias": "attn_v.bias"}
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings")
TOP_TENSORS = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}


def is_target(source: str) -> bool:
    """Whether `source`'s config.json is a model's rather than a DSpark/DFlash draft's (which convert_to_gguf
    writes): the convert command's choice between the two GGUF writers."""
    return detect_format(open_checkpoint(source).config) == "unknown"


def convert_target_to_gguf(target: str, out: str | os.PathLike, force: bool = False) -> dict[str, Any]:
    """Write the target folder as a llama.cpp qwen3 / qwen2 GGUF at `out` (exclusive unless `force`); a summary of
    what was written. DsparkError, before anything is written, when llama.cpp would not run it as transformers does."""
    out = Path(out)
    check_output_file(out, local_inputs("target", [target]), "the output")
    folder = Path(target).expanduser()
    if not folder.is_dir():
        raise DsparkError(f"the target {target} is not a local folder; download it first and pass its folder.")
    check_target_files(target, config=False)  # every value the keys below read, by type: one sentence
    ckpt = open_checkpoint(target)
    config = ckpt.config
    refuse_unsupported(target, config)
    names = target_tensor_names(ckpt, config)
    vocab = read_vocab(folder, config["vocab_size"])
    import gguf

    with atomic_output_file(out, force) as tmp:
        writer = gguf.GGUFWriter(tmp, config["model_type"])
        write_keys(writer, config, ckpt, folder.name)
        write_source(writer, ckpt)
        write_vocab(writer, vocab)
        for source, name in names.items():
            add_tensor(writer, name, ckpt, ckpt.tensors[source])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return {"output": str(out), "architecture": config["model_type"], "tensors": len(names), "pre_tokenizer": vocab.pre,
            "vocab_size": len(vocab.tokens)}


def refuse_unsupported(target: str, config: dict) -> None:
    reason = unsupported_reason(config)
    if reason:
        raise DsparkError(f"{target} cannot be converted to a llama.cpp GGUF by dspark: {reason}.")


def unsupported_reason(config: dict) -> str | None:
    """Why llama.cpp's model would not run this target as transformers does, or None."""
    family = family_of_config_dict(config)
    if family is not None:
        return f"it is a stateful {family.name} model, and dspark writes attention-only Qwen3 targets only"
    if isinstance(config.get("text_config"), dict):
        return "it is a multimodal model (its config has a text_config), and dspark writes text-only Qwen3 targets"
    family = FAMILIES.get(config.get("model_type"))
    if family is None or config.get("architectures") != [family.architecture]:
        known = " and ".join(f.architecture for f in FAMILIES.values())
        return (f"it is a {config.get('model_type')!r} model ({config.get('architectures')}), and dspark writes "
                f"{known} targets only; convert it with llama.cpp's own converter")
    missing = [key for key in REQUIRED if not _positive(config.get(key))]
    if missing:
        return f"its config has no positive integer {missing[0]}"
    if not isinstance(config.get("rms_norm_eps"), float):
        return "its config has no rms_norm_eps"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"its rope scaling is {rope.get('rope_type', rope.get('type'))!r}, which dspark does not write"
    if rope_theta(config) is None:
        return "its config has no rope_theta"
    if config.get("use_sliding_window") or any(t != "full_attention" for t in config.get("layer_types") or []):
        return "it uses sliding-window attention, which dspark does not write"
    if config.get("attention_bias") and not family.qkv_bias:
        return f"its attention has biases, which llama.cpp's {config['model_type']} model does not load"
    return None


def rope_theta(config: dict) -> float | None:
    """transformers 5's rope_parameters.rope_theta, or the older top-level rope_theta."""
    value = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def target_tensor_names(ckpt: Checkpoint, config: dict) -> dict[str, str]:
    """On-disk name -> llama.cpp name for every tensor written; DsparkError for a tensor llama.cpp does not load,
    a missing one, or one not stored as F32 / F16 / BF16."""
    tied = bool(config.get("tie_word_embeddings", False))
    family = FAMILIES[config["model_type"]]
    layer = {**{k: v for k, v in LAYER_TENSORS.items() if family.qk_norm or k not in QK_NORMS},
             **(QKV_BIASES if family.qkv_bias else {})}
    names = {}
    for source, info in ckpt.tensors.items():
        name = source.removeprefix("model.")
        if name == "lm_head.weight" and tied:
            continue  # llama.cpp uses token_embd for a model without output.weight
        mapped = "output.weight" if name == "lm_head.weight" else _layer_name(name, layer) or TOP_TENSORS.get(name)
        if mapped is None:
            raise DsparkError(f"{ckpt.source} cannot be converted to a llama.cpp GGUF by dspark: llama.cpp's "
                              f"{config['model_type']} model loads no tensor like {source}.")
        if info.dtype not in FILE_TYPES:
            raise DsparkError(f"{ckpt.source} cannot be converted to a llama.cpp GGUF by dspark: {source} is stored "
                              f"as {info.dtype}; convert the unquantized model.")
        names[source] = mapped
    expected = {*TOP_TENSORS.values(), *(() if tied else ("output.weight",)),
                *(f"blk.{i}.{name}" for i in range(config["num_hidden_layers"]) for name in layer.values())}
    missing = sorted(expected - set(names.values()))
    if missing:
        raise DsparkError(f"{ckpt.source} cannot be converted to a llama.cpp GGUF by dspark: it has no tensor for "
                          f"llama.cpp's {missing[0]} ({len(missing)} missing).")
    return names


def write_keys(writer, config: dict, ckpt: Checkpoint, title: str) -> None:
    """The keys llama.cpp reads (llama-arch.cpp LLM_KV_*, as llama.cpp's converter writes them)."""
    arch = config["model_type"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_type("model")
    writer.add_name(title)
    uints = {
        "block_count": config["num_hidden_layers"], "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"], "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": config.get("num_key_value_heads", heads),
        "attention.key_length": head_dim, "attention.value_length": head_dim,
    }
    for key, value in uints.items():
        writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_float32(f"{arch}.rope.freq_base", rope_theta(config))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(config["rms_norm_eps"]))
    writer.add_uint32("general.file_type", file_type(ckpt))
    writer.add_uint32("general.quantization_version", 2)


def _layer_name(name: str, layer: dict[str, str]) -> str | None:
    if not name.startswith("layers."):
        return None
    _, index, rest = name.split(".", 2)
    mapped = layer.get(rest)
    return f"blk.{index}.{mapped}" if mapped else None


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
