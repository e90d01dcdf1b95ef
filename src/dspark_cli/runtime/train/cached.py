"""`dspark train --features DIR`: training from a feature cache instead of running the target.

The cache's manifest is checked against the run before anything is allocated (each mismatch one sentence naming the
key and what to do); the target is then loaded without its decoder layers (train/head_weights.py): the draft shares
its embedding and lm_head, and the loss recomputes its distribution from the cached post-norm state.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.devices import resolve_dtype
from dspark_cli.runtime.train.feature_cache import MANIFEST, FeatureBank, FeatureCache
from dspark_cli.runtime.train.features import template_hash, tokenizer_hash


def open_features(folder: Path, shape):
    """The cache's training rows, and the draft shape with the cache's layer ids when the run names none."""
    cache = FeatureCache.open(folder)
    if shape.target_layers is None:
        shape = replace(shape, target_layers=tuple(cache.spec.layer_ids))
    return FeatureBank(cache), shape


def check_features(cache: FeatureCache, draft_config: dict, target, tokenizer, chat_template: Path | None,
                   device: torch.device) -> None:
    """The cache must hold what this draft reads, from this target, tokenizer and chat template, in the dtype the
    target runs in here (so cached training computes what online training would)."""
    from dspark_cli.runtime.train.data import read_chat_template

    spec, where = cache.spec, cache.folder / MANIFEST
    ids = list(draft_config["target_layer_ids"])
    if list(spec.layer_ids) != ids:
        raise DsparkError(f"{where}: spec key 'layer_ids' is {list(spec.layer_ids)} but the draft reads target layers "
                          f"{ids}; train with the target-layers option {','.join(map(str, spec.layer_ids))} (the "
                          "cache's) or write features of those layers with `dspark features`.")
    for key, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if getattr(spec, key) != have:
            raise DsparkError(f"{where}: spec key {key!r} is {getattr(spec, key)} but the target's is {have}: the "
                              f"features were written for another target ({spec.target}); give that target, or "
                              "write features of this one with `dspark features`.")
    if spec.tokenizer_hash != tokenizer_hash(tokenizer):
        raise DsparkError(f"{where}: spec key 'tokenizer_hash' differs from this target's tokenizer (its vocabulary, "
                          "merges, normalizer, pre-tokenizer, post-processor, added tokens or special ids): the "
                          f"features were tokenized for another target ({spec.target}); give that target, or write "
                          "features with this one.")
    template = read_chat_template(chat_template) if chat_template is not None else getattr(tokenizer, "chat_template",
                                                                                            None)
    if spec.template_hash is not None and spec.template_hash != template_hash(template):
        raise DsparkError(f"{where}: spec key 'template_hash' differs from this run's chat template: the features "
                          "were rendered with another one; pass the chat-template option the features were written "
                          "with, or write them again with this template.")
    runs_in = str(resolve_dtype("auto", device)).removeprefix("torch.")
    if spec.dtype != runs_in:
        raise DsparkError(f"{where}: spec key 'dtype' is {spec.dtype} but training on {device.type} runs the target in "
                          f"{runs_in}; write the features with the dtype option {runs_in}, or train on the device "
                          "type they were written for.")


def load_head_target(target: str | Path, device: torch.device) -> torch.nn.Module:
    """The target's embedding, final norm and lm_head, read by name (no decoder layer is allocated)."""
    from dspark_cli.runtime.train.head_weights import load_head_model

    return load_head_model(target, device, resolve_dtype("auto", device))
