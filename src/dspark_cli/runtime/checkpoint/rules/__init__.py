"""Validation rules for draft checkpoints: every way vLLM can fail to load (or silently mis-serve) a DSpark draft.

`validate_checkpoint(ckpt, target_config, deep)` reads only what `open_checkpoint` already parsed (config.json,
hf_quant_config.json, safetensors headers); `deep=True` additionally loads tensors one at a time.

How it is built: `build_context` computes every fact the rules share once (rules/context.py); each rule is a
function `(ctx) -> Results`, the findings and skipped checks it made, in order; one module per code family
(codes.py holds `CODES`, the single registry, and docs/validate.md documents each code):
  config_rules.py DSP0xx · vocab.py DSP1xx · tensors.py DSP2xx · quant.py DSP3xx (quant_config.py: how vLLM reads
  a quantization config) · files.py DSP4xx · deep.py DSP6xx · resolved.py the report's `resolved` values.
DSP5xx are read errors, raised as CheckpointError (exit 2) by checkpoint/read.py and by the context and deep rules.
"""

from __future__ import annotations

from typing import Callable

from dspark_cli.runtime.checkpoint.families import dflash2
from dspark_cli.runtime.checkpoint.read import Checkpoint
from dspark_cli.runtime.checkpoint.rules import config_rules, files, quant, tensors, vocab
from dspark_cli.runtime.checkpoint.rules.codes import (
    CODES,
    ERROR,
    INFO,
    READ_ERRORS,
    WARNING,
    Finding,
    Report,
    Results,
    SkippedCheck,
    sort_findings,
)
from dspark_cli.runtime.checkpoint.rules.context import RuleContext, build_context, read_target
from dspark_cli.runtime.checkpoint.rules.deep import tensor_values
from dspark_cli.runtime.checkpoint.rules.resolved import resolve

__all__ = ["CODES", "ERROR", "INFO", "READ_ERRORS", "WARNING", "Finding", "Report", "SkippedCheck",
           "validate_checkpoint"]

Rule = Callable[[RuleContext], Results]

# Run on every checkpoint, first.
CHECKPOINT_RULES: tuple[Rule, ...] = (
    files.pickle_files, files.duplicate_tensors, files.index_agreement, tensors.tensor_names,
    config_rules.draft_format,
)
# Run only on a DSpark or DFlash draft (`ctx.is_draft`), in this order (skipped checks are reported in run order).
DRAFT_RULES: tuple[Rule, ...] = (
    config_rules.geometry, config_rules.dspark_keys, config_rules.block_size, config_rules.mask_token,
    config_rules.target_layer_ids, config_rules.sliding_window, config_rules.logit_scale,
    config_rules.aux_hidden_state, config_rules.target_agreement, config_rules.confidence_flags,
    config_rules.family_rules,
    vocab.vocabulary,
    tensors.expected_tensors, dflash2.stray_selector_tensors,
    quant.quant_configs, quant.nvfp4_tensors, quant.fp8_tensors, quant.layer_claims, quant.marlin_head,
)
# Run on every checkpoint, last (it loads tensor data, and only with deep=True).
VALUE_RULES: tuple[Rule, ...] = (tensor_values,)


def validate_checkpoint(ckpt: Checkpoint, target_config: dict | None = None, deep: bool = False) -> Report:
    """Run every rule on an opened checkpoint; `target_config` is the target's config.json (vocab, width, depth)."""
    ctx = build_context(ckpt, read_target(target_config), deep)
    rules = (*CHECKPOINT_RULES, *(DRAFT_RULES if ctx.is_draft else ()), *VALUE_RULES)
    results = [result for rule in rules for result in rule(ctx)]
    return Report(
        source=ckpt.source,
        format=ctx.config.format,
        findings=sort_findings([r for r in results if isinstance(r, Finding)]),
        skipped=[r for r in results if isinstance(r, SkippedCheck)],
        resolved=resolve(ctx),
        deep=deep,
    )
