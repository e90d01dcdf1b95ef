"""Checkpoints on disk or on the Hugging Face Hub: config.json, safetensors headers, selected tensors.

Opening a checkpoint reads only config.json and the safetensors headers (the 8-byte length plus the JSON that
follows); tensor data is read only by `load_tensor`, one tensor at a time. Nothing here imports torch at module
level, so `dspark validate` stays fast.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import detect_format
from dspark_cli.runtime.checkpoint.formats import FORMAT_NAMES
from dspark_cli.runtime.io.reading import ReadError, open_regular, parse_json_text, read_bounded

CONFIG_FILE = "config.json"
QUANT_CONFIG_FILE = "hf_quant_config.json"  # ModelOpt's legacy quantization config
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# The safetensors library refuses a header longer than MAX_HEADER_SIZE = 100_000_000 bytes (safetensors/src/tensor.rs;
# decimal, not 100 MiB), so vLLM cannot load one either.
MAX_HEADER_BYTES = 100_000_000
# Tensors per draft checkpoint (all files together). A DSpark draft has 11 per layer plus about 10 (DeepSpec's 5-layer
# drafts: 65), so 10,000 leaves room for ~900 layers; a header of a million tiny entries would otherwise cost
# minutes and gigabytes (docs/validate.md, "Limits").
MAX_TENSORS = 10_000
MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json, the shard index, hf_quant_config.json: real ones are a few MB at most
SKIPPED_FOLDERS = (".cache", ".git")  # huggingface_hub local_dir metadata, a git clone's object store

# safetensors dtype string -> bytes per element
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class CheckpointError(DsparkError):
    """The checkpoint could not be read (exit code 2); `code` is the stable validate code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as declared by a safetensors header."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    file: str  # shard file name, relative to the checkpoint folder
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES


@dataclass
class Checkpoint:
    """A draft (or target) checkpoint: its config and the tensors its safetensors files declare."""

    source: str  # what the user passed
    local_dir: Path | None  # the folder on disk; None for a hub checkpoint read remotely
    repo_id: str | None = None
    revision: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # every file in the checkpoint, relative names
    skipped: list[str] = field(default_factory=list)  # entries that are not its files (links leading out, FIFOs)
    index: dict[str, Any] | None = None  # model.safetensors.index.json, when sharded
    shards: dict[str, dict[str, TensorInfo]] = field(default_factory=dict)  # file -> name -> info
    hf_quant_config: dict[str, Any] | None = None  # hf_quant_config.json, when present

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor by name; where a name is in two shards, the later shard wins (rules report it)."""
        merged: dict[str, TensorInfo] = {}
        for infos in self.shards.values():
            merged.update(infos)
        return merged

    @property
    def pickle_files(self) -> list[str]:
        return [name for name in self.files if name.endswith(PICKLE_SUFFIXES)]

    def file_path(self, name: str) -> Path:
        """Local path of a checkpoint file, downloading it first for a hub checkpoint."""
        if self.local_dir is not None:
            return self.local_dir / name
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(self.repo_id, name, revision=self.revision))

    def load_tensor(self, name: str, device: str = "cpu"):
        """Load one tensor (torch) by name, reading only its bytes."""
        from safetensors import safe_open

        info = self.tensors.get(name)
        if info is None:
            raise DsparkError(f"{self.source} has no tensor named {name!r}.")
        with safe_open(str(self.file_path(info.file)), framework="pt", device=device) as handle:
            return handle.get_tensor(name)


def read_target_config(source: str | os.PathLike) -> dict[str, Any]:
    """config.json of a target model (folder, the config file itself, or hub id); nothing else is read."""
    path = Path(source).expanduser()
    if path.is_dir():
        config_path = path / CONFIG_FILE
    elif path.is_file() and path.suffix == ".json":
        config_path = path
    elif HUB_ID.match(str(source)) and not path.exists():
        config_path = _hub_file(str(source), CONFIG_FILE)
    else:
        raise CheckpointError(
            "DSP500",
            f"target {source} is neither a model folder, a config.json nor a Hugging Face hub id; check the target "
            "path or id.",
        )
    config = _config_object(read_json(config_path, "target config.json"), config_path)
    layout = detect_format(config)
    if layout != "unknown":
        raise CheckpointError("DSP500", f"target {source} is a draft checkpoint ({FORMAT_NAMES[layout]}), not the "
                                        "model it drafts for; give the target model as the target.")
    return config



@contextlib.contextmanager
def _hub_errors(what: str) -> Iterator[None]:
    """Turn Hugging Face Hub failures while reading `what` into one DSP511 sentence."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        yield
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise CheckpointError(
            "DSP511", f"{what} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            "download it first or unset HF_HUB_OFFLINE."
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise CheckpointError(
            "DSP511", f"{what} could not be read from the Hugging Face Hub ({type(error).__name__}); "
            "check the id, the revision, your token and the network."
        ) from None


def _hub_file(repo_id: str, name: str, revision: str | None = None) -> Path:
    from huggingface_hub import hf_hub_download

    with _hub_errors(f"{repo_id}/{name}"):
        return Path(hf_hub_download(repo_id, name, revision=revision))


def open_checkpoint(source: str | os.PathLike, revision: str | None = None) -> Checkpoint:
    """Read config.json and every safetensors header of a local folder or hub id (no tensor data)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _open_local(str(source), path)
    if path.exists():
        raise CheckpointError("DSP500", f"{source} is a file; pass the checkpoint folder that holds config.json.")
    if HUB_ID.match(str(source)) and not str(source).startswith((".", "/", "~")):
        return _open_hub(str(source), revision)
    raise CheckpointError(
        "DSP500", f"{source} is neither a folder nor a Hugging Face hub id (owner/name); check the path."
    )


def read_json(path: Path, what: str) -> Any:
    """Parse a checkpoint's JSON file (`what` names it in messages): a regular file of at most MAX_JSON_BYTES."""
    with _as_checkpoint_error("DSP501"):
        data = read_bounded(path, what, MAX_JSON_BYTES)
    with _as_checkpoint_error("DSP502"):
        return parse_json_text(data, str(path))


@contextlib.contextmanager
def _as_checkpoint_error(code: str) -> Iterator[None]:
    """io.reading's ReadError, re-raised as a CheckpointError with validate's `code`."""
    try:
        yield
    except ReadError as error:
        raise CheckpointError(code, error.message) from None


def read_safetensors_header(
    path: Path, file_name: str | None = None
) -> tuple[dict[str, TensorInfo], dict[str, str] | None]:
    """Parse and check one safetensors header: JSON, known dtypes, sizes that match shapes, in-file, no overlap.

    Returns its tensors by name (in header order) and its `__metadata__` (None when it has none)."""
    file_name = file_name or path.name
    with _as_checkpoint_error("DSP501"), open_regular(path, "safetensors weights file") as handle:
        size = os.fstat(handle.fileno()).st_size
        try:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError("DSP503", f"{path} is too short to be a safetensors file; re-download it.")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    "DSP503", f"{path} declares a {header_len}-byte header, more than the {MAX_HEADER_BYTES} bytes "
                    "the safetensors library accepts; the file is corrupt or not safetensors, re-download it."
                )
            if 8 + header_len > size:
                raise CheckpointError(
                    "DSP503", f"{path} declares a {header_len}-byte header but the file has {size} bytes; "
                    "the file is truncated or not safetensors, re-download it.",
                )
            raw = _read_counting_tensors(handle, header_len, path)
        except OSError as error:
            raise CheckpointError("DSP501", f"cannot read the safetensors weights file {path}: "
                                  f"{error.strerror or error}.") from None
    with _as_checkpoint_error("DSP503"):
        header = parse_json_text(raw, f"{path}'s safetensors header", "re-download the file")
    if not isinstance(header, dict):
        raise CheckpointError("DSP503", f"{path} has a safetensors header that is not a JSON object; re-download it.")
    _check_tensor_count(len(header) - ("__metadata__" in header), path)
    return _tensor_infos(header, path, file_name, data_start=8 + header_len, size=size), header.get("__metadata__")


def _read_counting_tensors(handle: BinaryIO, length: int, path: Path) -> bytes:
    """Read a `length`-byte header in 1 MiB chunks, stopping once it has declared more than MAX_TENSORS tensors.

    Every tensor entry has a "data_offsets" key (inside a string its quotes would be escaped), so counting that
    key bounds the work before json.loads builds a dict per entry.
    """
    key = b'"data_offsets"'
    chunks, count, tail = [], 0, b""
    while length > 0:
        chunk = handle.read(min(length, 1 << 20))
        if not chunk:
            break
        count += (tail + chunk).count(key)  # `tail` is shorter than `key`: a match is counted in one window only
        _check_tensor_count(count, path)
        chunks.append(chunk)
        tail = chunk[-(len(key) - 1):]
        length -= len(chunk)
    return b"".join(chunks)


def _check_tensor_count(count: int, where: Path) -> None:
    if count > MAX_TENSORS:
        raise CheckpointError(
            "DSP503", f"{where} declares {count} or more tensors, more than the {MAX_TENSORS} dspark reads from a "
            "draft (which has a few dozen); the checkpoint is corrupt or not a draft."
        )


def _tensor_infos(header: dict, path: Path, file_name: str, data_start: int, size: int) -> dict[str, TensorInfo]:
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            _check_metadata(entry, path)
            continue
        infos[name] = _tensor_info(name, entry, path, file_name, data_start, size)
    spans = sorted((info.begin, info.end, name) for name, info in infos.items() if info.end > info.begin)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise CheckpointError(
                "DSP505", f"{path}: tensors {name_a!r} and {name_b!r} overlap in the data section; the file is corrupt."
            )
    _check_contiguous(infos, path, data_start, size)
    return infos


def _check_metadata(entry: Any, path: Path) -> None:
    if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
        raise CheckpointError(
            "DSP503", f"{path}: the header's __metadata__ must map names to strings; the file is corrupt."
        )


def _check_contiguous(infos: dict[str, TensorInfo], path: Path, data_start: int, size: int) -> None:
    """safetensors (and so vLLM) refuses a data section with gaps or bytes after the last tensor."""
    cursor = data_start
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        if info.begin != cursor:
            raise CheckpointError(
                "DSP513", f"{path}: tensor {info.name!r} starts at byte {info.begin} but the data before it ends at "
                f"byte {cursor}; safetensors refuses such a file, re-download or re-save it."
            )
        cursor = info.end
    if cursor != size:
        raise CheckpointError(
            "DSP513", f"{path} has {size - cursor} bytes after its last tensor that no header entry covers; "
            "safetensors refuses such a file, re-download or re-save it."
        )


def _tensor_info(name: str, entry: Any, path: Path, file_name: str, data_start: int, size: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError("DSP503", f"{path}: header entry {name!r} is not an object; the file is corrupt.")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(
            "DSP504", f"{path}: tensor {name!r} has unknown dtype {dtype!r}; dspark and vLLM cannot load it."
        )
    if not _is_int_list(shape) or any(dim < 0 for dim in shape):
        raise CheckpointError("DSP503", f"{path}: tensor {name!r} has an invalid shape {shape!r}; the file is corrupt.")
    if not _is_int_list(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise CheckpointError(
            "DSP503", f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}; the file is corrupt."
        )
    info = TensorInfo(name, dtype, tuple(shape), file_name, data_start + offsets[0], data_start + offsets[1])
    if info.nbytes != info.numel * DTYPE_BYTES[dtype]:
        raise CheckpointError(
            "DSP503",
            f"{path}: tensor {name!r} spans {info.nbytes} bytes but {dtype}{list(shape)} needs "
            f"{info.numel * DTYPE_BYTES[dtype]}; the file is corrupt.",
        )
    if info.end > size:
        raise CheckpointError(
            "DSP506",
            f"{path}: tensor {name!r} ends at byte {info.end} but the file has {size} bytes; "
            "the download is truncated, re-download it.",
        )
    return info


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _open_local(source: str, root: Path) -> Checkpoint:
    ckpt = Checkpoint(source=source, local_dir=root)
    ckpt.files, ckpt.skipped = list_checkpoint_files(root)
    ckpt.config = _config_object(read_json(_member(ckpt, CONFIG_FILE), CONFIG_FILE), root / CONFIG_FILE)
    if (root / QUANT_CONFIG_FILE).exists() or (root / QUANT_CONFIG_FILE).is_symlink():
        quant_path = _member(ckpt, QUANT_CONFIG_FILE)
        ckpt.hf_quant_config = _config_object(read_json(quant_path, QUANT_CONFIG_FILE), quant_path)
    total = 0
    for name in _weight_files(ckpt, root):
        ckpt.shards[name], _ = read_safetensors_header(_member(ckpt, name), name)
        total += len(ckpt.shards[name])
        _check_tensor_count(total, root)
    return ckpt


def list_checkpoint_files(root: Path) -> tuple[list[str], list[str]]:
    """(members, skipped): relative names of the checkpoint's regular files, judged by their path inside `root`
    only, and of the other entries found (skipped folders are not entered, so not listed).

    Skipped: folders named in SKIPPED_FOLDERS, anything that is not a regular file (folders, FIFOs, devices), and
    symlinks that resolve outside `root` -- except, in a Hugging Face cache snapshot
    (`models--org--name/snapshots/<commit>`), links into that same repo folder's `blobs/`, which is how the cache
    stores every file. Symlinked folders are not entered.
    """
    root_real = root.resolve()
    blobs = _hub_blobs_folder(root_real)
    names, skipped = [], []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS)
        for file in files:
            path = Path(folder, file)
            (names if _is_member(path, root_real, blobs) else skipped).append(path.relative_to(root).as_posix())
    return sorted(names), sorted(skipped)


def _hub_blobs_folder(root_real: Path) -> Path | None:
    """`<cache>/models--org--name/blobs` when `root_real` is a snapshot folder of a Hugging Face cache."""
    snapshots, repo = root_real.parent, root_real.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return (repo / "blobs").resolve()
    return None


def _is_member(path: Path, root_real: Path, blobs: Path | None) -> bool:
    """A regular file inside the checkpoint (after resolving symlinks), or a cache snapshot link into `blobs`."""
    try:
        real = path.resolve(strict=True)
        is_file = stat.S_ISREG(real.stat().st_mode)
    except (OSError, RuntimeError):  # dangling link, link loop
        return False
    inside = root_real in real.parents or (blobs is not None and real.parent == blobs)
    return is_file and inside


def _member(ckpt: Checkpoint, name: str) -> Path:
    """Path of a file the checkpoint must hold; a link leading outside it, or a non-file, is refused."""
    path = ckpt.local_dir / name
    if name in ckpt.files or not (path.exists() or path.is_symlink()):
        return path  # missing files are reported by the reader, which knows what the file is for
    if not path.is_symlink() and not path.is_file():
        raise CheckpointError("DSP501", f"{path} is not a regular file (a folder, FIFO or device); it must be a file.")
    raise CheckpointError(
        "DSP501", f"{path} is not one of the checkpoint's files (a link leading outside the folder or to something "
        "that is not a regular file); dspark reads only regular files inside the checkpoint, put the real file there."
    )


def _config_object(config: Any, path: Path | str) -> dict:
    if not isinstance(config, dict):
        raise CheckpointError("DSP502", f"{path} must hold a JSON object; re-download or fix the file.")
    return config


def _weight_files(ckpt: Checkpoint, root: Path) -> list[str]:
    """Shard names from the index (checked to stay inside the folder), else model.safetensors, else *.safetensors."""
    index_path = root / INDEX_FILE
    if index_path.exists() or index_path.is_symlink():
        ckpt.index = read_json(_member(ckpt, INDEX_FILE), INDEX_FILE)
        return _index_shards(ckpt, index_path)
    if (root / SINGLE_FILE).exists() or (root / SINGLE_FILE).is_symlink():
        return [SINGLE_FILE]
    found = sorted(name for name in ckpt.files if name.endswith(".safetensors"))
    if not found:
        hint = " (only pickle weights were found; dspark never loads them, convert them to safetensors)" if (
            ckpt.pickle_files
        ) else ""
        raise CheckpointError("DSP507", f"{root} has no .safetensors weights{hint}.")
    return found


def _index_shards(ckpt: Checkpoint, index_path: Path) -> list[str]:
    index = ckpt.index
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError("DSP508", f"{index_path} has no valid 'weight_map' object; re-download the index.")
    shards = sorted(set(weight_map.values()))
    for name in shards:
        # Judged by the name, not by where a symlink points: hub cache snapshots link shards into blobs/.
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(
                "DSP509", f"{index_path} names shard {name!r} outside the checkpoint folder; refusing to read it."
            )
        if name not in ckpt.files and not (ckpt.local_dir / name).exists():
            raise CheckpointError(
                "DSP510", f"{index_path} names shard {name!r}, which is missing; the download is incomplete."
            )
    return shards


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def _open_hub(repo_id: str, revision: str | None) -> Checkpoint:
    """Hub checkpoint: headers are read remotely (safetensors metadata API); offline, from the local cache."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    with _hub_errors(repo_id):
        if _hub_offline():
            folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
            ckpt = _open_local(repo_id, folder)
            ckpt.repo_id, ckpt.revision = repo_id, revision
            return ckpt
        ckpt = Checkpoint(source=repo_id, local_dir=None, repo_id=repo_id, revision=revision)
        config_path = Path(hf_hub_download(repo_id, CONFIG_FILE, revision=revision))
        ckpt.config = _config_object(read_json(config_path, "config.json"), f"{repo_id}/{CONFIG_FILE}")
        api = HfApi()
        ckpt.files = sorted(api.list_repo_files(repo_id, revision=revision))
        if QUANT_CONFIG_FILE in ckpt.files:
            quant_path = Path(hf_hub_download(repo_id, QUANT_CONFIG_FILE, revision=revision))
            ckpt.hf_quant_config = _config_object(read_json(quant_path, QUANT_CONFIG_FILE),
                                                  f"{repo_id}/{QUANT_CONFIG_FILE}")
        meta = api.get_safetensors_metadata(repo_id, revision=revision)
    for file_name, file_meta in meta.files_metadata.items():
        ckpt.shards[file_name] = {
            name: TensorInfo(name, t.dtype, tuple(t.shape), file_name, t.data_offsets[0], t.data_offsets[1])
            for name, t in file_meta.tensors.items()
        }
    if meta.sharded:
        ckpt.index = {"weight_map": dict(meta.weight_map)}
    return ckpt
