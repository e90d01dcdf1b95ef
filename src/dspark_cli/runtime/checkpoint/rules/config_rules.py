"""Config rules (DSP0xx): what config.json must say for vLLM to build the draft it was trained as.

Preconditions: `draft_format` runs on every checkpoint; the other rules run only on a draft (`ctx.is_draft`).
"""

from __future__ import annotations

from dspark_cli.runtime.checkpoint.config import GEOMETRY_KEYS, MASK_TOKEN_KEYS
from dspark_cli.runtime.checkpoint.formats import FORMAT_NAMES
from dspark_cli.runtime.checkpoint.families import FAMILIES
from dspark_cli.runtime.checkpoint.heads import HEAD_TYPES
from dspark_cli.runtime.checkpoint.rules.codes import Results
from dspark_cli.runtime.checkpoint.rules.context import MAX_DRAFT_LAYERS, RuleContext, bad_geometry_keys, too_many_layers
from dspark_cli.runtime.checkpoint.rules.values import as_dict, lookup, nonneg_int, positive_int


def draft_format(ctx: RuleContext) -> Results:
    """DSP001 for a checkpoint that is not a draft these rules apply to (`ctx.is_draft`); DSP002/DSP003 notes."""
    out = Results()
    fmt, archs = ctx.config.format, ctx.ckpt.config.get("architectures")
    if fmt == "unknown":
        out.add("DSP001", f"config.json architectures {archs!r} is not a DSpark or DFlash draft.",
                "Pass the draft checkpoint (architectures Qwen3DSparkModel or DFlashDraftModel), not the target.")
    elif fmt == "deepseek-v4":
        out.add("DSP001", f"config.json describes a DeepSeek-V4 DSpark drafter ({archs!r}, model_type "
                f"{ctx.ckpt.config.get('model_type')!r}), which dspark does not validate.",
                "dspark validates Qwen3-style DSpark and DFlash drafts; DeepSeek-V4 ships its drafter inside "
                "the target checkpoint.")
    else:
        if ctx.config.kind == "dflash":
            out.add("DSP002", f"this is a DFlash draft ({FORMAT_NAMES[fmt]}) without a Markov head, so the "
                    "Markov and confidence rules are off.",
                    "Serve it with method 'dflash' and num_speculative_tokens = block_size - 1.")
            out.skip("DSP011, DSP012, DSP021-DSP023", "a DFlash draft has no Markov or confidence head")
        if fmt == "other-dspark":
            out.add("DSP003", f"{ctx.config.architecture} is a DSpark draft of another model family; it is "
                    "checked with the Qwen3 rules, which may not fit it.", "Treat findings about tensor "
                    "names and shapes with care; the config rules still apply.")
        return out
    out.skip("DSP002-DSP314", "the checkpoint is not a DSpark or DFlash draft (DSP001)")
    return out


def family_rules(ctx: RuleContext) -> Results:
    """The rules of the draft's family (checkpoint/families/; Gemma-4: DSP040-DSP047), in their listed order."""
    out = Results()
    for rule in FAMILIES[ctx.config.family].rules:
        out += rule(ctx)
    return out


def geometry(ctx: RuleContext) -> Results:
    """DSP010 per bad geometry key (`ctx.geometry_ok` is False exactly when this finds one, or head_dim is unknown)."""
    out, config = Results(), ctx.config
    view = config.vllm_config
    for key in bad_geometry_keys(config):
        value = view.get(key)
        what = "is missing" if value is None else f"is {value!r}"
        nested = config.format.startswith("speculators") and key in GEOMETRY_KEYS
        where = f"transformer_layer_config.{key}" if nested else key
        out.add("DSP010", f"config.json key {where!r} {what}; it must be a positive integer.",
                "Copy it from the config the draft was trained with (DeepSpec copies the target's).")
    if too_many_layers(config):
        out.add("DSP010", f"config.json key 'num_hidden_layers' is {config.num_hidden_layers}, more than the "
                f"{MAX_DRAFT_LAYERS} draft layers dspark checks (DeepSpec drafts have 5).",
                "Set it to the number of draft layers.")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads and kv and heads % kv:
        out.add("DSP026", f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}.",
                "Fix the head counts; grouped-query attention needs each key/value head to serve whole groups.")
    return out


def dspark_keys(ctx: RuleContext) -> Results:
    """The Markov-head keys of a DSpark draft, where vLLM reads them."""
    out, config, view = Results(), ctx.config, ctx.config.vllm_config
    if config.kind != "dspark":
        return out
    if "markov_rank" in config.nested_only:
        out.add("DSP004", "markov_rank is only under dflash_config (SpecForge layout); vLLM reads it from the "
                "top level unconditionally and fails.", "Hoist markov_rank, markov_head_type, "
                "enable_confidence_head and confidence_head_with_markov to the top level and set "
                "architectures to ['Qwen3DSparkModel'] (SpecForge's normalize_dflash_export does this).")
    for key in config.nested_only:
        if key != "markov_rank":
            out.add("DSP005", f"{key} is only under dflash_config (SpecForge layout); vLLM reads it from the "
                    "top level and uses its default instead.", f"Copy dflash_config.{key} to the top level.")
    if config.format == "speculators-dspark" and config.sample_from_anchor:
        out.add("DSP006", "this speculators DSpark head uses sample_from_anchor; vLLM releases before PR "
                "#48639 (e.g. 0.26) hard-code the bonus-anchor layout and serve it one slot off, silently.",
                "Serve it with a vLLM that includes PR #48639, or convert it to DeepSpec's format.")
    rank = view.get("markov_rank")
    if rank == 0 and type(rank) is int:
        out.add("DSP007", "markov_rank is 0: this is DeepSpec's DFlash ablation (the DSpark layout without a "
                "Markov head), as `dspark train` writes it with the markov-rank option 0; dspark generate runs it, but vLLM's "
                "dspark method always builds a Markov head of markov_rank and is not known to serve rank 0.",
                "Use it for comparisons and with dspark generate; to serve with vLLM, train a Markov head "
                "(markov_rank > 0).")
        out.skip("DSP011", "markov_rank is 0: there is no Markov head")
    elif "markov_rank" not in config.nested_only and not positive_int(rank):
        what = "is missing" if rank is None else f"is {rank!r}"
        out.add("DSP011", f"config.json key 'markov_rank' {what}; vLLM reads it unconditionally and needs a "
                "positive integer.", "Set markov_rank to the rank of markov_head.markov_w1/markov_w2 (e.g. 256).")
    if config.markov_head_type not in (None, "vanilla"):  # which engines refuse it: engines/ (own_codes)
        known = config.markov_head_type in HEAD_TYPES
        out.add("DSP012", f"markov_head_type is {config.markov_head_type!r}; vLLM implements only 'vanilla' "
                "(first-order) Markov heads: its DSparkMarkovHead (vllm/model_executor/models/qwen3_dspark.py, also "
                "used by gemma4_dspark.py) has only markov_w1 and markov_w2, so it cannot load "
                + ("this head's projections" if known else "this head") + ".",
                ("dspark generate, eval and bench run it (DeepSpec's sample_block_tokens semantics); to serve with "
                 "vLLM, retrain with markov_head_type 'vanilla'." if known else
                 f"Use one of {', '.join(HEAD_TYPES)} (DeepSpec's head types); vLLM serves only 'vanilla'."))
    if not config.sample_from_anchor:
        out.add("DSP030", "the draft uses the 1+N query layout (sample_from_anchor false / dspark_bonus_anchor "
                "true): mask slot j predicts the token at its own position.", "Make sure it was trained that "
                "way; serving a checkpoint in the wrong layout shifts every proposal by one position.")
    out += anchor_keys(ctx)
    topk = view.get("dspark_draft_topk")
    vd = config.draft_vocab_size
    if topk is not None and not (positive_int(topk) and (vd is None or topk <= vd)):
        out.add("DSP027", f"dspark_draft_topk is {topk!r}; vLLM needs 1 <= k <= draft_vocab_size ({vd}).",
                "Set it inside that range or remove it.")
    return out


def anchor_keys(ctx: RuleContext) -> Results:
    """vLLM's DSpark speculator picks its layout from dspark_bonus_anchor alone (default False: N queries)."""
    out, config = Results(), ctx.config
    if config.vllm_bonus_anchor == (not config.sample_from_anchor):
        return out
    bonus = config.vllm_config.get("dspark_bonus_anchor")
    served, trained = ("1+N", "N") if config.vllm_bonus_anchor else ("N", "1+N")
    out.add("DSP033", f"the draft was trained in the {trained} query layout but dspark_bonus_anchor is "
            f"{'missing' if bonus is None else repr(bonus)}; vLLM's DSpark speculator reads only "
            f"dspark_bonus_anchor, so it serves the {served} layout and every proposal lands one slot off.",
            f"Set dspark_bonus_anchor to {str(not config.sample_from_anchor).lower()} and sample_from_anchor to "
            f"{str(config.sample_from_anchor).lower()} (write both keys).")
    return out


def block_size(ctx: RuleContext) -> Results:
    out, view, block = Results(), ctx.config.vllm_config, ctx.config.block_size
    if block.source is None:
        out.add("DSP014", "config.json has no block_size; the trained block length is unknown.",
                "Add block_size (DeepSpec's Qwen3 drafts use 7) and pass the same num_speculative_tokens to vLLM.")
    elif not positive_int(block.value):
        out.add("DSP013", f"{block.source} is {lookup(view, block.source)!r}; it must be a positive integer.",
                "Set it to the block length the draft was trained with.")
    return out


def mask_token(ctx: RuleContext) -> Results:
    out, mask = Results(), ctx.config.mask_token
    if mask.source is not None and mask.value is None:
        out.add("DSP015", f"{mask.source} is null; vLLM's DFlash/DSpark model reads that key first (a null "
                "counts as set) and has no mask token for parallel drafting.",
                f"Set {mask.source} to the mask token id, or remove the key.")
        return out
    if mask.source is None:
        out.add("DSP015", "config.json names no mask token; vLLM fails because the model config must specify "
                f"one of dflash_config.mask_token_id, {', '.join(MASK_TOKEN_KEYS)} for parallel drafting.",
                "Add mask_token_id (DeepSpec's Qwen3 drafts use 151669).")
        return out
    # The mask row comes from the draft's own embed_tokens [V, H] when shipped, else from the target's [T, H].
    vocab, target_vocab = ctx.config.vocab_size, ctx.target.vocab_size if ctx.target else None
    bounds = [v for v in (vocab, None if ctx.has_embed else target_vocab) if v]
    if not nonneg_int(mask.value) or any(mask.value >= v for v in bounds):
        raw = lookup(ctx.config.vllm_config, mask.source)
        limit = min(bounds) if bounds else "vocab_size"
        out.add("DSP016", f"{mask.source} is {raw!r}; it must be a token id in [0, {limit}).",
                "Use the id of the tokenizer's mask/pad token that the draft was trained with.")
    return out


def target_layer_ids(ctx: RuleContext) -> Results:
    out, ids = Results(), ctx.config.target_layer_ids
    if ids.value is None or not ids.value:
        raw = lookup(ctx.config.vllm_config, ids.source) if ids.source else None
        what = "is missing" if ids.source is None else f"{ids.source} is {raw!r}"
        out.add("DSP017", f"target_layer_ids {what}; it must be a non-empty list of target layer indices.",
                "Add target_layer_ids (0-based target layers whose outputs feed fc; DeepSpec Qwen3: "
                "[1, 9, 17, 25, 33]).")
        return out
    values = ids.value
    if any(b <= a for a, b in zip(values, values[1:])):
        out.add("DSP018", f"target layer ids {values} (from {ids.source}) are not strictly increasing; vLLM "
                "concatenates the captured features in ascending order.", "Sort them (and the matching fc "
                "input blocks) or retrain.")
    depth, source = ctx.target_depth
    if depth is None:
        out.skip("DSP019", "the target's depth is unknown: pass the target option (or set num_target_layers)")
        return out
    outside = [v for v in values if not -1 <= v < depth]
    if outside:
        out.add("DSP019", f"target layer ids {outside} (from {ids.source}) are outside the target's "
                f"{depth} layers (valid: -1 .. {depth - 1}; depth from {source}).",
                "Use ids of layers the target has; -1 means the embedding output.")
    elif depth - 1 in values:
        out.add("DSP034", f"target layer id {depth - 1} (from {ids.source}) is the target's last decoder layer "
                f"(depth from {source}): vLLM captures a layer's output at the input of the next layer, so it "
                "never captures this one and fails with 'DFlash drafter expects ... concatenated aux hidden "
                "features', and DeepSpec refuses it (HF's hidden_states[-1] is the final norm's output).",
                "Retrain with earlier target layers (DeepSpec Qwen3 drafts use [1, 9, 17, 25, 33] of 36).")
    return out


def sliding_window(ctx: RuleContext) -> Results:
    out, view = Results(), ctx.config.vllm_config
    types = view.get("layer_types")
    if isinstance(types, list) and "sliding_attention" in types:
        dflash = as_dict(view.get("dflash_config"))
        if not (dflash.get("swa_window_size") or view.get("sliding_window")):
            out.add("DSP028", "layer_types has sliding_attention layers but no window size; vLLM raises "
                    "'DFlash sliding attention requires a window size configured in "
                    "dflash_config.swa_window_size or the top-level sliding_window'.",
                    "Set sliding_window (or dflash_config.swa_window_size), or make every layer full_attention.")
    use_swa = as_dict(view.get("dflash_config")).get("use_swa")
    has_window = bool(as_dict(view.get("dflash_config")).get("swa_window_size") or view.get("sliding_window"))
    sliding = (isinstance(types, list) and "sliding_attention" in types) or use_swa
    if view.get("use_sliding_window") and not sliding:
        out.add("DSP048", f"use_sliding_window is true (window {view.get('sliding_window')!r}) but no layer is "
                "sliding_attention in layer_types; vLLM and llama.cpp take the sliding layers from layer_types (or "
                "dflash_config.use_swa) only, so every layer runs dense, not as the draft was trained.",
                "Mark the windowed layers sliding_attention in layer_types, or remove use_sliding_window if the draft "
                "was trained dense.")
    elif sliding and has_window and not use_swa and not view.get("use_sliding_window"):
        out.add("DSP049", "layer_types has sliding_attention layers and use_sliding_window is not true; llama.cpp's "
                "own converter (conversion/qwen.py) writes a window only with that key, so a GGUF it makes runs "
                "every layer dense.", "Convert with dspark convert, which writes the window from layer_types, or set "
                "use_sliding_window to true before converting with llama.cpp's script.")
    return out


def logit_scale(ctx: RuleContext) -> Results:
    out = Results()
    raw = ctx.config.vllm_config.get("logit_scale", 1.0)
    number = isinstance(raw, (int, float)) and not isinstance(raw, bool)
    if not (number and 0 < raw < float("inf")):
        out.add("DSP032", f"logit_scale is {raw!r}; vLLM multiplies the draft logits by it as is (a number <= 0 "
                "flattens or inverts every proposal, anything else fails at the first draft step).",
                "Remove logit_scale (default 1.0) unless the draft was trained with another positive scale.")
    return out


def aux_hidden_state(ctx: RuleContext) -> Results:
    out = Results()
    if not ctx.config.use_aux_hidden_state:
        out.add("DSP029", "use_aux_hidden_state is false: vLLM builds no fc, drops fc.* and uses only the "
                "target's last hidden state as context.", "Remove the key unless the draft was trained that way.")
    return out


def target_agreement(ctx: RuleContext) -> Results:
    out, config, target = Results(), ctx.config, ctx.target
    if target is None:
        out.skip("DSP024, DSP025, DSP031", "they compare the draft with the target: pass the target option")
        return out
    width = config.target_hidden_size
    if width and width != target.hidden_size:
        key = "target_hidden_size" if "target_hidden_size" in config.vllm_config else "hidden_size"
        out.add("DSP024", f"the draft expects target features of width {width} ({key}) but the target's "
                f"hidden_size is {target.hidden_size}; vLLM fails with 'DFlash drafter expects ... "
                "concatenated aux hidden features'.", "Use the target this draft was trained for, or set "
                "target_hidden_size to the target's hidden_size if that is what fc was trained on.")
    if config.vocab_size and config.vocab_size < target.vocab_size:
        out.add("DSP025", f"vocab_size {config.vocab_size} is smaller than the target vocabulary "
                f"{target.vocab_size}; markov_w1 (and embed_tokens) are indexed by target token ids, so a "
                "target token beyond it is out of range.", "Use a draft built for this target's vocabulary.")
    declared = config.num_target_layers
    if declared and declared != target.num_hidden_layers:
        out.add("DSP031", f"num_target_layers is {declared} but the target has {target.num_hidden_layers} "
                "layers; the draft was probably trained for another target.", "Check that the target option names the "
                "model the draft was distilled from.")
    return out


def confidence_flags(ctx: RuleContext) -> Results:
    out, config = Results(), ctx.config
    if config.kind != "dspark":
        return out
    has_weights = any(name.startswith("confidence_head.") for name in ctx.tensors)
    if config.enable_confidence_head and not has_weights:
        out.add("DSP021", "enable_confidence_head is true but there are no confidence_head.* tensors; vLLM "
                "silently removes the head (older versions fail with adaptive_verification).",
                "Ship confidence_head.proj.weight/bias, or set enable_confidence_head to false.")
    if has_weights and not config.enable_confidence_head:
        out.add("DSP022", "confidence_head.* tensors are present but enable_confidence_head is not true; vLLM "
                "does not build the head, so the weights are unused.",
                "Set enable_confidence_head to true to use them (and confidence_head_with_markov to match).")
    if has_weights and config.has_markov and "confidence_head_with_markov" not in config.vllm_config and (
        "confidence_head_with_markov" not in config.nested_only
    ):
        out.add("DSP023", "confidence_head_with_markov is missing; vLLM's default changed (True in older "
                "versions, False in newer), so the head's input width depends on the vLLM version.",
                "Write confidence_head_with_markov explicitly (true when the proj weight has "
                "hidden_size + markov_rank columns).")
    return out
