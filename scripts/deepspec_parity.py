"""Parity of dspark's DSpark drafts with DeepSpec's own modules, in float32 on CPU (docs/format.md §6.4).

    python scripts/deepspec_parity.py --deepspec PATH [--json OUT]

PATH is a checkout of deepseek-ai/DeepSpec (nothing of it is copied here); its modules need the transformers
release DeepSpec pins (5.10.x), so run this in an environment that has it (dspark's draft code needs no
transformers). For each family (Qwen3, Gemma-4) and Markov head type (vanilla, gated, rnn) it builds a tiny
random DeepSpec draft (`Qwen3DSparkModel` / `Gemma4DSparkModel`), saves its state dict and config as DeepSpec
does, loads that folder with dspark's `load_draft`, and compares on the same context features and block:

  hidden      the block's final-norm hidden states (DeepSpec `_forward_backbone` vs dspark's cached context K/V
              and `block_hidden`)
  logits      base logits (DeepSpec `compute_logits`, soft-capped for Gemma-4)
  walk        the greedy walk: tokens equal, and the corrected logits (DeepSpec `sample_block_tokens`)
  q           at T = 0.8, dspark's q against DeepSpec's softmax(corrected / T) for the same sampled prefix
              (DeepSpec `apply_block_logits` teacher-forced with dspark's tokens)
  confidence  the confidence head's sigmoid (DeepSpec `predict_confidence_step`)
  (the row gemma4/v is a Gemma-4 draft with attention_k_eq_v false, i.e. with v_proj)
  control     a negative control: the same comparison with the family's or head's distinctive op removed from
              dspark (Gemma-4: no soft-cap; Qwen3: attention at scale 1; gated / rnn: the head run as vanilla),
              which must differ by far more than the tolerance

Prints max abs differences; exits 1 if any comparison exceeds TOLERANCE or a control stays under it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

TOLERANCE = 1e-4
HEADS = ("vanilla", "gated", "rnn")
DRAFT_FIELDS = dict(target_layer_ids=[0, 2], mask_token_id=3, num_anchors=8, enable_confidence_head=True,
                    confidence_head_with_markov=True, markov_rank=16, block_size=5, num_target_layers=4)


def deepspec_draft(family: str, head: str, seed: int, k_eq_v: bool = True):
    """A random DeepSpec draft module of `family` with a `head` Markov head (weights ~ N(0, 0.3), norms ~ 1);
    a Gemma-4 one with attention_k_eq_v (no v_proj) unless k_eq_v is False."""
    fields = {**DRAFT_FIELDS, "markov_head_type": head}
    if family == "gemma4":
        from deepspec.modeling.dspark.gemma4 import Gemma4DSparkModel
        from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

        config = Gemma4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                                  num_global_key_value_heads=1, attention_k_eq_v=k_eq_v, hidden_size_per_layer_input=0,
                                  final_logit_softcapping=30.0, layer_types=["full_attention"] * 2,
                                  max_position_embeddings=512)
        architecture, cls = "Gemma4DSparkModel", Gemma4DSparkModel
    else:
        from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
        from transformers import Qwen3Config

        config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                             layer_types=["full_attention"] * 2, rope_theta=1e6)
        architecture, cls = "Qwen3DSparkModel", Qwen3DSparkModel
    for key, value in fields.items():
        setattr(config, key, value)
    config.architectures = [architecture]
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm = "norm" in name
            param.copy_(torch.randn_like(param) * (0.1 if norm else 0.3) + (1.0 if norm else 0.0))
        if family == "gemma4":
            model.lm_head.weight.mul_(10.0)  # logits of tens: the soft-cap (30) is far from the identity
            for i, layer in enumerate(model.layers):
                layer.layer_scalar.fill_(0.6 + 0.2 * i)
    return model


def save_as_deepspec(model, folder: Path) -> None:
    """What DeepSpec's trainer writes: config.json (the draft config) and the module's state dict."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("_attn_implementation", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))


def deepspec_block(model, features, ids, temperature: float, forced_tokens=None):
    """DeepSpec's eval path for one block (draft_ops.forward_dspark_draft_block, build_dspark_proposal)."""
    from transformers import DynamicCache

    from deepspec.utils.sampling import logits_to_probs

    positions = torch.arange(features.shape[1] + ids.shape[1])[None]
    hidden = model._forward_backbone(target_hidden_states=features, noise_embedding=model.embed_tokens(ids),
                                     position_ids=positions, attention_mask=None, past_key_values=DynamicCache(),
                                     use_cache=True, is_causal=False)
    base = model.compute_logits(hidden)
    tokens, corrected = model.sample_draft_tokens(base, first_prev_token_ids=ids[:, 0], temperature=0.0,
                                                  hidden_states=hidden)
    prev = torch.cat([ids[:, :1], tokens[:, :-1]], dim=1)
    confidence = model.predict_confidence_step(hidden, prev_token_ids=prev).sigmoid()
    q = None
    if forced_tokens is not None:  # the same prefix dspark sampled, teacher-forced through the head
        forced_prev = torch.cat([ids[:, :1], forced_tokens[None, :-1]], dim=1)
        forced = model.markov_head.apply_block_logits(base[:, None], token_ids=forced_prev[:, None],
                                                      hidden_states=hidden[:, None])[:, 0]
        q = logits_to_probs(forced, temperature)
    return hidden[0], base[0], tokens[0], corrected[0], confidence[0], q


def dspark_block(draft, features, ids, temperature: float):
    """dspark's generate path: DraftContext, draft_backbone, markov_stage (dense strategy)."""
    from dspark_cli.runtime.decode.markov import markov_walk
    from dspark_cli.runtime.settings import SamplingParams
    from dspark_cli.runtime.decode.speculative import Drafter, draft_backbone, markov_stage
    from dspark_cli.runtime.model.draft import DraftContext

    context = DraftContext(draft, capacity=features.shape[1] + ids.shape[1])
    context.append(draft, features[0])
    anchor, n = int(ids[0, 0]), ids.shape[1]
    greedy = Drafter(draft, "dense", SamplingParams(), draft.config.vocab_size)
    hidden, base = draft_backbone(greedy, context, anchor, n)
    proposal = markov_stage(greedy, hidden, base, anchor, None)
    walk = markov_walk("dense", greedy.weights, base[None], torch.tensor([anchor]), SamplingParams(),
                       hidden=hidden[None])
    sampled = Drafter(draft, "dense", SamplingParams(temperature=temperature), draft.config.vocab_size)
    hot = markov_stage(sampled, hidden, base, anchor, torch.Generator().manual_seed(0))
    return hidden, base, proposal.tokens, walk.logits[0], proposal.confidences, hot


def control(broken, family: str, head: str):
    """A second copy of the draft with its family's or head's distinctive op removed (the negative control)."""
    if head != "vanilla":
        broken.markov_head.uses_hidden = False  # run the head as a vanilla one: u = W1[prev]
    elif family == "gemma4":
        broken.config.final_logit_softcapping = None
    else:
        for layer in broken.layers:
            layer.self_attn.forward = _unscaled_attention(layer.self_attn)
    return broken


def _unscaled_attention(attn):
    from dspark_cli.runtime.model.layers import apply_rope, block_attention, split_heads

    def forward(x, cos, sin, context, attn_mask):
        q = apply_rope(attn.q_norm(split_heads(attn.q_proj(x), attn.heads, attn.head_dim)), cos, sin)
        k, v = attn.key_value(x, cos, sin)
        return attn.o_proj(block_attention(q, k, v, context, attn_mask, scale=1.0))

    return forward


def compare(family: str, head: str, seed: int = 0, temperature: float = 0.8, k_eq_v: bool = True) -> dict:
    from dspark_cli.runtime.model.draft_io import load_draft

    model = deepspec_draft(family, head, seed, k_eq_v)
    gen = torch.Generator().manual_seed(seed + 1)
    features = torch.randn(1, 7, 2 * model.config.hidden_size, generator=gen)
    ids = torch.tensor([[11] + [model.config.mask_token_id] * (model.config.block_size - 1)])
    with tempfile.TemporaryDirectory() as tmp:
        save_as_deepspec(model, Path(tmp))
        draft = load_draft(tmp, dtype=torch.float32)
        broken = control(load_draft(tmp, dtype=torch.float32), family, head)
    with torch.no_grad():
        hidden, base, tokens, corrected, confidence, hot = dspark_block(draft, features, ids, temperature)
        ref = deepspec_block(model, features, ids, temperature, forced_tokens=hot.tokens)
        _, c_base, _, c_corrected, _, _ = dspark_block(broken, features, ids, temperature)
    diff = lambda a, b: float((a.float() - b.float()).abs().max())  # noqa: E731
    return {
        "family": family if k_eq_v else f"{family}/v", "head": head,
        "hidden": diff(hidden, ref[0]), "logits": diff(base, ref[1]),
        "tokens_equal": tokens.tolist() == ref[2].tolist(), "walk": diff(corrected, ref[3]),
        "confidence": diff(confidence, ref[4]), "q": diff(hot.draft_probs, ref[5][0]),
        "control": diff(c_corrected if head != "vanilla" else c_base,
                        ref[3] if head != "vanilla" else ref[1]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspec", required=True, help="path of a deepseek-ai/DeepSpec checkout")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.deepspec).resolve()))
    import transformers

    if not transformers.__version__.startswith("5.10"):
        print(f"note: DeepSpec pins transformers 5.10.x; this is {transformers.__version__}", file=sys.stderr)
    rows = [compare(family, head) for family in ("qwen3", "gemma4") for head in HEADS]
    rows.append(compare("gemma4", "vanilla", k_eq_v=False))  # a Gemma-4 draft with v_proj (attention_k_eq_v false)
    keys = ("hidden", "logits", "walk", "confidence", "q", "control")
    print(f"{'family':8} {'head':8} " + " ".join(f"{k:>11}" for k in keys) + "  tokens")
    failed = False
    for row in rows:
        print(f"{row['family']:8} {row['head']:8} " + " ".join(f"{row[k]:11.3e}" for k in keys)
              + f"  {'equal' if row['tokens_equal'] else 'DIFFER'}")
        failed |= any(row[k] > TOLERANCE for k in keys[:-1]) or not row["tokens_equal"]
        failed |= row["control"] <= TOLERANCE
    print(f"tolerance {TOLERANCE:g}: {'FAILED' if failed else 'all comparisons within it, every control far outside'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
