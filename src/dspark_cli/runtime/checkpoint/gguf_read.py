"""A GGUF file's keys and tensor table read by dspark itself (stdlib; numpy only to load one tensor's values), so
that `dspark validate DRAFT.gguf` stays torch-free and reads no tensor data it does not check.

The layout is GGUF version 2 / 3 as ggml writes it (ggml/src/gguf.cpp in llama.cpp b11434): magic `GGUF`, version,
tensor count, key count, the keys (name, type, value; arrays as element type, count, elements), the tensor table
(name, dimensions in ggml order, ggml type, offset into the data section), then the data section, aligned to
`general.alignment` (32 by default). A malformed or truncated file is a CheckpointError (DSP801, exit 2).

Layer ids: llama.cpp's dflash GGUF stores `dflash.target_layers` as the target layers whose *input* the draft reads
(conversion/qwen.py writes DeepSpec's 0-based "output of layer k" id plus one); `deepspec_layer_ids` turns them back
into DeepSpec's ids, the convention of every folder dspark reads.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from dspark_cli.runtime.checkpoint.read import CheckpointError

LAYER_IDS_KEY = "dspark.target_layer_ids"  # DeepSpec's ids, recorded by dspark convert beside dflash.target_layers
MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# ggml types dspark names and sizes exactly (ggml.h enum ggml_type); others keep their number ("type 12").
GGML_TYPES = {0: ("F32", 4), 1: ("F16", 2), 24: ("I8", 1), 25: ("I16", 2), 26: ("I32", 4), 27: ("I64", 8),
              28: ("F64", 8), 30: ("BF16", 2)}
FLOAT_TYPES = ("F32", "F16", "BF16")
MAX_COUNT = 1 << 32  # a key or tensor count, array length or string length above this is a corrupt file


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] (the row length) first
    dtype: str  # "F32", "BF16", ... or "type N" for a block-quantized type
    begin: int  # absolute file offset of its data

    @property
    def numel(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count


@dataclass(frozen=True)
class GgufFile:
    path: Path
    version: int
    keys: dict[str, Any]
    tensors: dict[str, GgufTensor]

    @property
    def architecture(self) -> str | None:
        value = self.keys.get("general.architecture")
        return value if isinstance(value, str) else None

    def key(self, name: str) -> Any:
        """An architecture key ("block_size" -> "dflash.block_size"), None when absent."""
        return self.keys.get(f"{self.architecture}.{name}")

    def values(self, name: str):
        """One float or integer tensor's values as a flat numpy array (its file bytes, exactly; BF16 widened)."""
        import numpy as np

        info = self.tensors[name]
        kinds = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I32": np.int32, "I64": np.int64}
        if info.dtype not in kinds:
            raise ValueError(f"{name} is {info.dtype}, which dspark does not read")
        data = np.fromfile(self.path, dtype=kinds[info.dtype], count=info.numel, offset=info.begin)
        return (data.astype(np.uint32) << 16).view(np.float32) if info.dtype == "BF16" else data


def deepspec_layer_ids(llamacpp_ids: list[int]) -> list[int]:
    """llama.cpp's extract layers (the input of layer k) as DeepSpec's target_layer_ids (the output of layer k - 1)."""
    return [k - 1 for k in llamacpp_ids]


def is_gguf(path: str) -> bool:
    """A local file whose first four bytes are GGUF's magic."""
    candidate = Path(path).expanduser()
    if not candidate.is_file():
        return False
    with candidate.open("rb") as f:
        return f.read(4) == MAGIC


def read_gguf(path: str | Path) -> GgufFile:
    """The keys and the tensor table of a GGUF file; CheckpointError DSP801 when it is malformed or truncated."""
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            return _parse(f, path, size)
    except OSError as error:
        raise CheckpointError("DSP501", f"{path} could not be read ({error.strerror or error}).") from None
    except (struct.error, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError("DSP801", f"{path} is not a readable GGUF file ({error}); re-convert or re-download "
                              "it.") from None


def _parse(f: BinaryIO, path: Path, size: int) -> GgufFile:
    if f.read(4) != MAGIC:
        raise ValueError("no GGUF magic")
    version, n_tensors, n_keys = struct.unpack("<IQQ", _exact(f, 20))
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}, dspark reads versions 2 and 3")
    if n_tensors > MAX_COUNT or n_keys > MAX_COUNT:
        raise ValueError("implausible tensor or key count")
    keys = {}
    for _ in range(n_keys):
        name = _string(f)
        keys[name] = _value(f, struct.unpack("<I", _exact(f, 4))[0])
    table = [_tensor_entry(f) for _ in range(n_tensors)]
    alignment = keys.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment is {alignment!r}")
    data_start = -(-f.tell() // alignment) * alignment
    tensors = {name: GgufTensor(name, shape, dtype, data_start + offset) for name, shape, dtype, offset in table}
    _check_extents(tensors, size)
    return GgufFile(path, version, keys, tensors)


def _check_extents(tensors: dict[str, GgufTensor], size: int) -> None:
    """Each tensor's data ends before the next one begins and inside the file (sizes known for GGML_TYPES)."""
    ordered = sorted(tensors.values(), key=lambda t: t.begin)
    for index, tensor in enumerate(ordered):
        limit = ordered[index + 1].begin if index + 1 < len(ordered) else size
        width = next((w for n, w in GGML_TYPES.values() if n == tensor.dtype), None)
        end = tensor.begin + tensor.numel * width if width else tensor.begin + 1
        if end > limit:
            where = "the end of the file (truncated)" if index + 1 == len(ordered) else ordered[index + 1].name
            raise ValueError(f"tensor {tensor.name} runs past {where}")


def _tensor_entry(f: BinaryIO) -> tuple[str, tuple[int, ...], str, int]:
    name = _string(f)
    n_dims = struct.unpack("<I", _exact(f, 4))[0]
    if n_dims > 8:
        raise ValueError(f"tensor {name} has {n_dims} dimensions")
    shape = struct.unpack(f"<{n_dims}Q", _exact(f, 8 * n_dims))
    kind, offset = struct.unpack("<IQ", _exact(f, 12))
    return name, tuple(shape), GGML_TYPES.get(kind, (f"type {kind}", 0))[0], offset


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in SCALARS:
        fmt = SCALARS[kind]
        return struct.unpack(fmt, _exact(f, struct.calcsize(fmt)))[0]
    if kind == STRING:
        return _string(f)
    if kind == ARRAY:
        element, count = struct.unpack("<IQ", _exact(f, 12))
        if count > MAX_COUNT:
            raise ValueError("implausible array length")
        if element in SCALARS:
            fmt = SCALARS[element]
            return list(struct.unpack(f"<{count}{fmt[1]}", _exact(f, struct.calcsize(fmt) * count)))
        return [_value(f, element) for _ in range(count)]
    raise ValueError(f"unknown GGUF value type {kind}")


def _string(f: BinaryIO) -> str:
    length = struct.unpack("<Q", _exact(f, 8))[0]
    if length > MAX_COUNT:
        raise ValueError("implausible string length")
    return _exact(f, length).decode("utf-8")


def _exact(f: BinaryIO, n: int) -> bytes:
    """n bytes, refused before reading when the file has fewer left (a corrupt length never allocates)."""
    here = f.tell()
    if n > f.seek(0, 2) - here:
        raise ValueError("the file ends inside its header (truncated)")
    f.seek(here)
    return f.read(n)
