"""The feature contract on disk (`dspark features`, read back by `dspark train --features`).

A cache folder holds:

    spec.json                  the FeatureSpec (train/features.py), written first: a rerun continues only a folder
                               of the same spec
    shard-00000.safetensors    records 0..R-1: tensors "<record>.tokens" [T] int64, "<record>.loss_mask" [T] bool,
    shard-00001.safetensors    "<record>.layers" [T, n*Ht] and "<record>.last_hidden" [T, Ht] in the spec's dtype
    ...                        (record = its 8-digit index); metadata "records" = the record count
    manifest.json              written last, once every shard is whole: the spec, the shards with their record,
                               token and byte counts, the totals

Shard i belongs to rank i mod N under torchrun (each rank runs the target on its own records). Every shard is written
to a temporary file beside it and renamed, so a shard under its final name is whole; a rerun skips the whole shards
and removes temporary ones left by an interrupted run, so Ctrl-C keeps every finished shard.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.distributed import SINGLE, DistContext
from dspark_cli.runtime.io.outputs import (atomic_write_text, check_writable_parent, default_file_mode,
                                           refuse_input_overlap)
from dspark_cli.runtime.train.features import RECORD_KEYS, FeatureRecord, FeatureSpec, TargetFeatures, stack_records

FORMAT = "dspark-features"
MANIFEST = "manifest.json"
SPEC_FILE = "spec.json"
ID_BYTES = 8 + 1  # per token: its id (int64) and its loss-mask flag (bool)
SHARD_TARGET_BYTES = 1 << 30  # records per shard by default: about 1 GiB of features per shard
REBUILD = "rebuild it with `dspark features`"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def record_key(record: int, name: str) -> str:
    return f"{record:08d}.{name}"


def disk_bytes_per_token(spec: FeatureSpec) -> int:
    """Bytes one token takes in a shard: its hidden states (layers + last_hidden) plus its id and mask flag (the
    safetensors header, a few hundred bytes per record, aside)."""
    return spec.bytes_per_token + ID_BYTES


# --- writing ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FeaturePlan:
    """What `dspark features` will write: the spec, the records' token windows and how they are sharded."""

    spec: FeatureSpec
    windows: torch.Tensor  # [N, T] token ids: one record per row
    records_per_shard: int

    @property
    def records(self) -> int:
        return self.windows.shape[0]

    @property
    def tokens(self) -> int:
        return self.windows.numel()

    @property
    def shard_ranges(self) -> list[range]:
        return shard_ranges(self.records, self.records_per_shard)


def default_records_per_shard(spec: FeatureSpec) -> int:
    return max(1, SHARD_TARGET_BYTES // (spec.max_length * disk_bytes_per_token(spec)))


def plan_features(spec: FeatureSpec, stream_tokens: torch.Tensor, records_per_shard: int | None = None) -> FeaturePlan:
    """Cut the packed token stream [L] into records of spec.max_length tokens (a shorter tail is dropped, as training
    windows never hold fewer tokens than their length either)."""
    count = stream_tokens.numel() // spec.max_length
    if count < 1:
        raise DsparkError(f"the data tokenizes to {stream_tokens.numel()} tokens, fewer than one record of the "
                          f"seq-len option {spec.max_length}; give more text or a smaller value of the seq-len option.")
    windows = stream_tokens[: count * spec.max_length].view(count, spec.max_length)
    per_shard = records_per_shard or default_records_per_shard(spec)
    if per_shard < 1:
        raise DsparkError(f"the records-per-shard option must be at least 1, got {per_shard}.")
    return FeaturePlan(spec, windows, per_shard)


@dataclass(frozen=True)
class CacheClaim:
    """What check_cache_folder found: whether the folder continues an earlier run of the same spec."""

    resume: bool  # spec.json of this spec is there: whole shards are kept
    replace: bool  # force: the folder is deleted and written again


def check_cache_folder(out: Path, spec: FeatureSpec, inputs: list, force: bool) -> CacheClaim:
    """Refuse, before anything loads, an output folder that overlaps an input, is a file, or holds something other
    than features of this spec (unless force, which replaces it)."""
    refuse_input_overlap(out, inputs, "output folder")
    if os.path.lexists(out) and not out.is_dir():
        raise DsparkError(f"{out} exists and is not a folder; choose another output folder.")
    if not out.is_dir() or not any(out.iterdir()):
        check_writable_parent(out, "output folder")
        return CacheClaim(resume=False, replace=False)
    if force:
        check_writable_parent(out, "output folder")
        return CacheClaim(resume=False, replace=True)
    spec_file = out / SPEC_FILE
    if not spec_file.is_file():
        raise DsparkError(f"{out} already exists, is not empty and holds no {SPEC_FILE}; choose another output "
                          "folder or pass the force option to replace it.")
    earlier = read_spec(spec_file)
    differs = next((key for key, value in spec.to_dict().items() if earlier.to_dict().get(key) != value), None)
    if differs is not None:
        raise DsparkError(f"{spec_file}: {differs} is {earlier.to_dict().get(differs)!r} but this run makes "
                          f"{spec.to_dict()[differs]!r}; continue with the options of the earlier run, choose another "
                          "output folder, or pass the force option to replace it.")
    return CacheClaim(resume=True, replace=False)


def read_spec(path: Path) -> FeatureSpec:
    from dspark_cli.runtime.train.checks import read_json_object

    return FeatureSpec.from_dict(read_json_object(path, f"{REBUILD}."), str(path))


def start_cache_folder(out: Path, spec: FeatureSpec, claim: CacheClaim) -> None:
    """Create the folder (rank 0 alone) and write spec.json first."""
    if claim.replace:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if not claim.resume:
        atomic_write_text(out / SPEC_FILE, json.dumps(spec.to_dict(), indent=2) + "\n")


def shard_is_whole(path: Path, records: range) -> bool:
    """A shard under its final name whose header declares exactly these records (an interrupted write never leaves
    one: shards are renamed into place whole)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            count = (handle.metadata() or {}).get("records")
    except (SafetensorError, OSError, ValueError):
        return False
    return count == str(len(records)) and keys == {record_key(r, n) for r in records for n in RECORD_KEYS}


def write_shard(path: Path, first: int, records: list[FeatureRecord]) -> None:
    """The records as one safetensors file, written beside `path` under a temporary name and renamed."""
    from safetensors.torch import save_file

    tensors = {record_key(first + i, name): value for i, record in enumerate(records)
               for name, value in record.to_tensors().items()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "records": str(len(records))})
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_temporaries(out: Path, mine: list[int]) -> None:
    """Temporary shard files an interrupted run left (this rank's shards only)."""
    for index in mine:
        for stale in out.glob(f".{shard_name(index)}.*.tmp"):
            stale.unlink(missing_ok=True)


@dataclass
class Progress:
    done: int = 0  # shards of this rank already whole or written by this run
    kept: int = 0  # of which: found whole from an earlier run
    mine: int = 0


def fill_shards(out: Path, shards: list[range], records: Callable[[range], list[FeatureRecord]],
                dist: DistContext = SINGLE, on_shard: Callable[[Progress], None] | None = None) -> Progress:
    """Write this rank's missing shards (shard i is rank i mod N's): records(rows) makes a shard's records; a shard
    already whole on disk is kept."""
    mine = [i for i in range(len(shards)) if i % dist.world_size == dist.rank]
    remove_stale_temporaries(out, mine)
    progress = Progress(mine=len(mine))
    for index in mine:
        path, rows = out / shard_name(index), shards[index]
        if shard_is_whole(path, rows):
            progress.kept += 1
        else:
            write_shard(path, rows.start, records(rows))
        progress.done += 1
        if on_shard is not None:
            on_shard(progress)
    return progress


def shard_records(windows: torch.Tensor, capture: Callable[[torch.Tensor], TargetFeatures], batch_size: int,
                  spec: FeatureSpec) -> list[FeatureRecord]:
    """windows [R, T] -> R records, the target run on batch_size windows at a time."""
    records = []
    for start in range(0, windows.shape[0], batch_size):
        tokens = windows[start:start + batch_size]  # [b, T]
        features = capture(tokens)
        for row in range(tokens.shape[0]):
            records.append(FeatureRecord(tokens[row].clone(), torch.ones(tokens.shape[1], dtype=torch.bool),
                                         features.layers[row].to(spec.torch_dtype).cpu(),
                                         features.last_hidden[row].to(spec.torch_dtype).cpu()))
    return records


def shard_ranges(records: int, per_shard: int) -> list[range]:
    """The records of each shard: consecutive runs of per_shard records."""
    return [range(start, min(records, start + per_shard)) for start in range(0, records, per_shard)]


def write_manifest(out: Path, spec: FeatureSpec, shards: list[range]) -> dict:
    """manifest.json from the shards on disk (rank 0, once every rank has written its shards)."""
    listed = []
    for index, rows in enumerate(shards):
        path = out / shard_name(index)
        if not shard_is_whole(path, rows):
            raise DsparkError(f"{path} is missing or not whole after every process finished; run the same command "
                              "again to write it.")
        entry = {"file": path.name, "first": rows.start, "records": len(rows), "bytes": path.stat().st_size}
        listed.append({**entry, "tokens": sum(_record_lengths(path, entry))})
    manifest = {"format": FORMAT, "spec": spec.to_dict(), "records": sum(s["records"] for s in listed),
                "tokens": sum(s["tokens"] for s in listed), "bytes": sum(s["bytes"] for s in listed),
                "bytes_per_token": disk_bytes_per_token(spec), "shards": listed}
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def finished_shards(out: Path) -> int:
    return len(list(Path(out).glob("shard-*.safetensors")))


# --- reading ---------------------------------------------------------------------------------------------------------

@dataclass
class FeatureCache:
    """A cache folder read back: its spec and where each record lives (tensors are read on demand)."""

    folder: Path
    spec: FeatureSpec
    files: list[Path]  # per record: its shard
    lengths: list[int]  # per record: tokens
    _handles: dict = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, folder: Path) -> "FeatureCache":
        from dspark_cli.runtime.train.checks import read_json_object

        folder = Path(folder)
        if not folder.is_dir():
            raise DsparkError(f"the features option {folder}: no such folder; give a folder written by "
                              "`dspark features`.")
        where = folder / MANIFEST
        if not where.is_file():
            raise DsparkError(f"{where} is missing: the features in {folder} are not finished; run the same "
                              "`dspark features` command again to finish them.")
        manifest = read_json_object(where, f"{REBUILD}.")
        if manifest.get("format") != FORMAT:
            raise DsparkError(f"{where}: key 'format' is {manifest.get('format')!r}, not {FORMAT!r}; {REBUILD}.")
        spec = FeatureSpec.from_dict(manifest.get("spec"), f"{where} key 'spec'")
        shards = manifest.get("shards")
        if not (isinstance(shards, list) and shards and all(isinstance(s, dict) for s in shards)):
            raise DsparkError(f"{where}: key 'shards' is missing or not a list of shards; {REBUILD}.")
        files, lengths = [], []
        for shard in shards:
            path = folder / str(shard.get("file"))
            size = path.stat().st_size if path.is_file() else None
            if size != shard.get("bytes"):
                found = "missing" if size is None else f"{size:,} bytes"
                raise DsparkError(f"{path} is {found} but {where} lists {shard.get('bytes')!r} bytes; the cache "
                                  f"was changed after it was written: {REBUILD}.")
            shard_lengths = _record_lengths(path, shard)
            files += [path] * len(shard_lengths)
            lengths += shard_lengths
        return cls(folder, spec, files, lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def record(self, index: int) -> FeatureRecord:
        handle = self._handle(self.files[index])
        tensors = {name: handle.get_tensor(record_key(index, name)) for name in RECORD_KEYS}
        return FeatureRecord.from_tensors(tensors, self.spec, f"{self.files[index]} record {index}")

    def tokens(self, index: int) -> torch.Tensor:
        return self._handle(self.files[index]).get_tensor(record_key(index, "tokens"))

    def _handle(self, path: Path):
        from safetensors import safe_open

        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]


def _record_lengths(path: Path, shard: dict) -> list[int]:
    """Tokens per record of one shard, from its header; the records must be the ones the manifest lists."""
    from safetensors import SafetensorError, safe_open

    first, count = shard.get("first"), shard.get("records")
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            expected = {record_key(r, n) for r in range(first, first + count) for n in RECORD_KEYS}
            if keys != expected:
                raise DsparkError(f"{path} does not hold records {first}..{first + count - 1} as the manifest says; "
                                  f"{REBUILD}.")
            return [handle.get_slice(record_key(r, "tokens")).get_shape()[0] for r in range(first, first + count)]
    except (SafetensorError, OSError, TypeError) as error:
        raise DsparkError(f"{path} cannot be read ({error}); {REBUILD}.") from None


@dataclass
class FeatureBank:
    """Training rows drawn from a cache: whole records of at least `seq_len` tokens, cut to it (as SequenceBank draws
    rows of a token matrix: the same draws from the same generator). `features` gives the drawn rows' target
    features, so the target itself never runs."""

    cache: FeatureCache
    eligible: torch.Tensor = field(init=False)  # [M] records long enough for a window
    picked: torch.Tensor | None = field(init=False, default=None)  # [B] the records of the last sample
    window: int = field(init=False, default=0)
    tokens: torch.Tensor = field(init=False)  # every record's ids, concatenated (the runs' fingerprint reads them)

    def __post_init__(self) -> None:
        self.eligible = torch.arange(len(self.cache))
        self.tokens = torch.cat([self.cache.tokens(i) for i in range(len(self.cache))])

    @property
    def max_window(self) -> int:
        return max(self.cache.lengths)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def sample(self, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """Random records, cut to seq_len. -> [batch_size, seq_len]"""
        if seq_len != self.window:
            self.eligible = torch.tensor([i for i, n in enumerate(self.cache.lengths) if n >= seq_len])
            self.window = seq_len
        self.picked = self.eligible[torch.randint(0, self.eligible.numel(), (batch_size,), generator=generator)]
        return torch.stack([self.cache.tokens(int(i))[:seq_len] for i in self.picked])

    def batch(self, rows: slice, device: torch.device) -> tuple[TargetFeatures, torch.Tensor]:
        """The target features (float32, on `device`) and loss masks [b, T] of rows `rows` of the last sample."""
        records = [self.cache.record(int(i)) for i in self.picked[rows]]
        tokens, loss_mask, features = stack_records(records, self.window)
        return (TargetFeatures(features.layers.to(device).float(), features.last_hidden.to(device).float()),
                loss_mask.to(device))
