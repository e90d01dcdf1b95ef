"""The demo-large pair: the demo target grown by inert decoder layers, a cost model of a real deployment whose
function is the demo target's (scripts/build_demo.py --pair demo-large; docs/demo-large.md).

The shipped demo target fits in a CPU's last-level cache, so a plain decode step is as cheap as a draft pass and
speculation cannot pay there. `grow_target` appends `extra_layers` Qwen3 decoder layers after the original ones.
Every weight of a new layer is a seeded random tensor (normal, std = the config's initializer_range; norms 1)
except `self_attn.o_proj.weight` and `mlp.down_proj.weight`, which are exactly zero: the attention and the MLP
of the layer each add exactly 0.0 to the residual stream. So the final hidden state, the logits and the greedy
tokens are bit-identical to the demo target's in any implementation, the hidden states the draft reads (layer ids
below the original depth) are unchanged, and yet every forward reads and multiplies all the new weights: the cost
is honest, the function is the demo target's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.io.outputs import atomic_output_dir, default_file_mode

# 128 inert layers after the 8 trained ones: 136 layers, 206 MB of bf16 weights (a 206 MB GGUF), a plain llama.cpp
# step at one thread of about 40 ms, 15x the demo target's (docs/demo-large.md has the measurements it was chosen by).
DEFAULT_EXTRA_LAYERS = 128
DEFAULT_SEED = 0
ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # the layer's two writes into the residual stream
WEIGHTS = "model.safetensors"
LAYER_PREFIX = "model.layers."


def grow_target(source_folder: str | Path, out_folder: str | Path, extra_layers: int = DEFAULT_EXTRA_LAYERS,
                seed: int = DEFAULT_SEED, force: bool = False) -> Path:
    """Write `source_folder` (a single-file Qwen3ForCausalLM) with `extra_layers` inert layers appended to
    `out_folder`, created atomically (exclusive unless `force`); the folder written."""
    with atomic_output_dir(Path(out_folder), force) as tmp:
        write_grown_target(Path(source_folder), tmp, extra_layers, seed)
    return Path(out_folder)


def build_large_pair(out: str | Path, extra_layers: int = DEFAULT_EXTRA_LAYERS, seed: int = DEFAULT_SEED,
                     force: bool = False) -> Path:
    """OUT/target (the demo target grown by `extra_layers` inert layers), OUT/draft (the demo draft, its weights
    byte-identical, num_target_layers set to the grown depth) and OUT/MODEL_CARD.md, written atomically."""
    with atomic_output_dir(Path(out), force) as tmp:
        depth = write_grown_target(DEMO_DIR / "target", tmp / "target", extra_layers, seed)
        write_draft_for(DEMO_DIR / "draft", tmp / "draft", depth)
        weight_bytes = (tmp / "target" / WEIGHTS).stat().st_size
        (tmp / "MODEL_CARD.md").write_text(model_card(extra_layers, seed, depth, weight_bytes))
    return Path(out)


def write_grown_target(source: Path, folder: Path, extra_layers: int, seed: int) -> int:
    """The grown target into `folder` (created if absent): config.json, model.safetensors (the source's dtype) and
    every other file of the source copied; the grown depth."""
    from safetensors.torch import load_file, save_file

    if extra_layers < 0:
        raise ValueError(f"the number of extra layers must be 0 or more, got {extra_layers}.")
    config = json.loads((source / "config.json").read_text())
    if config.get("architectures") != ["Qwen3ForCausalLM"]:
        raise ValueError(f"{source} is a {config.get('architectures')} model; only a Qwen3ForCausalLM target grows.")
    depth = config["num_hidden_layers"]
    tensors = load_file(str(source / WEIGHTS))  # name -> tensor in the source's dtype
    template = {name.removeprefix(f"{LAYER_PREFIX}0."): tensor for name, tensor in tensors.items()
                if name.startswith(f"{LAYER_PREFIX}0.")}
    generator = torch.Generator().manual_seed(seed)
    for layer in range(depth, depth + extra_layers):
        for name, like in sorted(template.items()):
            tensors[f"{LAYER_PREFIX}{layer}.{name}"] = inert_tensor(name, like, config["initializer_range"],
                                                                    generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    os.chmod(folder / WEIGHTS, default_file_mode())  # save_file's temporary file is 0600
    grown = {**config, "num_hidden_layers": depth + extra_layers}
    if "layer_types" in config:
        grown["layer_types"] = config["layer_types"] + ["full_attention"] * extra_layers
    (folder / "config.json").write_text(json.dumps(grown, indent=2) + "\n")
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in ("config.json", WEIGHTS):
            shutil.copy2(path, folder / path.name)  # tokenizer files, generation_config.json
    return depth + extra_layers


def inert_tensor(name: str, like: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """One weight of an inert layer, shaped and typed like `like`: zero for the residual writes (ZEROED), one
    for a norm's scale, else normal(0, std) drawn in float32 from `generator` and cast."""
    if name in ZEROED:
        return torch.zeros_like(like)  # [hidden, in]: the write into the residual adds exactly 0.0
    if name.endswith("norm.weight"):
        return torch.ones_like(like)  # [width]
    if like.dim() != 2:
        raise ValueError(f"the layer tensor {name} is neither a matrix nor a norm; the target cannot grow.")
    values = torch.empty(like.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)  # [out, in]
    return values.to(like.dtype)


def write_draft_for(source: Path, folder: Path, depth: int) -> None:
    """The draft in `source` copied to `folder` with num_target_layers = `depth`: its weights and every other file
    unchanged (its target_layer_ids read layers the grown target shares with the original)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name != "config.json":
            shutil.copy2(path, folder / path.name)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_target_layers": depth}, indent=2) + "\n")


def model_card(extra_layers: int, seed: int, depth: int, weight_bytes: int) -> str:
    """OUT/MODEL_CARD.md: what the pair is and why its extra layers are inert."""
    return f"""# demo-large: the demo pair with a target that costs like a real one

Built by `build_large_pair` (dspark_cli.runtime.train.demo_large, which scripts/build_demo.py runs) with
{extra_layers} extra layers and seed {seed}, from the shipped demo pair (src/dspark_cli/runtime/assets/demo/);
docs/demo-large.md has the commands and the measured costs.

- `target/`: the demo target (Qwen3, hidden 256) with {extra_layers} inert decoder layers appended after its
  {depth - extra_layers} trained ones: {depth} layers, {weight_bytes / 1e6:.0f} MB of weights.
- `draft/`: the demo draft, its weights byte-identical; its config's num_target_layers is {depth}.

**The extra layers are inert.** Every weight of a new layer is a seeded random tensor (normal, std = the
initializer_range; norms 1) except `self_attn.o_proj.weight` and `mlp.down_proj.weight`, which are exactly zero,
so each layer adds exactly 0.0 to the residual stream. The final hidden state, the logits and the greedy tokens
are bit-identical to the demo target's, and the hidden states the draft reads (target layers 1, 3, 6) are the
same, so the draft accepts exactly as on the demo target.

**Why.** The demo target fits in a CPU's last-level cache, so a plain decode step costs about as much as a draft
pass. Here every forward still reads and multiplies every weight of every layer (a zero matrix is multiplied like
any other): weights far beyond the cache, as in a real deployment, an honest cost, and the demo target's function.
"""
