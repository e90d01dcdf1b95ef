"""validate's rules read one frozen context: the facts that used to pass between rules, and order independence."""

from __future__ import annotations

from ckpt_factory import DraftSpec, nvfp4_quant_configs, target_config, write_draft, write_nvfp4_draft
from test_validate_rules import CASES

from dspark_cli.runtime.checkpoint.read import CheckpointError, open_checkpoint
from dspark_cli.runtime.checkpoint.layout import MARKOV_W2
from dspark_cli.runtime.checkpoint.rules import CHECKPOINT_RULES, DRAFT_RULES, READ_ERRORS, VALUE_RULES
from dspark_cli.runtime.checkpoint.rules.context import build_context, read_target

S = DraftSpec()


def context(path, target=None, deep=False):
    return build_context(open_checkpoint(path), read_target(target), deep)


def test_an_untrustworthy_layer_count_keeps_only_the_heads_and_fc(tmp_path):
    ctx = context(write_draft(tmp_path / "d", S, edit={"num_hidden_layers": 100_000}))
    assert ctx.is_draft and not ctx.geometry_ok and not ctx.expected
    assert [m.prefix for m in ctx.modules] == ["model.fc", "lm_head", "model.confidence_head.proj",
                                               "model.markov_head.markov_w2"]
    healthy = context(write_draft(tmp_path / "h", S))
    assert healthy.geometry_ok and len(healthy.modules) == 4 * S.num_hidden_layers + 4
    assert "layers.1.mlp.down_proj.weight" in healthy.expected


def test_the_quantization_facts_of_an_nvfp4_draft(tmp_path):
    ctx = context(write_nvfp4_draft(tmp_path / "d"), target_config(DraftSpec(markov_rank=64)))
    assert ctx.nvfp4_weights == {MARKOV_W2} and ctx.head_claim == "W4A16_NVFP4"
    assert ctx.quant is ctx.json_quant and ctx.legacy_quant is not None and not ctx.foreign_quant
    only_legacy = context(write_nvfp4_draft(tmp_path / "legacy", quantization_config={}))
    assert only_legacy.json_quant is None and only_legacy.quant is only_legacy.legacy_quant
    broken = context(write_nvfp4_draft(tmp_path / "broken", quantization_config={
        **nvfp4_quant_configs()[0], "quant_algo": "INT4"}))
    assert broken.quant is None and broken.quant_read is broken.json_quant and broken.head_claim is None


def test_a_foreign_quantizer_gives_no_usable_config(tmp_path):
    # fields ModelOpt's parser would accept, but another quant_method: vLLM does not read it as ModelOpt's
    foreign = {**nvfp4_quant_configs()[0], "quant_method": "gptq"}
    ctx = context(write_nvfp4_draft(tmp_path / "d", quantization_config=foreign))
    assert ctx.foreign_quant and not ctx.json_quant.problems
    assert ctx.quant is None and ctx.head_claim is None


def test_a_checkpoint_that_is_no_draft_has_no_draft_facts(tmp_path):
    ctx = context(write_draft(tmp_path / "d", S, edit={"architectures": ["LlamaForCausalLM"]}))
    assert not ctx.is_draft and not ctx.geometry_ok and ctx.modules == () and not ctx.nvfp4_weights


def test_rules_do_not_depend_on_their_order(tmp_path):
    """Each rule reads only the context: run backwards, the rules make the same findings and skipped checks."""
    checked = 0
    for i, case in enumerate(CASES):
        if case.code in READ_ERRORS or case.after_open:
            continue
        try:
            ctx = context(case.build(tmp_path / str(i)), case.target, case.deep)
        except CheckpointError:
            continue
        rules = [*CHECKPOINT_RULES, *(DRAFT_RULES if ctx.is_draft else ()), *VALUE_RULES]
        forward = [repr(result) for rule in rules for result in rule(ctx)]
        backward = [repr(result) for rule in reversed(rules) for result in rule(ctx)]
        assert sorted(forward) == sorted(backward), case.code
        assert any(case.code in line for line in forward), case.code
        checked += 1
    assert checked > 60

