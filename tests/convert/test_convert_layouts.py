"""dspark convert --to deepspec|speculators: both round trips keep every resolved config field and every tensor's
bytes, validate finds no new error, the demo pair generates the same tokens, and unfaithful conversions are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.convert.layouts import UNCOMPARED_FIELDS, convert_layout
from dspark_cli.runtime.demo import DEMO_DIR
from tests.fixtures.ckpt_factory import (DraftSpec, speculators_config, write_draft, write_folder, draft_tensors,
                                         write_nvfp4_draft, write_target_config)

runner = CliRunner()
SPEC = DraftSpec()
SPECS = {"vanilla": SPEC, "reduced-vocab": SPEC.with_(draft_vocab_size=64),
         "gated": SPEC.with_(markov_head_type="gated"),
         "one-plus-n": SPEC.with_(sample_from_anchor=False, extra_config={"dspark_bonus_anchor": True})}


def resolved(path) -> dict:
    config = DraftConfig.from_dict(open_checkpoint(str(path)).config)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(DraftConfig) if f.name not in UNCOMPARED_FIELDS
            and f.name not in ("mask_token", "target_layer_ids", "block_size")} | {
        "mask": config.mask_token_id, "ids": config.layer_ids, "block": config.block_size.value}


def tensor_bytes(path) -> dict:
    ckpt = open_checkpoint(str(path))
    out = {}
    for name, info in ckpt.tensors.items():
        with open(ckpt.file_path(info.file), "rb") as handle:
            handle.seek(info.begin)
            out[name] = (info.dtype, info.shape, handle.read(info.nbytes))
    return out


def error_codes(draft, target) -> set[str]:
    result = runner.invoke(app, ["validate", str(draft), "-t", str(target), "--json", "-"])
    return {f["code"] for f in json.loads(result.stdout)["findings"] if f["severity"] == "error"}


@pytest.mark.parametrize("name", SPECS)
def test_deepspec_speculators_deepspec_round_trip(tmp_path, name):
    spec = SPECS[name]
    source = write_draft(tmp_path / "d", spec)
    convert_layout(str(source), tmp_path / "s", "speculators", target="the-target")
    convert_layout(str(tmp_path / "s"), tmp_path / "back", "deepspec")
    assert resolved(tmp_path / "back") == resolved(source)
    assert tensor_bytes(tmp_path / "back") == tensor_bytes(source)
    speculators = tensor_bytes(tmp_path / "s")
    assert ("t2d" in speculators) == (name == "reduced-vocab")
    if name == "reduced-vocab":  # exactly Vd target ids are kept, as speculators writes it
        assert speculators["t2d"][0] == "BOOL" and sum(speculators["t2d"][2]) == 64
    target = write_target_config(tmp_path / "t", spec)
    assert error_codes(tmp_path / "s", target) <= error_codes(source, target)


@pytest.mark.parametrize("spec", [SPEC, SPEC.with_(draft_vocab_size=64)], ids=["vanilla", "reduced-vocab"])
def test_speculators_deepspec_speculators_round_trip(tmp_path, spec):
    tensors = draft_tensors(spec)
    if "d2t" in tensors:  # speculators writes t2d beside d2t
        import torch

        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[tensors["d2t"] + torch.arange(spec.vd)] = True
        tensors["t2d"] = t2d
    config = speculators_config(spec)
    config["speculators_config"]["verifier"] = {"name_or_path": "the-target"}
    source = write_folder(tmp_path / "s", config, tensors)
    convert_layout(str(source), tmp_path / "d", "deepspec")
    convert_layout(str(tmp_path / "d"), tmp_path / "back", "speculators", target="the-target")
    assert resolved(tmp_path / "back") == resolved(source) == resolved(tmp_path / "d")
    assert tensor_bytes(tmp_path / "back") == tensor_bytes(source)
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["speculators_config"]["verifier"]["name_or_path"] == "the-target"
    assert back["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == spec.block_size
    target = write_target_config(tmp_path / "t", spec)
    assert error_codes(tmp_path / "d", target) <= error_codes(source, target)


@pytest.mark.parametrize("case", ["nvfp4", "bonus-anchor", "dflash", "same-layout", "no-verifier", "shared-head",
                                  "bad-t2d"])
def test_unfaithful_conversions_are_refused_in_one_sentence(tmp_path, case):
    to, target = "speculators", "the-target"
    if case == "nvfp4":
        draft = write_nvfp4_draft(tmp_path / "d")
    elif case == "bonus-anchor":  # 1+N trained, but vLLM serves it without the bonus anchor: speculators cannot say so
        draft = write_draft(tmp_path / "d", SPEC.with_(sample_from_anchor=False))
    elif case == "dflash":
        draft = write_draft(tmp_path / "d", SPEC.with_(markov_rank=0))
    elif case == "same-layout":
        draft, to = write_draft(tmp_path / "d", SPEC), "deepspec"
    elif case == "no-verifier":
        draft, target = write_draft(tmp_path / "d", SPEC), None
    elif case == "shared-head":
        draft = write_draft(tmp_path / "d", SPEC.with_(own_lm_head=False))
    else:
        import torch

        spec = SPEC.with_(draft_vocab_size=64)
        tensors = {**draft_tensors(spec), "t2d": torch.ones(spec.vocab_size, dtype=torch.bool)}
        draft, to = write_folder(tmp_path / "d", speculators_config(spec), tensors), "deepspec"
    result = runner.invoke(app, ["convert", str(draft), "-o", str(tmp_path / "out"), "--to", to,
                                 *(["--target", target] if target else [])])
    assert result.exit_code != 0 and "cannot be converted faithfully" in result.output
    assert result.output.count(". ") <= 1 and not (tmp_path / "out").exists()


def test_output_is_exclusive_unless_forced_and_never_inside_the_draft(tmp_path):
    draft = write_draft(tmp_path / "d", SPEC)
    args = ["convert", str(draft), "--to", "speculators", "--target", "t", "-o"]
    assert runner.invoke(app, [*args, str(tmp_path / "s")]).exit_code == 0
    assert runner.invoke(app, [*args, str(tmp_path / "s")]).exit_code != 0
    assert runner.invoke(app, [*args, str(tmp_path / "s"), "--force"]).exit_code == 0
    assert runner.invoke(app, [*args, str(draft / "inside")]).exit_code != 0
    assert not (draft / "inside").exists()


def test_gguf_still_needs_the_target(tmp_path):
    result = runner.invoke(app, ["convert", str(DEMO_DIR / "draft"), "-o", str(tmp_path / "d.gguf"), "--to", "gguf"])
    assert result.exit_code != 0 and "--target must name its folder" in result.output


def test_demo_pair_generates_the_same_tokens_after_conversion(tmp_path):
    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    converted = tmp_path / "s"
    assert runner.invoke(app, ["convert", str(draft), "-o", str(converted), "--to", "speculators",
                               "--target", str(target)]).exit_code == 0

    def tokens(d):
        result = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(d), "def f(",
                                     "--max-new-tokens", "12", "--json", "-"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["prompts"][0]["tokens"]

    assert tokens(converted) == tokens(draft)
