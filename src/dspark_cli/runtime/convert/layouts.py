"""A DSpark draft rewritten between the two layouts vLLM reads: DeepSpec's and speculators' (docs/formats-other.md §3).

The tensors keep their DeepSpec names in both layouts (§3.2; `model.` prefixes and DFlash aliases are renamed to
them) and are copied byte for byte, in their own dtypes, into one model.safetensors. A reduced vocabulary's `t2d`
(speculators writes it, vLLM skips it) is derived from `d2t` on the way to speculators and dropped on the way to
DeepSpec, after checking it is the one `d2t` implies. The new config.json is built from the source's resolved
values; a conversion is refused, before anything is written, when the new config would resolve any DraftConfig
field differently from the source (so vLLM would serve another draft) or the layout cannot hold the draft.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.layout import MARKOV_W2_SCALE, canonical_name
from dspark_cli.runtime.checkpoint.read import Checkpoint, TensorInfo, open_checkpoint
from dspark_cli.runtime.io.outputs import (atomic_output_dir, check_writable_parent, local_inputs,
                                        refuse_input_overlap)

LAYOUTS = {"deepspec": "deepspec", "speculators": "speculators-dspark"}  # the to option -> DraftConfig.format
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
SPECULATORS_ARCHITECTURE = "DSparkSpeculator"
# DeepSpec keys the speculators layout holds at its top level (or as aux_hidden_state_layer_ids) and vLLM's adapter
# sets from there; every other DeepSpec key travels inside transformer_layer_config.
DRAFT_KEYS = ("architectures", "target_layer_ids", "mask_token_id", "block_size", "draft_vocab_size",
              "target_hidden_size", "sample_from_anchor", "dspark_bonus_anchor", "markov_rank", "markov_head_type",
              "enable_confidence_head", "confidence_head_with_markov", "dflash_config")
SPECULATORS_ONLY_KEYS = ("speculators_model_type", "transformer_layer_config", "aux_hidden_state_layer_ids",
                         "speculators_config")
UNCOMPARED_FIELDS = ("raw", "format", "vllm_config", "nested_only")  # how the config says it, not what it says
SPECULATORS_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # speculators drafts always carry both
WEIGHTS_FILE = "model.safetensors"


def convert_layout(draft: str, out: str | os.PathLike, to: str, target: str | None = None,
                   force: bool = False) -> dict[str, Any]:
    """Write the draft in layout `to` ("deepspec" or "speculators") as the folder `out` (exclusive unless
    `force`); a summary. DsparkError, before anything is written, when the conversion cannot be faithful."""
    out = Path(out)
    refuse_input_overlap(out, local_inputs("draft", [draft]), "the output folder")
    check_writable_parent(out, "the output folder")
    ckpt = open_checkpoint(draft)
    config = DraftConfig.from_dict(ckpt.config)
    refuse(ckpt, unfaithful_reason(config, ckpt, to, target))
    new_config = speculators_config(config, target) if to == "speculators" else deepspec_config(config)
    refuse(ckpt, config_difference(config, new_config))
    tensors = layout_tensors(ckpt, config, to)
    with atomic_output_dir(out, force) as tmp:
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n", encoding="utf-8")
        write_safetensors(tmp / WEIGHTS_FILE, ckpt, tensors)
    return {"output": str(out), "layout": to, "tensors": len(tensors)}


def refuse(ckpt: Checkpoint, reason: str | None) -> None:
    if reason:
        raise DsparkError(f"{ckpt.source} cannot be converted faithfully: {reason}.")


def unfaithful_reason(config: DraftConfig, ckpt: Checkpoint, to: str, target: str | None) -> str | None:
    """Why the layout `to` cannot hold this draft as it is, or None."""
    if config.format not in LAYOUTS.values():
        return (f"it is in the {config.format} layout, and dspark converts DSpark drafts between the deepspec and "
                "speculators layouts only")
    if config.format == LAYOUTS[to]:
        return f"it is already in the {to} layout"
    if config.raw.get("quantization_config") or ckpt.hf_quant_config or _has(ckpt, MARKOV_W2_SCALE):
        return ("it is quantized, and dspark does not know which module names vLLM's speculators loader asks the "
                "quantization config about; convert the draft before quantizing it")
    if to == "speculators" and not all(_has(ckpt, name) for name in SPECULATORS_TENSORS):
        return "a speculators draft carries embed_tokens and lm_head, and this draft shares the target's"
    if to == "speculators" and not target:
        return ("a speculators config names its verifier (speculators_config.verifier.name_or_path, which vLLM "
                "requires), so the target option must name the target")
    return None


def speculators_config(config: DraftConfig, target: str) -> dict[str, Any]:
    """DeepSpec's config as speculators writes it (docs/formats-other.md §3.1): the draft fields at the top level,
    the rest as transformer_layer_config."""
    return {
        "speculators_model_type": "dspark",
        "architectures": [SPECULATORS_ARCHITECTURE],
        "transformer_layer_config": {k: v for k, v in config.raw.items() if k not in DRAFT_KEYS},
        "aux_hidden_state_layer_ids": config.hidden_state_indices,
        **_draft_fields(config),
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": _speculative_tokens(config)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target},
        },
    }


def deepspec_config(config: DraftConfig) -> dict[str, Any]:
    """A speculators config as DeepSpec writes it: transformer_layer_config with the draft fields beside it."""
    layer = {k: v for k, v in config.raw["transformer_layer_config"].items() if k not in DRAFT_KEYS}
    new = {"architectures": [DEEPSPEC_ARCHITECTURE], **layer, "target_layer_ids": config.layer_ids,
           **_draft_fields(config)}
    if not config.sample_from_anchor:
        new["dspark_bonus_anchor"] = True  # the only layout key vLLM's DSpark model reads
    return new


def _draft_fields(config: DraftConfig) -> dict[str, Any]:
    """The draft's own fields, resolved, under the names both layouts share."""
    fields = {"mask_token_id": config.mask_token_id, "block_size": config.block_size.value,
              "draft_vocab_size": config.draft_vocab_size}
    if config.target_hidden_size != config.hidden_size:
        fields["target_hidden_size"] = config.target_hidden_size
    fields.update(sample_from_anchor=config.sample_from_anchor, markov_rank=config.markov_rank,
                  enable_confidence_head=config.enable_confidence_head,
                  confidence_head_with_markov=config.confidence_head_with_markov)
    if config.has_markov:
        fields["markov_head_type"] = config.markov_head_type
    return fields


def _speculative_tokens(config: DraftConfig) -> int:
    """speculators' default proposal length: B in the N-query layout, B - 1 in the 1+N one."""
    block = config.block_size.value
    return block if config.sample_from_anchor else block - 1


def config_difference(source: DraftConfig, new: dict[str, Any]) -> str | None:
    """The first DraftConfig field the new config resolves differently (vLLM would serve another draft), or None."""
    converted = DraftConfig.from_dict(new)
    for field in dataclasses.fields(DraftConfig):
        if field.name in UNCOMPARED_FIELDS:
            continue
        before, after = _value(source, field.name), _value(converted, field.name)
        if before != after:
            return (f"the new config would resolve {field.name} as {after!r} where the draft's resolves "
                    f"{before!r}, and that layout has no key that keeps it")
    return None


def _value(config: DraftConfig, name: str) -> Any:
    value = getattr(config, name)
    return value.value if hasattr(value, "source") else value


def layout_tensors(ckpt: Checkpoint, config: DraftConfig, to: str) -> dict[str, TensorInfo | bytes]:
    """New name -> the source tensor to copy, or (t2d) the raw bytes to write."""
    tensors: dict[str, TensorInfo | bytes] = {}
    for name, info in ckpt.tensors.items():
        new_name = canonical_name(name)
        if new_name in tensors:
            raise DsparkError(f"{ckpt.source} holds two tensors named {new_name} once renamed ({name} and another); "
                              "remove the duplicate before converting it.")
        tensors[new_name] = info
    t2d = tensors.pop("t2d", None)
    derived = _derived_t2d(ckpt, tensors.get("d2t"), config)
    if isinstance(t2d, TensorInfo) and derived != _read(ckpt, t2d):
        refuse(ckpt, "its t2d is not the one its d2t implies, and the deepspec layout keeps d2t only")
    if to == "speculators" and derived is not None:
        tensors["t2d"] = derived
    return tensors


def _derived_t2d(ckpt: Checkpoint, d2t: TensorInfo | bytes | None, config: DraftConfig) -> bytes | None:
    """speculators' t2d [V] bool: True at every target id a draft id maps to (target = id + d2t[id])."""
    if not isinstance(d2t, TensorInfo):
        return None
    import numpy as np

    offsets = np.frombuffer(_read(ckpt, d2t), dtype="<i8")
    t2d = np.zeros(config.vocab_size, dtype=np.uint8)
    t2d[offsets + np.arange(offsets.size)] = 1
    return t2d.tobytes()


def write_safetensors(path: Path, ckpt: Checkpoint, tensors: dict[str, TensorInfo | bytes]) -> None:
    """One safetensors file holding `tensors` in name order, their bytes copied unchanged."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, payload in sorted(tensors.items()):
        dtype, shape, size = _entry(payload)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as dst:
        dst.write(struct.pack("<Q", len(encoded)) + encoded)
        for _, payload in sorted(tensors.items()):
            dst.write(payload if isinstance(payload, bytes) else _read(ckpt, payload))


def _entry(payload: TensorInfo | bytes) -> tuple[str, list[int], int]:
    if isinstance(payload, bytes):  # t2d
        return "BOOL", [len(payload)], len(payload)
    return payload.dtype, list(payload.shape), payload.nbytes


def _read(ckpt: Checkpoint, info: TensorInfo) -> bytes:
    with open(ckpt.file_path(info.file), "rb") as handle:
        handle.seek(info.begin)
        data = handle.read(info.nbytes)
    if len(data) != info.nbytes:
        raise DsparkError(f"{info.file} ends inside tensor {info.name}; the file is truncated, re-download it.")
    return data


def _has(ckpt: Checkpoint, name: str) -> bool:
    return any(canonical_name(source) == name for source in ckpt.tensors)
