"""`dspark quantize` re-reads what it wrote before the rename: a broken writer publishes nothing."""

import json
from pathlib import Path

import pytest
import torch
from ckpt_factory import DraftSpec, write_draft
from safetensors.torch import load_file, save_file

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.quantize import write as quantize_module
from dspark_cli.runtime.quantize.write import MARKOV_W2_GLOBAL_SCALE, quantize_checkpoint

SPEC = DraftSpec(markov_rank=64)
SHARDS = 3


def _drop_shard(folder: Path) -> None:
    """Remove a shard the index still names."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    rewritten = index["weight_map"][MARKOV_W2_GLOBAL_SCALE]
    other = next(name for name in sorted(set(index["weight_map"].values())) if name != rewritten)
    (folder / other).unlink()


def _drop_shard_and_index_entries(folder: Path) -> None:
    """Remove a shard and its tensors from the index: still a readable checkpoint, but tensors are missing."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    rewritten = index["weight_map"][MARKOV_W2_GLOBAL_SCALE]
    other = next(name for name in sorted(set(index["weight_map"].values())) if name != rewritten)
    (folder / other).unlink()
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != other}
    index_path.write_text(json.dumps(index))


def _edit_shard_tensors(folder: Path, edit) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][MARKOV_W2_GLOBAL_SCALE]
    tensors = edit(load_file(str(shard)))
    shard.unlink()  # hard links elsewhere keep their bytes
    save_file(tensors, str(shard))
    names = set(tensors)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in names or v != shard.name}
    index["weight_map"].update({name: shard.name for name in names})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _change_dtype(folder: Path) -> None:
    def edit(tensors):
        name = next(n for n, t in tensors.items() if t.dtype == torch.bfloat16)
        return {**tensors, name: tensors[name].float()}

    _edit_shard_tensors(folder, edit)


def _drop_global_scale(folder: Path) -> None:
    _edit_shard_tensors(folder, lambda t: {k: v for k, v in t.items() if k != MARKOV_W2_GLOBAL_SCALE})


def _break_config(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["block_size"] = -1  # DSP013: vLLM cannot serve it
    (folder / "config.json").write_text(json.dumps(config))


def _drop_a_plain_file(folder: Path) -> None:
    (folder / "README.md").unlink()


@pytest.mark.parametrize(
    "break_output, message",
    [
        (_drop_shard, "cannot be read back"),
        (_drop_shard_and_index_entries, "' is missing from it"),
        (_change_dtype, "changed from BF16"),
        (_drop_global_scale, "weight_scale_2' is missing"),
        (_break_config, "dspark validate reports DSP013"),
        (_drop_a_plain_file, "file(s) are missing from it, first 'README.md'"),
    ],
)
def test_a_broken_output_is_refused_and_removed(tmp_path, monkeypatch, break_output, message):
    draft = write_draft(tmp_path / "draft", SPEC, shards=SHARDS)
    (draft / "README.md").write_text("a draft\n")
    writer = quantize_module.write_quantized_checkpoint

    def broken_writer(ckpt, w2_info, weight, folder, warnings_out=None):
        result = writer(ckpt, w2_info, weight, folder, warnings_out)
        break_output(folder)
        return result

    monkeypatch.setattr(quantize_module, "write_quantized_checkpoint", broken_writer)
    out = tmp_path / "out"
    with pytest.raises(DsparkError, match="failed dspark's self-check") as caught:
        quantize_checkpoint(draft, out, engine="torch", sample_rows=0)
    assert message in caught.value.message and "nothing was written" in caught.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]  # no OUT, no temporary folder


def test_an_input_that_fails_validate_is_named_as_the_cause(tmp_path):
    draft = write_draft(tmp_path / "draft", SPEC, edit={"block_size": -1})
    with pytest.raises(DsparkError, match=r"draft itself fails dspark validate \(DSP013"):
        quantize_checkpoint(draft, tmp_path / "out", engine="torch", sample_rows=0)
    assert not (tmp_path / "out").exists()
