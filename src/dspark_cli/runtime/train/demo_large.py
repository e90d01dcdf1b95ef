"""The demo-large pair: the demo target grown by inert weights, a cost model of a real deployment whose function is
the demo target's (scripts/build_demo.py --pair demo-large; docs/demo-large.md).

The shipped demo target fits in a CPU's last-level cache, so a plain decode step is as cheap as a draft pass and
speculation cannot pay there. `grow_target` grows it two ways (LargeRecipe), neither of which changes what it
computes:

- wider MLPs: each MLP gains units whose gate_proj and up_proj rows are seeded random tensors and whose
  down_proj columns are exactly zero, so their activations are computed and multiplied and add exactly 0.0;
- deeper: decoder layers appended after the original ones, every weight seeded random (norms 1) except
  `self_attn.o_proj.weight` and `mlp.down_proj.weight`, exactly zero, so each layer adds exactly 0.0.

So the final hidden state, the logits and the greedy tokens are the demo target's (bit-identical wherever a sum
over the MLP's units adds the zero products after the original ones, as transformers' and llama.cpp's kernels do
here: tested), the hidden states the draft reads are unchanged, and every forward reads and multiplies all the
new weights: the cost is honest, the function is the demo target's.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.io.outputs import atomic_output_dir, default_file_mode

WEIGHTS = "model.safetensors"
LAYER_PREFIX = "model.layers."
ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # a layer's two writes into the residual stream


@dataclass(frozen=True)
class LargeRecipe:
    """How the demo target grows. The default: every MLP widened from 768 to 16384 units (the new ones inert) and
    the weights stored in float32, 409 MB: in llama.cpp at one thread a plain step reads them all (about 40 ms on
    the 2-core development machine) while a pass over a few tokens costs little more, the memory-bound regime of
    real deployments (docs/demo-large.md has the measurements). Inert layers appended are the other way to grow
    it; at width 256 their matrix products are compute-bound on such a CPU, so they raise a step's cost and a
    verify pass's alike."""

    extra_layers: int = 0
    mlp_width: int | None = 16384  # None: the source's intermediate size
    float32: bool = True
    seed: int = 0


DEFAULT_RECIPE = LargeRecipe()


def grow_target(source_folder: str | Path, out_folder: str | Path, recipe: LargeRecipe = DEFAULT_RECIPE,
                force: bool = False) -> Path:
    """Write `source_folder` (a single-file Qwen3ForCausalLM) grown by `recipe` to `out_folder`, created atomically
    (exclusive unless `force`); the folder written."""
    with atomic_output_dir(Path(out_folder), force) as tmp:
        write_grown_target(Path(source_folder), tmp, recipe)
    return Path(out_folder)


def build_large_pair(out: str | Path, recipe: LargeRecipe = DEFAULT_RECIPE, force: bool = False) -> Path:
    """OUT/target (the demo target grown by `recipe`), OUT/draft (the demo draft, its weights byte-identical,
    num_target_layers set to the grown depth) and OUT/MODEL_CARD.md, written atomically."""
    with atomic_output_dir(Path(out), force) as tmp:
        depth = write_grown_target(DEMO_DIR / "target", tmp / "target", recipe)
        write_draft_for(DEMO_DIR / "draft", tmp / "draft", depth)
        weight_bytes = (tmp / "target" / WEIGHTS).stat().st_size
        (tmp / "MODEL_CARD.md").write_text(model_card(recipe, depth, weight_bytes))
    return Path(out)


def write_grown_target(source: Path, folder: Path, recipe: LargeRecipe) -> int:
    """The grown target into `folder` (created if absent): config.json, model.safetensors (the source's dtype, or
    float32) and every other file of the source copied; the grown depth."""
    extra_layers, mlp_width, float32 = recipe.extra_layers, recipe.mlp_width, recipe.float32
    from safetensors.torch import load_file, save_file

    if extra_layers < 0:
        raise ValueError(f"the number of extra layers must be 0 or more, got {extra_layers}.")
    config = json.loads((source / "config.json").read_text())
    if config.get("architectures") != ["Qwen3ForCausalLM"]:
        raise ValueError(f"{source} is a {config.get('architectures')} model; only a Qwen3ForCausalLM target grows.")
    depth = config["num_hidden_layers"]
    tensors = load_file(str(source / WEIGHTS))  # name -> tensor in the source's dtype
    if float32:
        tensors = {name: tensor.float() for name, tensor in tensors.items()}
    generator = torch.Generator().manual_seed(recipe.seed)
    width = mlp_width or config["intermediate_size"]
    if width < config["intermediate_size"]:
        raise ValueError(f"the MLP width must be at least the target's {config['intermediate_size']}, got {width}.")
    if width > config["intermediate_size"]:
        tensors = widened_mlp(tensors, width - config["intermediate_size"], config["initializer_range"], generator)
    template = {name.removeprefix(f"{LAYER_PREFIX}0."): tensor for name, tensor in tensors.items()
                if name.startswith(f"{LAYER_PREFIX}0.")}
    for layer in range(depth, depth + extra_layers):
        for name, like in sorted(template.items()):
            tensors[f"{LAYER_PREFIX}{layer}.{name}"] = inert_tensor(name, like, config["initializer_range"],
                                                                    generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    os.chmod(folder / WEIGHTS, default_file_mode())  # save_file's temporary file is 0600
    grown = {**config, "num_hidden_layers": depth + extra_layers, "intermediate_size": width}
    if "layer_types" in config:
        grown["layer_types"] = config["layer_types"] + ["full_attention"] * extra_layers
    (folder / "config.json").write_text(json.dumps(grown, indent=2) + "\n")
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in ("config.json", WEIGHTS):
            shutil.copy2(path, folder / path.name)  # tokenizer files, generation_config.json
    return depth + extra_layers


def widened_mlp(tensors: dict[str, torch.Tensor], units: int, std: float,
                generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Every MLP with `units` inert units appended: gate_proj and up_proj gain rows drawn normal(0, std) (in the
    tensors' order), down_proj gains zero columns, so each new unit's activation is real and multiplied, and its
    write into the residual stream is exactly 0.0."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):  # [intermediate, hidden]
            extra = torch.randn(units, tensor.shape[1], generator=generator) * std
            tensor = torch.cat([tensor, extra.to(tensor.dtype)], 0)
        elif name.endswith("mlp.down_proj.weight"):  # [hidden, intermediate]
            tensor = torch.cat([tensor, torch.zeros(tensor.shape[0], units, dtype=tensor.dtype)], 1)
        out[name] = tensor.contiguous()
    return out


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


def model_card(recipe: LargeRecipe, depth: int, weight_bytes: int) -> str:
    """OUT/MODEL_CARD.md: what the pair is and why its extra weights are inert."""
    grown = []
    if recipe.mlp_width:
        grown.append(f"every MLP widened to {recipe.mlp_width} units")
    if recipe.extra_layers:
        grown.append(f"{recipe.extra_layers} decoder layers appended")
    dtype = "float32" if recipe.float32 else "the demo target's dtype"
    return f"""# demo-large: the demo pair with a target that costs like a real one

Built by `build_large_pair` (dspark_cli.runtime.train.demo_large, which scripts/build_demo.py runs) with
{recipe}, from the shipped demo pair (src/dspark_cli/runtime/assets/demo/); docs/demo-large.md has the commands
and the measured costs.

- `target/`: the demo target (Qwen3, hidden 256), {" and ".join(grown) or "unchanged"}, the new weights inert:
  {depth} layers, {weight_bytes / 1e6:.0f} MB of weights in {dtype}.
- `draft/`: the demo draft, its weights byte-identical; its config's num_target_layers is {depth}.

**The new weights are inert.** The new MLP units' gate and up rows and every matrix of a new layer are seeded
random (normal, std = the initializer_range; norms 1); the down_proj columns of the new units and a new layer's
`self_attn.o_proj.weight` and `mlp.down_proj.weight` are exactly zero, so nothing new writes to the residual
stream. The final hidden state, the logits and the greedy tokens are the demo target's, and the hidden states the
draft reads are the same, so the draft accepts exactly as on the demo target.

**Why.** The demo target fits in a CPU's last-level cache, so a plain decode step costs about as much as a draft
pass. Here every forward still reads and multiplies every weight (a zero is multiplied like any other number):
weights far beyond the cache, as in a real deployment, an honest cost, and the demo target's function.
"""
