"""Content fingerprints of model files: which target and draft a measurement was made with, in milliseconds.

    folder_fingerprint("./my-draft")          # config.json and the safetensors files of a checkpoint folder
    file_fingerprint("my-draft.gguf")         # one file (a GGUF)

A fingerprint is a SHA-256 over the file's size and SAMPLES chunks of SAMPLE_BYTES spread evenly over it (the whole
file when it is smaller than that): two trainings or conversions of the same architecture differ in every weight, so
sampled bytes tell them apart without reading many gigabytes. It identifies files, it does not authenticate them.
`dspark convert --to gguf` writes its source folder's fingerprint into the GGUF (SOURCE_KEY), so a cost profile
measured on GGUF files (`dspark bench engine`) can be matched to the eval runs of the folders they came from.
Torch-free.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SAMPLES = 16
SAMPLE_BYTES = 64 * 1024
SOURCE_KEY = "dspark.source.fingerprint"  # GGUF metadata: the fingerprint of the folder converted
PREFIX = "s256:"


def file_fingerprint(path: str | os.PathLike) -> str:
    """The sampled SHA-256 of one regular file (OSError when it cannot be read)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        digest.update(size.to_bytes(8, "little"))
        if size <= SAMPLES * SAMPLE_BYTES:
            digest.update(handle.read())
        else:
            step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
            for index in range(SAMPLES):
                handle.seek(index * step)
                digest.update(handle.read(SAMPLE_BYTES))
    return PREFIX + digest.hexdigest()[:32]


def folder_fingerprint(folder: str | os.PathLike) -> str | None:
    """The fingerprint of a checkpoint folder's config.json and safetensors files (names and contents); None when
    `folder` is not a local folder holding a config.json."""
    root = Path(folder).expanduser()
    if not (root / "config.json").is_file():
        return None
    names = sorted(p.name for p in root.iterdir() if p.is_file() and (p.name == "config.json"
                                                                       or p.suffix == ".safetensors"))
    digest = hashlib.sha256()
    for name in names:
        digest.update(f"{name}\0{file_fingerprint(root / name)}\0".encode())
    return PREFIX + digest.hexdigest()[:32]
