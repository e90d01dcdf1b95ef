"""Property test: corrupted fixture bytes never crash `dspark validate`.

Oracle: the safetensors library (what vLLM reads with). If it refuses a corrupted shard, validate must exit 2 with
one `error: DSP5xx …` sentence on stderr; if it accepts it, validate must report findings (exit 0 or 1), never 2.
Flips inside the tensor-data region leave every header valid, so they must exit exactly 0. A corrupted index or
config.json must exit 2 exactly when it is no longer a readable JSON object naming existing shards.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from ckpt_factory import DraftSpec, write_draft
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from typer.testing import CliRunner

from dspark_cli.cli import app

runner = CliRunner()
INDEX = "model.safetensors.index.json"
# Any byte, or a character that keeps JSON well-formed more often (so the rules, not only the parser, get fuzzed).
BYTES = st.one_of(st.integers(0, 255), st.sampled_from(list(b"0123456789-abcdefxyz_.")))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fuzz")
    spec = DraftSpec(hidden_size=32, intermediate_size=64, vocab_size=64, mask_token_id=60, markov_rank=16,
                     num_attention_heads=2, num_key_value_heads=1)
    return {"single": write_draft(base / "single", spec), "sharded": write_draft(base / "sharded", spec, shards=2)}


def header_length(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def library_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
        return True
    except Exception:  # noqa: BLE001 - any refusal by the reference reader
        return False


def index_is_usable(folder: Path) -> bool:
    try:
        index = json.loads((folder / INDEX).read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return False
    return all(not Path(v).is_absolute() and ".." not in Path(v).parts and (folder / v).is_file()
               for v in weight_map.values())


def config_is_usable(folder: Path) -> bool:
    try:
        return isinstance(json.loads((folder / "config.json").read_bytes().decode("utf-8")), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def validate(folder: Path):
    result = runner.invoke(app, ["validate", str(folder)])
    event(f"exit {result.exit_code}")
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def assert_read_error(result) -> None:
    assert result.exit_code == 2, result.stdout
    text = " ".join(result.stderr.split())
    assert text.startswith("error: DSP5") and text.count("error:") == 1 and text.endswith("."), text
    assert "Traceback" not in result.stderr and result.stdout == ""


@contextlib.contextmanager
def copy_of(source: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "draft"
        shutil.copytree(source, folder)
        yield folder


def shard_of(folder: Path, which: int) -> Path:
    shards = sorted(folder.glob("*.safetensors"))
    return shards[which % len(shards)]


@st.composite
def header_corruption(draw, data: bytes) -> bytes:
    """Change the length prefix, replace bytes of the header JSON, or truncate the file."""
    n = header_length(data)
    kind = draw(st.sampled_from(["length", "flip", "truncate"]))
    out = bytearray(data)
    if kind == "length":
        new = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(max(0, n - 16), n + 16)))
        out[:8] = struct.pack("<Q", new)
    elif kind == "flip":
        for _ in range(draw(st.integers(1, 3))):
            out[draw(st.integers(8, 8 + n - 1))] = draw(BYTES)
    else:
        del out[draw(st.integers(0, len(data) - 1)) :]
    return bytes(out)


@SETTINGS
@given(data=st.data(), layout=st.sampled_from(["single", "sharded"]), which=st.integers(0, 1))
def test_corrupted_shard_header(fixtures, data, layout, which):
    with copy_of(fixtures[layout]) as folder:
        shard = shard_of(folder, which)
        shard.write_bytes(data.draw(header_corruption(shard.read_bytes())))
        result = validate(folder)
        if library_accepts(shard):
            assert result.exit_code in (0, 1), result.stderr
        else:
            assert_read_error(result)


@SETTINGS
@given(data=st.data(), layout=st.sampled_from(["single", "sharded"]), which=st.integers(0, 1))
def test_flips_in_tensor_data_leave_a_valid_checkpoint(fixtures, data, layout, which):
    with copy_of(fixtures[layout]) as folder:
        shard = shard_of(folder, which)
        raw = bytearray(shard.read_bytes())
        start = 8 + header_length(raw)
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(start, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        shard.write_bytes(bytes(raw))
        assert validate(folder).exit_code == 0


@SETTINGS
@given(data=st.data(), name=st.sampled_from([INDEX, "config.json"]))
def test_corrupted_index_or_config(fixtures, data, name):
    with copy_of(fixtures["sharded"]) as folder:
        target = folder / name
        raw = bytearray(target.read_bytes())
        if data.draw(st.booleans()):
            for _ in range(data.draw(st.integers(1, 3))):
                raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(BYTES)
        else:
            del raw[data.draw(st.integers(0, len(raw) - 1)) :]
        target.write_bytes(bytes(raw))
        result = validate(folder)
        usable = index_is_usable(folder) if name == INDEX else config_is_usable(folder)
        if usable:
            assert result.exit_code in (0, 1), result.stderr
        else:
            assert_read_error(result)


def nested(depth: int, opener: str) -> str:
    """`depth` nested arrays or objects around 0."""
    return (opener * depth) + "0" + ("]" if opener == "[" else "}") * depth


@SETTINGS
@given(depth=st.one_of(st.integers(1, 120), st.integers(120, 50_000)), opener=st.sampled_from(["[", '{"k":']),
       name=st.sampled_from([INDEX, "config.json"]))
def test_nested_json_is_read_up_to_100_levels_then_refused_in_one_sentence(fixtures, depth, opener, name):
    with copy_of(fixtures["sharded"]) as folder:
        target = folder / name
        text = target.read_text()
        # one more level: the file's own top-level object
        target.write_text(text[: text.rindex("}")] + f', "nested": {nested(depth, opener)}}}')
        result = validate(folder)
        if depth + 1 <= 100:
            assert result.exit_code in (0, 1), result.stderr
        else:
            assert_read_error(result)
            assert "more than 100 levels deep" in " ".join(result.stderr.split())
