"""Every validate code: a checkpoint that triggers it, and valid checkpoints of every layout that trigger none."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from ckpt_factory import (
    VLLM_MARKOV_W2,
    W4A16_LAYER,
    DraftSpec,
    draft_config,
    draft_tensors,
    drop,
    nvfp4_quant_configs,
    replace_tensor,
    speculators_config,
    specforge_config,
    target_config,
    write_draft,
    write_folder,
    write_fp8_draft,
    write_nvfp4_draft,
)
from safetensors.torch import load_file, save_file

from dspark_cli.runtime.checkpoint.read import CheckpointError, open_checkpoint
from dspark_cli.runtime.checkpoint.rules import CODES, READ_ERRORS, validate_checkpoint

S = DraftSpec()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "validate.md"


def single_algo(exclude: list[str]) -> tuple[dict, dict]:
    """(config.json, hf_quant_config.json) for a global W4A16_NVFP4 with these exclusions."""
    return ({"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16, "ignore": exclude},
            {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16,
                                                                 "kv_cache_quant_algo": None,
                                                                 "exclude_modules": exclude}})


EXCLUDE_ALL_BUT_W2 = ["*layers*", "*fc*", "lm_head", "*confidence_head*"]  # "markov_head" has no "lm_head" in it


def target(spec: DraftSpec = S, **changes) -> dict:
    return {**target_config(spec), **changes}


def codes_of(path, target_config: dict | None = None, deep: bool = False) -> list[str]:
    return validate_checkpoint(open_checkpoint(path), target_config, deep=deep).codes


# --- valid checkpoints: only the expected notes -----------------------------------------------------------------

REDUCED = S.with_(draft_vocab_size=128)
DFLASH = S.with_(markov_rank=0, confidence=False, own_embed=False, own_lm_head=False)


@pytest.mark.parametrize(
    ("build", "target_config", "expected"),
    [
        (lambda p: write_draft(p, S), None, ["DSP100"]),
        (lambda p: write_draft(p, S), target(), []),
        (lambda p: write_draft(p, S, shards=3), target(), []),
        (lambda p: write_draft(p, REDUCED), target(), []),
        (lambda p: write_draft(p, S.with_(attention_bias=True, target_hidden_size=32)), target(S.with_(
            target_hidden_size=32)), []),
        (lambda p: write_draft(p, S.with_(own_embed=False, own_lm_head=False)), target(), ["DSP104", "DSP105"]),
        (lambda p: write_draft(p, S.with_(confidence=False)), target(), []),
        (lambda p: write_draft(p, S.with_(confidence_with_markov=False)), target(), []),
        (lambda p: write_draft(p, DFLASH), target(), ["DSP002", "DSP104", "DSP105"]),
        (lambda p: write_nvfp4_draft(p), target(), ["DSP314"]),
        (lambda p: write_nvfp4_draft(p, shards=2), target(), ["DSP314"]),
        (lambda p: write_nvfp4_draft(p, mutate=replace_tensor("markov_head.markov_w2.weight_scale_2",
                                                              torch.ones(1) * 1e-4)), target(), ["DSP314"]),
        (lambda p: write_nvfp4_draft(p, quantization_config=single_algo(EXCLUDE_ALL_BUT_W2)[0],
                                     hf_quant_config=single_algo(EXCLUDE_ALL_BUT_W2)[1]), target(), ["DSP314"]),
        (lambda p: write_folder(p, {**specforge_config(S), "markov_rank": S.markov_rank, "markov_head_type": "vanilla",
                                    "enable_confidence_head": True, "confidence_head_with_markov": True},
                                draft_tensors(S)), target(), []),
        (lambda p: write_folder(p, {**specforge_config(S), "architectures": ["Qwen3DSparkModel"],
                                    "markov_rank": S.markov_rank, "enable_confidence_head": True,
                                    "confidence_head_with_markov": True}, draft_tensors(S)), target(), []),
        (lambda p: write_folder(p, speculators_config(S.with_(block_size=4)), draft_tensors(S)), target(), ["DSP006"]),
        (lambda p: write_folder(p, speculators_config(DFLASH, "dflash"), draft_tensors(DFLASH)), target(),
         ["DSP002", "DSP104", "DSP105"]),
        # drafts vLLM serves although older rules refused them
        (lambda p: write_draft(p, REDUCED, mutate=lambda t: {**t, "d2t": t["d2t"].to(torch.int32)}), target(), []),
        (lambda p: write_folder(p, {**draft_config(S), "draft_vocab_size": None}, draft_tensors(S)), target(), []),
        (lambda p: write_draft(p, S.with_(vocab_size=257, draft_vocab_size=256, mask_token_id=256),
                               mutate=drop("d2t")), target(), []),  # mask row T of the draft's own [T+1, H] embedding
        (lambda p: write_draft(p, S.with_(sample_from_anchor=False), edit={"dspark_bonus_anchor": True}), target(),
         ["DSP030"]),
        (lambda p: write_draft(p, S, edit={"logit_scale": 0.5}), target(), []),
        (lambda p: write_draft(p, S.with_(draft_vocab_size=300), mutate=drop("d2t")), target(), ["DSP020"]),
    ],
    ids=["single", "target", "sharded", "reduced-vocab", "bias+narrow-target", "shared-embed", "no-confidence",
         "confidence-no-markov", "dflash", "nvfp4", "nvfp4-sharded", "nvfp4-scale2-shape-1", "nvfp4-single-algo",
         "specforge-hoisted", "specforge-renamed", "speculators-dspark", "speculators-dflash", "int32-d2t",
         "null-draft-vocab", "mask-in-own-embedding", "bonus-anchor-both-keys", "logit-scale", "padded-draft-vocab"],
)
def test_valid_checkpoints_trigger_no_rule(tmp_path, build, target_config, expected):
    path = build(tmp_path / "draft")
    assert codes_of(path, target_config) == expected
    assert codes_of(path, target_config, deep=True) == expected


def test_resolved_values_name_their_source(tmp_path):
    config = {**draft_config(S), "dflash_config": {"mask_token_id": 7}}
    path = write_folder(tmp_path / "d", config, draft_tensors(S))
    resolved = validate_checkpoint(open_checkpoint(path)).resolved
    assert resolved["mask_token"] == {"value": 7, "source": "dflash_config.mask_token_id"}
    assert resolved["target_layer_ids"] == {"value": [0, 2], "source": "target_layer_ids",
                                            "hidden_states_indices": [1, 3]}
    assert resolved["block_size"] == {"value": 4, "source": "block_size"}
    assert resolved["target_vocab_size"] == {"value": 256, "source": "assumed = vocab_size"}
    assert resolved["head_format"] == "bf16" and resolved["shards"] == 1


def test_nvfp4_head_format_is_resolved(tmp_path):
    report = validate_checkpoint(open_checkpoint(write_nvfp4_draft(tmp_path / "d")), target())
    assert report.resolved["head_format"] == "nvfp4 (W4A16, MIXED_PRECISION)"


def test_what_dspark_quantize_writes_is_valid(tmp_path):
    quantize = pytest.importorskip("dspark_cli.runtime.quantize.write")
    spec = S.with_(markov_rank=64)
    source = write_draft(tmp_path / "bf16", spec, shards=2)
    quantize.quantize_checkpoint(source, tmp_path / "nvfp4", engine="torch")
    report = validate_checkpoint(open_checkpoint(tmp_path / "nvfp4"), target(spec), deep=True)
    assert report.codes == ["DSP314"]
    assert report.resolved["head_format"] == "nvfp4 (W4A16, MIXED_PRECISION)"


# --- one trigger per code ---------------------------------------------------------------------------------------


@dataclass
class Case:
    code: str
    build: Callable[[Path], Path | str]
    target: dict | None = None
    deep: bool = False
    after_open: Callable[[Path], None] | None = None  # runs between reading headers and validating


def outcome(case: Case, path: Path) -> list[str]:
    """Finding codes, or the one read-error code."""
    try:
        source = case.build(path)
        ckpt = open_checkpoint(source)
        if case.after_open:
            case.after_open(Path(source))
        return validate_checkpoint(ckpt, case.target, deep=case.deep).codes
    except CheckpointError as error:
        return [error.code]


GEMMA = DraftSpec(family="gemma4")  # a DeepSpec Gemma-4 draft (its own rules, DSP040-DSP047)
DFLASH2 = DraftSpec(family="dflash2", markov_rank=0, confidence=False)  # docs/formats-other.md §7 (DSP060-DSP065)


def edited(**edit) -> Callable[[Path], Path]:
    return lambda p: write_draft(p, S, edit=edit)


def mutated(mutation, spec: DraftSpec = S) -> Callable[[Path], Path]:
    return lambda p: write_draft(p, spec, mutate=mutation)


def add(name: str, value: torch.Tensor):
    return lambda t: {**t, name: value}


def nvfp4(**kwargs) -> Callable[[Path], Path]:
    return lambda p: write_nvfp4_draft(p, **kwargs)


def fp8(**kwargs) -> Callable[[Path], Path]:
    return lambda p: write_fp8_draft(p, **kwargs)


def json_file(name: str, text: str, spec: DraftSpec = S, shards: int = 1) -> Callable[[Path], Path]:
    return with_file(name, text.encode(), spec, shards)


def index_edit(change: Callable[[dict], None]) -> Callable[[Path], Path]:
    def build(p: Path) -> Path:
        write_draft(p, S, shards=2)
        index = json.loads((p / "model.safetensors.index.json").read_text())
        change(index)
        (p / "model.safetensors.index.json").write_text(json.dumps(index))
        return p

    return build


def raw_safetensors(header: dict, data: bytes) -> Callable[[Path], Path]:
    def build(p: Path) -> Path:
        p.mkdir()
        (p / "config.json").write_text(json.dumps(draft_config(S)))
        raw = json.dumps(header).encode()
        (p / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        return p

    return build


def file_bytes(change: Callable[[bytes], bytes]) -> Callable[[Path], Path]:
    def build(p: Path) -> Path:
        write_draft(p, S)
        weights = p / "model.safetensors"
        weights.write_bytes(change(weights.read_bytes()))
        return p

    return build


def move_to_other_shard(name: str) -> Callable[[dict], None]:
    def change(index: dict) -> None:
        shards = sorted(set(index["weight_map"].values()))
        index["weight_map"][name] = next(s for s in shards if s != index["weight_map"][name])

    return change


def duplicated_in_second_shard(p: Path) -> Path:
    write_draft(p, S, shards=2)
    second = p / "model-00002-of-00002.safetensors"
    tensors = load_file(p / "model-00002-of-00002.safetensors")
    first = load_file(p / "model-00001-of-00002.safetensors")
    name = next(iter(first))
    save_file({**tensors, name: first[name]}, str(second))
    return p


def with_file(name: str, data: bytes, spec: DraftSpec = S, shards: int = 1) -> Callable[[Path], Path]:
    def build(p: Path) -> Path:
        write_draft(p, spec, shards=shards)
        (p / name).write_bytes(data)
        return p

    return build


def prefixed(tensors: dict) -> dict:
    return {f"model.{k}": v for k, v in tensors.items()}


def aliased(tensors: dict) -> dict:
    return {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v for k, v in tensors.items()}


def extra_layer(tensors: dict) -> dict:
    """A third decoder layer in a draft whose config says num_hidden_layers 2."""
    return {**tensors, **{k.replace("layers.1.", "layers.2.", 1): v.clone() for k, v in tensors.items()
                          if k.startswith("layers.1.")}}


def config_only(p: Path, config: dict, tensors: dict | None = None) -> Path:
    return write_folder(p, config, draft_tensors(S) if tensors is None else tensors)


NAN = torch.full((S.hidden_size,), float("nan"), dtype=torch.bfloat16)
R64 = DraftSpec(markov_rank=64)
specforge_confidence = {**specforge_config(S), "markov_rank": S.markov_rank}

CASES = [
    # config
    Case("DSP001", edited(architectures=["Qwen3ForCausalLM"])),
    Case("DSP001", edited(architectures=["DSparkDraftModel"], model_type="deepseek_v4")),
    Case("DSP002", lambda p: write_draft(p, DFLASH)),
    Case("DSP003", edited(architectures=["Qwen3OmniDSparkModel"])),
    Case("DSP004", lambda p: config_only(p, specforge_config(S))),
    Case("DSP005", lambda p: config_only(p, specforge_confidence)),
    Case("DSP006", lambda p: config_only(p, speculators_config(S))),
    Case("DSP010", edited(hidden_size=None)),
    Case("DSP010", edited(intermediate_size=-1)),
    Case("DSP011", edited(markov_rank=None)),
    Case("DSP011", edited(markov_rank="256")),
    Case("DSP007", edited(markov_rank=0)),
    Case("DSP012", edited(markov_head_type="gated")),
    Case("DSP040", lambda p: write_draft(p, GEMMA, mutate=lambda t: {k: v for k, v in t.items()
                                                                      if k != "embed_tokens.weight"})),
    Case("DSP041", lambda p: write_draft(p, GEMMA.with_(attention_k_eq_v=False))),
    Case("DSP042", lambda p: write_draft(p, GEMMA.with_(draft_vocab_size=128))),
    Case("DSP043", lambda p: write_draft(p, GEMMA)),
    Case("DSP044", lambda p: write_draft(p, GEMMA, edit={"layer_types": ["sliding_attention", "full_attention"]})),
    Case("DSP045", lambda p: write_draft(p, GEMMA, edit={"enable_moe_block": True})),
    Case("DSP046", lambda p: write_draft(p, GEMMA)),
    Case("DSP047", lambda p: write_draft(p, GEMMA, edit={"global_head_dim": None})),
    Case("DSP060", lambda p: write_draft(p, DFLASH2, edit={"dflash_config": {"mask_token_id": 250,
                                                                          "target_layer_ids": [0, 2]}})),
    Case("DSP061", lambda p: write_draft(p, DFLASH2.with_(conv_group_size=24))),
    Case("DSP062", lambda p: write_draft(p, DFLASH2.with_(selector_top_k=8))),  # 64 < 8 * 9
    Case("DSP063", lambda p: write_draft(p, DFLASH2.with_(vocab_size=6, mask_token_id=5, selector_top_k=7))),
    Case("DSP064", lambda p: write_draft(p, DFLASH2, edit={"selector_top_k": 4, "dflash_config": {
        "mask_token_id": 250, "target_layer_ids": [0, 2], "conv_kernel_size": 3, "conv_group_size": 16,
        "selector_rank": 16}})),
    Case("DSP065", lambda p: write_draft(p, DFLASH2, edit={"markov_rank": 32})),
    Case("DSP013", edited(block_size=0)),
    Case("DSP014", edited(block_size=None)),
    Case("DSP015", edited(mask_token_id=None)),
    Case("DSP016", edited(mask_token_id=256)),
    Case("DSP015", lambda p: config_only(p, {**draft_config(S), "dflash_config": {"mask_token_id": None}})),
    Case("DSP016", lambda p: write_draft(p, S.with_(own_embed=False, mask_token_id=200)),
         target=target(vocab_size=128)),  # the mask row would come from the target's [128, H] embedding
    Case("DSP017", edited(target_layer_ids=None)),
    Case("DSP017", edited(target_layer_ids="0,2")),
    Case("DSP018", edited(target_layer_ids=[2, 0])),
    Case("DSP018", edited(target_layer_ids=[2, 2])),  # a repeated id is not strictly increasing either
    Case("DSP019", edited(target_layer_ids=[0, 4])),
    Case("DSP019", edited(target_layer_ids=[0, 2]), target=target(num_hidden_layers=2)),
    Case("DSP020", lambda p: write_draft(p, S.with_(draft_vocab_size=300)), target=target()),
    Case("DSP021", mutated(drop("confidence_head.proj.weight", "confidence_head.proj.bias"))),
    Case("DSP022", edited(enable_confidence_head=False)),
    Case("DSP023", edited(confidence_head_with_markov=None)),
    Case("DSP024", lambda p: write_draft(p, S), target=target(hidden_size=128)),
    Case("DSP025", lambda p: write_draft(p, S), target=target(vocab_size=300)),
    Case("DSP026", edited(num_key_value_heads=3)),
    Case("DSP027", edited(dspark_draft_topk=0)),
    Case("DSP027", edited(dspark_draft_topk=1000)),
    Case("DSP028", edited(layer_types=["sliding_attention", "full_attention"])),
    Case("DSP048", edited(use_sliding_window=True, sliding_window=64)),
    Case("DSP049", edited(layer_types=["sliding_attention", "full_attention"], sliding_window=64)),
    Case("DSP029", edited(use_aux_hidden_state=False)),
    Case("DSP030", lambda p: write_draft(p, S.with_(sample_from_anchor=False))),
    Case("DSP031", lambda p: write_draft(p, S), target=target(num_hidden_layers=6)),
    Case("DSP032", edited(logit_scale=0)),
    Case("DSP032", edited(logit_scale=-1.5)),
    Case("DSP032", edited(logit_scale="2")),
    Case("DSP033", lambda p: write_draft(p, S.with_(sample_from_anchor=False))),
    Case("DSP033", edited(sample_from_anchor=True, dspark_bonus_anchor=True)),
    Case("DSP034", edited(target_layer_ids=[0, 3])),  # num_target_layers 4
    Case("DSP034", edited(target_layer_ids=[0, 2]), target=target(num_hidden_layers=3)),
    # vLLM load errors
    Case("DSP100", lambda p: write_draft(p, S)),
    Case("DSP101", lambda p: write_draft(p, S.with_(vocab_size=300, own_embed=False)), target=target(vocab_size=256)),
    Case("DSP102", lambda p: write_draft(p, REDUCED.with_(own_lm_head=False)), target=target()),
    Case("DSP102", lambda p: write_draft(p, S.with_(own_lm_head=False)), target=target(vocab_size=512)),
    Case("DSP102", lambda p: config_only(p, {**draft_config(S), "draft_vocab_size": None},
                                         drop("lm_head.weight")(draft_tensors(S))), target=target(vocab_size=512)),
    Case("DSP103", mutated(drop("d2t"), REDUCED), target=target()),
    Case("DSP104", lambda p: write_draft(p, S.with_(own_embed=False))),
    Case("DSP105", lambda p: write_draft(p, S.with_(own_lm_head=False))),
    Case("DSP106", mutated(add("d2t", torch.zeros(256, dtype=torch.long))), target=target()),
    Case("DSP106", lambda p: write_draft(p, S.with_(draft_vocab_size=300)), target=target()),
    # tensors
    Case("DSP035", edited(hidden_act="bogus")),
    Case("DSP035", edited(hidden_act="gelu")),
    Case("DSP035", edited(rms_norm_eps="x")),
    Case("DSP035", edited(rms_norm_eps=0)),
    Case("DSP035", edited(max_position_embeddings="4096")),
    Case("DSP035", edited(attention_bias="no")),
    Case("DSP035", edited(rope_parameters=[1, 2])),
    Case("DSP035", edited(rope_parameters={"rope_type": "warp", "rope_theta": 1e6})),
    Case("DSP035", edited(rope_parameters={"rope_type": "default", "rope_theta": -1})),
    Case("DSP035", edited(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.5})),
    Case("DSP035", edited(layer_types=["full_attention"] * 5)),
    Case("DSP035", edited(layer_types=["full_attention", "chunked"])),
    Case("DSP035", edited(rope_theta="1e6")),
    Case("DSP035", edited(layer_types=["sliding_attention", "full_attention"], sliding_window=-4)),
    Case("DSP201", mutated(drop("layers.1.mlp.down_proj.weight"))),
    Case("DSP201", mutated(drop("confidence_head.proj.bias"))),
    Case("DSP202", mutated(replace_tensor("fc.weight", torch.zeros(64, 100, dtype=torch.bfloat16)))),
    Case("DSP202", edited(confidence_head_with_markov=False)),
    Case("DSP202", mutated(replace_tensor("d2t", torch.zeros(100, dtype=torch.long)), REDUCED), target=target()),
    Case("DSP202", mutated(replace_tensor("d2t", torch.zeros(100, dtype=torch.int32)), REDUCED), target=target()),
    Case("DSP203", mutated(replace_tensor("norm.weight", torch.ones(64, dtype=torch.int32)))),
    Case("DSP203", mutated(replace_tensor("embed_tokens.weight", torch.zeros(256, 64, dtype=torch.uint8)))),
    Case("DSP204", mutated(replace_tensor("d2t", torch.zeros(128, dtype=torch.float32)), REDUCED)),
    Case("DSP205", mutated(add("extra.weight", torch.zeros(4, dtype=torch.bfloat16)))),
    Case("DSP205", mutated(add("extra.bias", torch.zeros(4, dtype=torch.bfloat16)))),
    Case("DSP205", mutated(extra_layer)),
    Case("DSP206", mutated(add("t2d", torch.ones(256, dtype=torch.bool)))),
    Case("DSP207", mutated(add("mask_embedding", torch.zeros(64, dtype=torch.bfloat16)))),
    Case("DSP208", mutated(aliased)),
    Case("DSP209", mutated(prefixed)),
    Case("DSP210", mutated(add("layers.0.self_attn.q_proj.bias", torch.zeros(64, dtype=torch.bfloat16)))),
    Case("DSP210", mutated(add("norm.bias", torch.zeros(64, dtype=torch.bfloat16)))),
    Case("DSP211", mutated(add("candidate_selector.hidden_projection.weight", torch.zeros(16, 64)), DFLASH)),
    # NVFP4
    Case("DSP301", nvfp4(mutate=replace_tensor("markov_head.markov_w2.weight",
                                               torch.zeros(256, 64, dtype=torch.uint8)))),
    Case("DSP302", nvfp4(mutate=drop("markov_head.markov_w2.weight_scale"))),
    Case("DSP302", nvfp4(mutate=replace_tensor("markov_head.markov_w2.weight_scale",
                                               torch.ones(256, 4, dtype=torch.uint8)))),
    Case("DSP302", nvfp4(mutate=replace_tensor("markov_head.markov_w2.weight_scale",
                                               torch.ones(256, 8).to(torch.float8_e4m3fn)))),
    Case("DSP303", nvfp4(mutate=drop("markov_head.markov_w2.weight_scale_2"))),
    Case("DSP303", nvfp4(mutate=replace_tensor("markov_head.markov_w2.weight_scale_2", torch.ones(2)))),
    Case("DSP303", nvfp4(mutate=replace_tensor("markov_head.markov_w2.weight_scale_2",
                                               torch.tensor(1.0, dtype=torch.bfloat16)))),
    Case("DSP304", nvfp4(spec=DraftSpec(markov_rank=40))),
    Case("DSP305", nvfp4(spec=DraftSpec(markov_rank=32))),
    Case("DSP306", nvfp4(quantization_config={}, hf_quant_config={})),
    Case("DSP307", nvfp4(quantization_config={**nvfp4_quant_configs()[0], "quant_algo": "INT4_AWQ"},
                         hf_quant_config={})),
    Case("DSP307", nvfp4(quantization_config={k: v for k, v in nvfp4_quant_configs()[0].items() if k != "quant_algo"},
                         hf_quant_config={})),
    Case("DSP307", nvfp4(quantization_config={}, hf_quant_config={"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "W4A16_NVFP4", "group_size": 16}})),
    Case("DSP307", nvfp4(quantization_config={**nvfp4_quant_configs()[0], "quantized_layers": {
        VLLM_MARKOV_W2: {"quant_algo": "W4A16_AWQ", "group_size": 128}}}, hf_quant_config={})),
    Case("DSP308", nvfp4(quantization_config=nvfp4_quant_configs({"markov_head.markov_w2": W4A16_LAYER})[0],
                         hf_quant_config=nvfp4_quant_configs({"markov_head.markov_w2": W4A16_LAYER})[1])),
    Case("DSP308", nvfp4(quantization_config=single_algo(["markov_head"])[0], hf_quant_config={})),
    Case("DSP308", nvfp4(quantization_config=nvfp4_quant_configs({VLLM_MARKOV_W2: {"quant_algo": "FP8"}})[0],
                         hf_quant_config={})),
    Case("DSP309", nvfp4(hf_quant_config=nvfp4_quant_configs({VLLM_MARKOV_W2: W4A16_LAYER,
                                                              "lm_head": W4A16_LAYER})[1])),
    Case("DSP310", nvfp4(quantization_config=single_algo(["lm_head"])[0], hf_quant_config={})),
    Case("DSP310", edited(quantization_config=nvfp4_quant_configs()[0])),
    Case("DSP311", nvfp4(quantization_config=nvfp4_quant_configs({VLLM_MARKOV_W2: {"quant_algo": "NVFP4",
                                                                                   "group_size": 16}})[0],
                         hf_quant_config={})),
    Case("DSP312", nvfp4(quantization_config={})),
    Case("DSP313", nvfp4(quantization_config={"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"},
                         hf_quant_config={})),
    Case("DSP314", nvfp4(quantization_config=single_algo(EXCLUDE_ALL_BUT_W2)[0],
                         hf_quant_config=single_algo(EXCLUDE_ALL_BUT_W2)[1])),
    Case("DSP315", nvfp4(mutate=add("markov_head.markov_w2.input_scale", torch.tensor(1.0)))),
    Case("DSP316", fp8(mutate=lambda t: {**t, "fc.weight": t["fc.weight"][:, :64].contiguous()})),
    Case("DSP317", fp8(mutate=drop("fc.weight_scale"))),
    Case("DSP317", fp8(mutate=replace_tensor("fc.weight_scale", torch.ones(64)))),
    Case("DSP318", fp8(mutate=drop("fc.input_scale"))),
    Case("DSP319", fp8(layers={"model.layers.0.mlp.down_proj": {"quant_algo": "FP8"}})),
    Case("DSP319", fp8(layers={"model.fc": {"quant_algo": "W4A16_NVFP4", "group_size": 16}})),
    # files
    Case("DSP401", with_file("pytorch_model.bin", b"\x80\x02}q\x00.")),
    Case("DSP402", duplicated_in_second_shard),
    Case("DSP403", index_edit(move_to_other_shard("norm.weight"))),
    Case("DSP403", index_edit(lambda index: index["weight_map"].pop("norm.weight"))),
    Case("DSP404", with_file("extra.safetensors", b"", shards=2)),
    # read errors (exit 2)
    Case("DSP500", lambda p: str(p / "does-not-exist")),
    Case("DSP500", lambda p: write_draft(p, S) / "config.json"),
    Case("DSP501", lambda p: (write_draft(p, S) / "config.json").unlink() or p),
    Case("DSP502", json_file("config.json", '{"hidden_size": 64,')),
    Case("DSP502", json_file("config.json", "[1, 2]")),
    Case("DSP502", json_file("hf_quant_config.json", "{oops")),
    Case("DSP503", file_bytes(lambda b: b[:8] + b"#" + b[9:])),
    Case("DSP503", file_bytes(lambda b: b[:3])),
    Case("DSP503", raw_safetensors({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))),
    Case("DSP503", raw_safetensors({"__metadata__": {"format": 1}}, b"")),
    Case("DSP503", raw_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, bytes(12))),
    Case("DSP504", raw_safetensors({"a": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))),
    Case("DSP505", raw_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))),
    Case("DSP506", file_bytes(lambda b: b[:-100])),
    Case("DSP507", lambda p: (write_draft(p, S) / "model.safetensors").rename(p / "pytorch_model.bin").parent),
    Case("DSP508", json_file("model.safetensors.index.json", '{"metadata": {}}', shards=2)),
    Case("DSP509", index_edit(lambda index: index["weight_map"].update({"norm.weight": "../evil.safetensors"}))),
    Case("DSP510", index_edit(lambda index: index["weight_map"].update({"norm.weight": "gone.safetensors"}))),
    Case("DSP511", lambda p: "nobody-dspark/not-in-the-cache"),
    Case("DSP512", lambda p: write_draft(p, S), target={"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64}),
    Case("DSP513", file_bytes(lambda b: b + b"\x00" * 4)),
    Case("DSP513", raw_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))),
    Case("DSP514", lambda p: write_draft(p, S), deep=True, after_open=lambda p: (p / "model.safetensors").unlink()),
    # deep
    Case("DSP601", mutated(replace_tensor("norm.weight", NAN)), deep=True),
    Case("DSP602", mutated(replace_tensor("layers.0.mlp.up_proj.weight", torch.zeros(128, 64, dtype=torch.bfloat16))),
         deep=True),
    Case("DSP603", mutated(replace_tensor("d2t", torch.full((128,), 200, dtype=torch.long)), REDUCED), target=target(),
         deep=True),
    Case("DSP604", mutated(replace_tensor("d2t", -torch.arange(128, dtype=torch.long)), REDUCED), target=target(),
         deep=True),
    Case("DSP605", nvfp4(mutate=replace_tensor("markov_head.markov_w2.weight_scale",
                                               torch.full((256, 4), -2.0).to(torch.float8_e4m3fn))), deep=True),
    Case("DSP605", nvfp4(mutate=replace_tensor("markov_head.markov_w2.weight_scale",
                                               torch.full((256, 4), float("nan")).to(torch.float8_e4m3fn))), deep=True),
    Case("DSP606", nvfp4(mutate=replace_tensor("markov_head.markov_w2.weight_scale_2", torch.tensor(0.0))), deep=True),
    Case("DSP607", mutated(replace_tensor("hidden_norm.weight", torch.ones(64, dtype=torch.bfloat16))), deep=True),
    Case("DSP609", fp8(mutate=replace_tensor("fc.input_scale", torch.tensor(0.0))), deep=True),
    Case("DSP609", fp8(mutate=replace_tensor("fc.weight_scale", torch.tensor(float("inf")))), deep=True),
    Case("DSP607", mutated(replace_tensor("layers.1.input_layernorm.weight", torch.full((64,), 0.5))), deep=True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.code}-{i}" for i, c in enumerate(CASES)])
def test_rule_triggers(tmp_path, case):
    found = outcome(case, tmp_path / "draft")
    assert case.code in found
    if case.code in READ_ERRORS:
        assert found == [case.code]


def test_every_code_has_a_trigger_case():
    gguf = {code for code in {*CODES, *READ_ERRORS} if code.startswith("DSP8")}  # tests/checkpoint/test_validate_gguf.py
    probe = {"DSP608"}  # validate --probe: tests/test_probe.py
    assert {c.code for c in CASES} == (set(CODES) | set(READ_ERRORS)) - gguf - probe


def test_every_code_is_documented_with_its_severity():
    rows = dict(re.findall(r"^\| `(DSP\d{3})` \| ([\w-]+) \|", DOCS.read_text(), flags=re.M))
    assert rows == {**{code: severity for code, (severity, _) in CODES.items()},
                    **{code: "exit-2" for code in READ_ERRORS}}


def test_findings_are_one_sentence_each_with_a_hint(tmp_path):
    path = write_draft(tmp_path / "d", S, edit={"markov_head_type": "rnn", "block_size": 0},
                       mutate=drop("layers.0.mlp.up_proj.weight"))
    report = validate_checkpoint(open_checkpoint(path))
    assert report.findings
    for finding in report.findings:
        assert finding.severity == CODES[finding.code][0]
        assert finding.message.endswith(".") and "\n" not in finding.message and finding.hint


def test_unknown_architecture_skips_the_draft_rules(tmp_path):
    report = validate_checkpoint(open_checkpoint(write_draft(tmp_path / "d", S, edit={
        "architectures": ["LlamaForCausalLM"], "markov_rank": None})))
    assert report.codes == ["DSP001"]
    assert any(s.check.startswith("DSP002") for s in report.skipped)


def test_skipped_checks_are_named_without_target_or_deep(tmp_path):
    report = validate_checkpoint(open_checkpoint(write_draft(tmp_path / "d", S)))
    skipped = {s.check for s in report.skipped}
    assert {"DSP101", "DSP601-DSP607, DSP609", "DSP024, DSP025, DSP031"} <= skipped
    report = validate_checkpoint(open_checkpoint(write_draft(tmp_path / "e", S)), target(),
                                 deep=True)
    assert report.skipped == []


def test_speculators_layer_ids_are_shifted_like_vllm(tmp_path):
    path = write_folder(tmp_path / "d", speculators_config(S), draft_tensors(S))
    report = validate_checkpoint(open_checkpoint(path), target())
    assert report.format == "speculators-dspark"
    assert report.resolved["target_layer_ids"]["value"] == [0, 2]
    assert report.resolved["target_layer_ids"]["hidden_states_indices"] == [1, 3]


def test_single_algo_exclusion_uses_vllm_substring_matching(tmp_path):
    # "markov_head.markov_w1" (ModelOpt's own toy export) excludes nothing quantizable: every other layer is claimed.
    path = write_nvfp4_draft(tmp_path / "d", quantization_config=single_algo(["markov_head.markov_w1"])[0],
                             hf_quant_config={})
    findings = [f for f in validate_checkpoint(open_checkpoint(path), target(R64)).findings if f.code == "DSP310"]
    claimed = {re.search(r"quantize (\S+) as", f.message).group(1) for f in findings}
    assert claimed == {"model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
                       "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
                       "model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj",
                       "model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj",
                       "model.fc", "lm_head", "model.confidence_head.proj"}


def test_dflash_draft_with_markov_tensors_lists_them_as_unexpected(tmp_path):
    tensors = draft_tensors(S)
    path = write_folder(tmp_path / "d", draft_config(DFLASH), {k: v for k, v in tensors.items()
                                                              if not k.startswith("confidence")})
    findings = validate_checkpoint(open_checkpoint(path), target()).findings
    assert {f.message.split("'")[1] for f in findings if f.code == "DSP205"} == {
        "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}


def test_null_draft_vocab_size_means_vocab_size_like_vllm(tmp_path):
    path = write_folder(tmp_path / "d", {**draft_config(S), "draft_vocab_size": None}, draft_tensors(S))
    report = validate_checkpoint(open_checkpoint(path), target(vocab_size=512))
    assert report.resolved["draft_vocab_size"] == {"value": 256, "source": "vocab_size (default)"}
    assert not any(s.check.startswith("DSP020") for s in report.skipped)
    assert "DSP010" not in report.codes


def test_mixed_precision_accepts_every_per_layer_algo_vllm_maps(tmp_path):
    for algo in ("MXFP8", "FP8_PB_WO"):  # ModelOptMixedPrecisionConfig.get_quant_method
        json_config, legacy = nvfp4_quant_configs({VLLM_MARKOV_W2: W4A16_LAYER, "model.fc": {"quant_algo": algo}})
        path = write_nvfp4_draft(tmp_path / algo, quantization_config=json_config, hf_quant_config=legacy)
        codes = codes_of(path, target(R64))
        assert "DSP307" not in codes and "DSP310" in codes  # fc is claimed by that algo but stored bf16


def test_fp8_stored_layer_claimed_fp8_is_not_called_unquantized(tmp_path):
    json_config, legacy = nvfp4_quant_configs({VLLM_MARKOV_W2: W4A16_LAYER, "model.fc": {"quant_algo": "FP8"}})
    path = write_nvfp4_draft(tmp_path / "d", quantization_config=json_config, hf_quant_config=legacy,
                             mutate=lambda t: {**t, "fc.weight": t["fc.weight"].to(torch.float8_e4m3fn)})
    assert "DSP310" not in codes_of(path, target(R64))


def test_ignored_legacy_quant_file_only_warns(tmp_path):
    legacy = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}
    report = validate_checkpoint(open_checkpoint(write_nvfp4_draft(tmp_path / "d", hf_quant_config=legacy)),
                                 target(R64))
    assert "DSP307" not in report.codes and "DSP309" in report.codes
    assert report.exit_code() == 0


def test_load_failures_vllm_raises_on_are_errors(tmp_path):
    cases = {
        "DSP205": write_draft(tmp_path / "a", S, mutate=extra_layer),
        "DSP106": write_draft(tmp_path / "b", S, mutate=add("d2t", torch.zeros(256, dtype=torch.long))),
        "DSP015": config_only(tmp_path / "c", {**draft_config(S), "dflash_config": {"mask_token_id": None}}),
        "DSP034": write_draft(tmp_path / "d", S, edit={"target_layer_ids": [0, 3]}),
        # vLLM fails on these or drops them silently: either way not shippable
        "DSP210": write_draft(tmp_path / "e", S, mutate=add("norm.bias", torch.zeros(64, dtype=torch.bfloat16))),
        "DSP315": write_nvfp4_draft(tmp_path / "f", mutate=add("markov_head.markov_w2.input_scale", torch.tensor(1.0))),
    }
    for code, path in cases.items():
        report = validate_checkpoint(open_checkpoint(path), target())
        assert code in report.codes and report.exit_code() == 1, code


def test_extra_layer_is_named_per_tensor(tmp_path):
    findings = validate_checkpoint(open_checkpoint(write_draft(tmp_path / "d", S, mutate=extra_layer))).findings
    names = {f.message.split("'")[1] for f in findings if f.code == "DSP205"}
    assert len(names) == 11 and all(n.startswith("layers.2.") for n in names)


def test_shape_hint_points_at_the_confidence_flag(tmp_path):
    path = write_draft(tmp_path / "d", S, edit={"confidence_head_with_markov": False})
    (finding,) = [f for f in validate_checkpoint(open_checkpoint(path)).findings if f.code == "DSP202"]
    assert "confidence_head.proj.weight" in finding.message
    assert "set confidence_head_with_markov to true" in finding.hint


def test_validation_never_modifies_the_checkpoint(tmp_path):
    path = write_nvfp4_draft(tmp_path / "d")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    validate_checkpoint(open_checkpoint(path), target(R64), deep=True)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


def test_logit_scale_is_used_as_vllm_uses_it():
    from dspark_cli.runtime.checkpoint.config import DraftConfig

    assert DraftConfig.from_dict({**draft_config(S), "logit_scale": -2.0}).logit_scale == -2.0
    assert DraftConfig.from_dict({**draft_config(S), "logit_scale": 0}).logit_scale == 0.0
    assert DraftConfig.from_dict({**draft_config(S), "logit_scale": "2"}).logit_scale == 1.0  # DSP032 reports it
