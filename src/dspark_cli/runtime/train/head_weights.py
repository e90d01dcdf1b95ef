"""The frozen target without its decoder layers: what training from cached features needs of it.

A draft trained from a feature cache (`dspark train --features`) never runs the target: it needs the target's
embedding and lm_head (the draft shares frozen copies of both; the loss recomputes the target's distribution from the
cached post-norm state with the lm_head) and, for records whose last state was stored before the final norm
(speculators' files), that norm. `load_head_model` builds the target's module tree on PyTorch's meta device (no
memory) and reads only those tensors, by name, from the checkpoint's safetensors files: a 70B target costs its
embedding and lm_head (about 2 GB in bf16), not its 140 GB.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dspark_cli.errors import DsparkError


def head_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The embedding, the decoder's final norm and the lm_head of a Hugging Face causal LM."""
    norm = getattr(model.get_decoder(), "norm", None)
    if not isinstance(norm, nn.Module):
        raise DsparkError(f"the target {type(model).__name__} has no final `norm` in its decoder; dspark cannot read "
                          "its output head alone, so train it online (without the features option).")
    return {"embedding": model.get_input_embeddings(), "norm": norm, "lm_head": model.get_output_embeddings()}


def load_head_model(target: str | Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The target's module tree with only its embedding, final norm and lm_head in memory (on `device`, in `dtype`),
    read by tensor name from its safetensors; every decoder layer stays on the meta device and must not run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dspark_cli.runtime.checkpoint.read import open_checkpoint

    config = AutoConfig.from_pretrained(str(target), trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    checkpoint = open_checkpoint(target)
    names = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), name)  # a tied lm_head is the embedding's parameter: its first name
    loaded: dict[int, nn.Parameter] = {}
    for module in head_modules(model).values():
        for attribute, parameter in list(module.named_parameters(recurse=False)):
            if id(parameter) not in loaded:
                loaded[id(parameter)] = nn.Parameter(_read(checkpoint, names[id(parameter)], parameter, target)
                                                     .to(device=device, dtype=dtype), requires_grad=False)
            setattr(module, attribute, loaded[id(parameter)])
    return model.eval().requires_grad_(False)


def _read(checkpoint, name: str, like: torch.Tensor, target) -> torch.Tensor:
    info = checkpoint.tensors.get(name)
    if info is None:
        raise DsparkError(f"the target {target} has no tensor named {name!r} in its safetensors files; dspark reads "
                          "the embedding, final norm and lm_head by these names, so train this target online "
                          "(without the features option).")
    if tuple(info.shape) != tuple(like.shape):
        raise DsparkError(f"the target {target} stores {name} as {list(info.shape)} but its config.json implies "
                          f"{list(like.shape)}; the weights and the config do not belong together, re-download the "
                          "model.")
    return checkpoint.load_tensor(name)
