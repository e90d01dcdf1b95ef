"""vLLM load errors of the vocabulary (DSP1xx, and DSP020): draft, input and target vocabularies against the
embed_tokens, lm_head and d2t tensors the draft ships. Precondition: a draft (`ctx.is_draft`).
"""

from __future__ import annotations

from dspark_cli.runtime.checkpoint.families import FAMILIES
from dspark_cli.runtime.checkpoint.rules.codes import Results
from dspark_cli.runtime.checkpoint.rules.context import RuleContext
from dspark_cli.runtime.checkpoint.rules.values import positive_int


def vocabulary(ctx: RuleContext) -> Results:
    """Vocabulary sizes against the embed_tokens / lm_head / d2t the draft ships (T: the target vocabulary)."""
    out, config, T = Results(), ctx.config, ctx.target_vocab
    family = FAMILIES[config.family]
    if not family.vllm_shares_embeddings:
        out.skip("DSP020, DSP100-DSP106", f"a {family.title} draft: vLLM shares nothing from the target and has no "
                 "draft vocabulary (see DSP040, DSP042)")
        return out
    V, vd = config.vocab_size, config.draft_vocab_size
    if not (positive_int(V) and positive_int(vd)):
        out.skip("DSP020, DSP100-DSP106", "vocab_size or draft_vocab_size is invalid (see DSP010)")
        return out
    if ctx.target is None:
        out.add("DSP100", f"without the target option, the target vocabulary is assumed to be vocab_size ({V}) for DSP020, "
                "DSP102, DSP103 and DSP106.", "Pass the target option to check against the real target vocabulary.")
        out.skip("DSP101", "it needs the target vocabulary: pass the target option")
    has_embed, has_lm_head, has_d2t = ctx.has_embed, ctx.has_lm_head, "d2t" in ctx.tensors
    if ctx.target and V > T and not has_embed:
        out.add("DSP101", f"vocab_size {V} is larger than the target vocabulary {T} and there is no "
                "embed_tokens.weight; vLLM fails with: 'Qwen3 DSpark checkpoints whose input vocab_size is "
                "larger than the target vocabulary must include embed_tokens weights.'",
                "Ship embed_tokens.weight [vocab_size, hidden_size] with the draft.")
    if vd > T:
        out.add("DSP020", f"draft_vocab_size {vd} is larger than the target vocabulary {T}"
                + ("" if ctx.target else " (assumed = vocab_size)") + "; vLLM maps draft ids to target ids "
                "unchanged, so a proposal >= the target vocabulary can never be accepted.",
                "Fine for a draft padded to the target's embedding rows; otherwise set draft_vocab_size <= the "
                "target's vocab_size.")
    if vd != T and not has_lm_head:
        why = ("vLLM fails with: 'Reduced-vocabulary Qwen3 DSpark checkpoints must include lm_head weights; the "
               "full target lm_head cannot be shared.'" if vd < T else "vLLM then shares the target's lm_head, "
               f"whose {T} logits do not line up with the {vd} of markov_w2 / d2t.")
        out.add("DSP102", f"the draft vocabulary ({vd}) differs from the target's ({T}) and there is no "
                f"lm_head.weight; {why}", "Ship lm_head.weight [draft_vocab_size, hidden_size].")
    if vd < T and not has_d2t:
        out.add("DSP103", f"the draft vocabulary ({vd}) is smaller than the target's ({T}) and there is no d2t; "
                "vLLM fails with: 'Reduced-vocabulary Qwen3 DSpark checkpoints must include a d2t mapping so "
                "sampled draft ids can be converted to target ids.'",
                "Ship d2t (int64 [draft_vocab_size], target_id = draft_id + d2t[draft_id]).")
    if not has_embed and V <= T:
        mask = config.mask_token_id
        out.add("DSP104", "there is no embed_tokens.weight: vLLM shares the target's embedding"
                + (f", so the mask token's embedding is the target's row {mask}." if mask is not None else "."),
                "Nothing to do if the draft was trained with the target's frozen embedding (DeepSpec does).")
    if not has_lm_head and vd == T:
        out.add("DSP105", "there is no lm_head.weight: vLLM shares the target's lm_head.",
                "Nothing to do if the draft was trained with the target's frozen lm_head (DeepSpec does).")
    if has_d2t and vd >= T:
        out.add("DSP106", f"d2t is shipped but draft_vocab_size ({vd}) is not smaller than the target vocabulary "
                f"({T}); vLLM allocates draft_id_to_target_id only for a reduced vocabulary, so its weight "
                "loader fails with 'There is no module or parameter named draft_id_to_target_id'.",
                "Drop d2t, or set draft_vocab_size to the reduced vocabulary it maps.")
    return out
