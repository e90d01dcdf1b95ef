"""One `dspark features` run: a corpus (or speculators' hidden-state files) turned into a feature cache.

The steps, each a call the CLI makes on every rank: `plan_corpus` / `plan_speculators` (what will be written, its
spec and its size on disk, printed before anything is written; nothing heavy loaded yet), `claim` (the output
folder, rank 0), `write` (this rank's shards) and `finish` (the manifest, rank 0, after every rank is done).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.distributed import SINGLE, DistContext
from dspark_cli.runtime.io.outputs import local_inputs
from dspark_cli.runtime.train import feature_cache as cache
from dspark_cli.runtime.train.features import FeatureSpec, capture_target_features, template_hash, tokenizer_hash


@dataclass
class FeatureJob:
    """A planned run: the spec, the records' shards and how to make a shard's records."""

    spec: FeatureSpec
    shards: list[range]
    records: int
    tokens: int
    inputs: list  # NamedInput: what the output folder must not overlap
    make: Callable[[range], list] | None = None  # rows -> FeatureRecords; set by `load`
    load: Callable[[], None] | None = None  # loads the target (or its head) and sets `make`

    @property
    def bytes_per_token(self) -> int:
        return cache.disk_bytes_per_token(self.spec)

    @property
    def total_bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def _target_config(target: str | Path):
    from dspark_cli.runtime.train.run import load_tokenizer_and_config

    return load_tokenizer_and_config(target)


def plan_corpus(target: str | Path, data: list[Path], layer_ids: Sequence[int], seq_len: int, dtype: torch.dtype,
                device: torch.device, *, chat_template: Path | None = None, batch_size: int = 8,
                records_per_shard: int | None = None, revision: str | None = None) -> FeatureJob:
    """Records of seq_len tokens cut from the packed corpus (the same packing as `dspark train`'s data)."""
    from dspark_cli.runtime.train.data import load_token_stream, read_chat_template
    from dspark_cli.runtime.train.run import load_target_model

    tokenizer, config = _target_config(target)
    _check_layers(layer_ids, config.num_hidden_layers)
    if config.max_position_embeddings and seq_len > config.max_position_embeddings:
        raise DsparkError(f"the seq-len option {seq_len} is longer than the target's context (max_position_embeddings "
                          f"{config.max_position_embeddings}); use the seq-len option "
                          f"{config.max_position_embeddings} or less.")
    template = read_chat_template(chat_template) if chat_template is not None else getattr(tokenizer, "chat_template",
                                                                                            None)
    stream = load_token_stream(data, tokenizer, chat_template)
    spec = FeatureSpec(target=str(target), revision=revision, layer_ids=tuple(layer_ids),
                       hidden_size=config.hidden_size, vocab_size=config.vocab_size, dtype=_dtype_name(dtype),
                       tokenizer_hash=tokenizer_hash(tokenizer), template_hash=template_hash(template),
                       max_length=seq_len)
    plan = cache.plan_features(spec, stream.tokens, records_per_shard)
    job = FeatureJob(spec, plan.shard_ranges, plan.records, plan.tokens,
                     local_inputs("target", [target]) + local_inputs("training data", data)
                     + local_inputs("chat template", [chat_template]))

    def load() -> None:
        model = load_target_model(target, device)
        if model.dtype != dtype:
            model = model.to(dtype)

        def capture(tokens: torch.Tensor):
            return capture_target_features(model, tokens.to(device), layer_ids)

        job.make = lambda rows: cache.shard_records(plan.windows[rows.start:rows.stop], capture, batch_size, spec)

    job.load = load
    return job


def plan_speculators(target: str | Path, folder: Path, aux_ids: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device, *, records_per_shard: int | None = None,
                     revision: str | None = None) -> FeatureJob:
    """One record per hs_<i>.safetensors file of `folder`, its last state put through the target's final norm."""
    from dspark_cli.runtime.train.head_weights import head_modules, load_head_model
    from dspark_cli.runtime.train.speculators import AuxLayers, hs_files, hs_length, read_hs_file

    tokenizer, config = _target_config(target)
    layers = AuxLayers(tuple(aux_ids), config.num_hidden_layers)
    layers.check()
    files = hs_files(folder)
    lengths = [hs_length(path) for path in files]
    spec = FeatureSpec(target=str(target), revision=revision, layer_ids=tuple(layers.layer_ids),
                       hidden_size=config.hidden_size, vocab_size=config.vocab_size, dtype=_dtype_name(dtype),
                       tokenizer_hash=tokenizer_hash(tokenizer), template_hash=None, max_length=max(lengths))
    per_shard = records_per_shard or cache.default_records_per_shard(spec)
    job = FeatureJob(spec, cache.shard_ranges(len(files), per_shard), len(files), sum(lengths),
                     local_inputs("target", [target]) + local_inputs("speculators folder", [folder]))

    def load() -> None:
        norm = head_modules(load_head_model(target, device, torch.float32))["norm"]
        job.make = lambda rows: [read_hs_file(files[i], layers, norm, dtype) for i in rows]

    job.load = load
    return job


def claim(job: FeatureJob, out: Path, force: bool) -> cache.CacheClaim:
    """Rank 0: refuse an output folder that overlaps an input or holds other features (before anything loads)."""
    return cache.check_cache_folder(out, job.spec, job.inputs, force)


def write(job: FeatureJob, out: Path, dist: DistContext = SINGLE,
          on_shard: Callable[[cache.Progress], None] | None = None) -> cache.Progress:
    """This rank's shards (the target, or its final norm, loaded first)."""
    job.load()
    return cache.fill_shards(out, job.shards, job.make, dist, on_shard)


def finish(job: FeatureJob, out: Path) -> dict:
    """Rank 0, once every rank has written its shards: manifest.json."""
    return cache.write_manifest(out, job.spec, job.shards)


def _check_layers(layer_ids: list[int], num_layers: int) -> None:
    bad = [k for k in layer_ids if not -1 <= k < num_layers - 1]
    if bad or not layer_ids:
        raise DsparkError(f"the target-layers option holds {bad[0] if bad else 'no id'}, but the target has "
                          f"{num_layers} layers: give ids in -1..{num_layers - 2} (-1 the embedding output; not its "
                          "last layer).")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
