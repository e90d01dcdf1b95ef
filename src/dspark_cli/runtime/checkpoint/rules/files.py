"""Files (DSP4xx): pickle weights, a tensor stored twice, an index that disagrees with the shards."""

from __future__ import annotations

from dspark_cli.runtime.checkpoint.rules.codes import Results
from dspark_cli.runtime.checkpoint.rules.context import RuleContext


def pickle_files(ctx: RuleContext) -> Results:
    out = Results()
    for name in ctx.ckpt.pickle_files:
        out.add("DSP401", f"{name} is a pickle file; dspark never loads it, because unpickling can run code.",
                "Delete it or convert it to safetensors; vLLM loads the .safetensors weights.")
    return out


def duplicate_tensors(ctx: RuleContext) -> Results:
    out, seen = Results(), {}
    for file, infos in ctx.ckpt.shards.items():
        for name in infos:
            if name in seen:
                out.add("DSP402", f"tensor {name!r} is in both {seen[name]} and {file}.",
                        "Re-save the checkpoint so every tensor is stored once.")
            else:
                seen[name] = file
    return out


def index_agreement(ctx: RuleContext) -> Results:
    """DSP403 where the index and the shard headers disagree, DSP404 for a shard the index does not name."""
    ckpt, out = ctx.ckpt, Results()
    if ckpt.index is None:
        return out
    weight_map: dict[str, str] = ckpt.index.get("weight_map", {})
    for name, file in sorted(weight_map.items()):
        if name in ckpt.shards.get(file, {}):
            continue
        holders = [f for f, infos in ckpt.shards.items() if name in infos]
        where = f"it is in {holders[0]}" if holders else "no shard holds it"
        out.add("DSP403", f"the index maps {name!r} to {file}, but {where}.",
                "Regenerate model.safetensors.index.json from the shards (or re-download the checkpoint).")
    for file, infos in ckpt.shards.items():
        for name in sorted(set(infos) - set(weight_map)):
            out.add("DSP403", f"tensor {name!r} in {file} is missing from the index's weight_map.",
                    "Regenerate model.safetensors.index.json from the shards.")
    listed = set(weight_map.values())
    for name in ckpt.files:
        if name.endswith(".safetensors") and name not in listed:
            out.add("DSP404", f"{name} is not named by model.safetensors.index.json, so vLLM ignores it.",
                    "Remove the stray file, or add its tensors to the index if they belong to the draft.")
    return out
