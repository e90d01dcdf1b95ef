"""The DFlash2 draft family: DFlash's Qwen3 backbone with a grouped dynamic convolution in every layer's attention
and MLP paths, and a low-rank top-K path selector in place of a Markov head (docs/formats-other.md §7).

Read from vLLM `vllm/model_executor/models/qwen3_dflash2.py` (commit 1b1712a0696365f1a2f728ccdf0db314d01e14ff) and
llama.cpp b11434 `src/models/dflash.cpp` (`load_arch_tensors`) and `conversion/qwen.py` (`DFlashModel`). Both read
the four DFlash2 keys from `dflash_config` only; both refuse a hidden size the group size does not divide; llama.cpp
also refuses a hidden size below top_k * (top_k + 1), the width of its packed lattice row.
"""

from __future__ import annotations

from typing import Any

from dspark_cli.runtime.checkpoint.families import Family, LayerTensor, qwen3
from dspark_cli.runtime.checkpoint.target_config import TargetConfig

ARCHITECTURE = "DFlash2DraftModel"
KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
CONV_PATHS = ("attention_conv", "mlp_conv")
SELECTOR = "candidate_selector"
SELECTOR_TENSORS = (f"{SELECTOR}.predecessor_codebook", f"{SELECTOR}.successor_codebook",
                    f"{SELECTOR}.hidden_projection.weight")
VLLM_FILE = "vllm/model_executor/models/qwen3_dflash2.py"
LLAMACPP_FILE = "llama.cpp b11434 src/models/dflash.cpp"


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _dflash_config(view: dict[str, Any]) -> dict[str, Any]:
    nested = view.get("dflash_config")
    return nested if isinstance(nested, dict) else {}


def resolve(view: dict[str, Any]) -> dict[str, Any]:
    """The four DFlash2 keys and vLLM's optional embedding scale, output multiplier and soft-cap, all from
    dflash_config (a missing or malformed key stays None: DSP060 reports it)."""
    dflash = _dflash_config(view)
    scale, multiplier = dflash.get("input_embedding_scale"), dflash.get("output_multiplier", 1.0)
    cap = dflash.get("final_logit_softcapping")
    return {
        **{key: _positive(dflash.get(key)) for key in KEYS},
        "embedding_scale": float(scale) if _number(scale) else None,
        "logit_scale": float(multiplier) if _number(multiplier) else 1.0,
        "final_logit_softcapping": float(cap) if _number(cap) and cap > 0 else None,
    }


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def groups(config) -> int | None:
    """G = hidden_size / conv_group_size (None when either is unknown or the division is not exact)."""
    H, g = config.hidden_size, config.conv_group_size
    return H // g if H and g and H % g == 0 else None


def layer_tensors(config) -> list[LayerTensor]:
    """Qwen3's layer tensors, then per path: base_kernel [2, K, H] and kernel_projection [2*K*G, H]."""
    H, K, G = config.hidden_size, config.conv_kernel_size, groups(config)
    out = qwen3.layer_tensors(config)
    for path in CONV_PATHS:
        out += [
            (f"{path}.base_kernel", (2, K, H), "[2, conv_kernel_size, hidden_size]"),
            (f"{path}.kernel_projection.weight", (2 * K * G if K and G else None, H),
             "[2*conv_kernel_size*(hidden_size/conv_group_size), hidden_size]"),
        ]
    return out


def model_tensors(config) -> list[LayerTensor]:
    """The selector: two codebooks over the target vocabulary [V, r] and the hidden projection [r, H]."""
    V, r, H = config.vocab_size, config.selector_rank, config.hidden_size
    return [
        (SELECTOR_TENSORS[0], (V, r), "[vocab_size, selector_rank]"),
        (SELECTOR_TENSORS[1], (V, r), "[vocab_size, selector_rank]"),
        (SELECTOR_TENSORS[2], (r, H), "[selector_rank, hidden_size]"),
    ]


# --- validate rules of the family (docs/validate.md, DSP060-DSP066, DSP211) --------------------------------------

def selector_keys(ctx):
    """DSP060 (a DFlash2 key missing or not a positive integer), DSP064 (found only at the top level)."""
    from dspark_cli.runtime.checkpoint.rules.codes import Results

    out, view = Results(), ctx.config.vllm_config
    dflash = _dflash_config(view)
    for key in KEYS:
        if _positive(dflash.get(key)) is not None:
            continue
        where = "is missing from dflash_config" if key not in dflash else f"is {dflash[key]!r} in dflash_config"
        out.add("DSP060", f"{key} {where}; vLLM's DFlash2 model reads int(dflash_config[{key!r}]) ({VLLM_FILE}) and "
                f"llama.cpp refuses to load the GGUF ('DFlash2 model is missing conv/selector metadata', "
                f"{LLAMACPP_FILE}).", f"Write {key} as a positive integer under dflash_config, the value the draft "
                "was trained with.")
        if key in view and key not in dflash:
            out.add("DSP064", f"{key} is at the top level of config.json only; neither vLLM nor llama.cpp's "
                    "converter reads it there.", f"Move {key} under dflash_config.")
    return out


def selector_geometry(ctx):
    """DSP061 (group size does not divide the hidden size), DSP062 (hidden size below top_k * (top_k + 1)),
    DSP063 (top_k larger than the vocabulary)."""
    from dspark_cli.runtime.checkpoint.rules.codes import Results

    out, config = Results(), ctx.config
    H, g, k, V = config.hidden_size, config.conv_group_size, config.selector_top_k, config.vocab_size
    if H and g and H % g:
        out.add("DSP061", f"hidden_size {H} is not divisible by conv_group_size {g}; vLLM's DFlashGroupedConv raises "
                "'conv_group_size=... must divide hidden_size=...' and llama.cpp refuses 'DFlash2 hidden size must be "
                "divisible by conv_group_size'.", "Use a conv_group_size that divides hidden_size (the trained value "
                "does; check the config against the checkpoint's kernel_projection shape).")
    if H and k and H < k * (k + 1):
        out.add("DSP062", f"hidden_size {H} is smaller than selector_top_k*(selector_top_k+1) = {k * (k + 1)}; "
                "llama.cpp packs each position's k candidate ids and k*k lattice scores into one hidden-size row and "
                "refuses 'DFlash2 hidden size is too small for the selector lattice' (vLLM has no such limit).",
                f"For llama.cpp, train with selector_top_k at most {_largest_top_k(H)}; vLLM serves it as is.")
    if k and V and k > V:
        out.add("DSP063", f"selector_top_k {k} exceeds vocab_size {V}; the candidates are the top-k of the draft's "
                "logits, which has no k-th entry (torch.topk fails at the first draft).",
                "Set selector_top_k to at most vocab_size.")
    return out


def _largest_top_k(hidden: int) -> int:
    k = 1
    while (k + 1) * (k + 2) <= hidden:
        k += 1
    return k


def selector_role(ctx):
    """DSP065: a DFlash2 draft with a Markov head, confidence head or reduced draft vocabulary, which neither engine's
    DFlash2 model builds (the selector is its sequential stage and its confidence)."""
    from dspark_cli.runtime.checkpoint.rules.codes import Results

    out, config = Results(), ctx.config
    extras = [what for what, present in (("markov_rank > 0", bool(config.markov_rank)),
                                         ("a confidence head", config.enable_confidence_head),
                                         ("a reduced draft vocabulary (draft_vocab_size / d2t)",
                                          config.reduced_vocab or "d2t" in ctx.tensors)) if present]
    if extras:
        out.add("DSP065", f"this DFlash2 draft declares {', '.join(extras)}; vLLM's DFlash2Qwen3ForCausalLM and "
                "llama.cpp's DFlash2 graph build neither a Markov nor a confidence head and index the selector's "
                "codebooks by target token ids, so they would not run the draft as configured.",
                "Remove those keys and tensors: the path selector plays the Markov head's role, and its top-1 "
                "score is the draft's confidence.")
    return out


def stray_selector_tensors(ctx):
    """DSP211 (runs on every draft): conv or selector tensors in a draft that is not DFlash2. llama.cpp keys its
    DFlash2 graph on the presence of selector_hidden.weight, so such a draft converts but refuses to load."""
    from dspark_cli.runtime.checkpoint.rules.codes import Results

    out = Results()
    if ctx.config.family == "dflash2":
        return out
    stray = sorted(n for n in ctx.tensors if n.startswith(f"{SELECTOR}.") or
                   any(f".{path}." in f".{n}" for path in CONV_PATHS))
    if stray:
        out.add("DSP211", f"{len(stray)} DFlash2 tensors (e.g. {stray[0]!r}) in a draft whose architectures "
                f"{ctx.config.architecture!r} is not {ARCHITECTURE}; vLLM has no parameter for them and llama.cpp "
                "takes the converted GGUF for a DFlash2 draft without its metadata ('DFlash2 model is missing "
                "conv/selector metadata').", f"Set architectures to [{ARCHITECTURE!r}] with the four dflash_config "
                "keys, or remove the tensors.")
    return out


# --- a new draft for a target (dspark train --draft-arch dflash2) ----------------------------------------------------

DEFAULTS = {"conv_kernel_size": 4, "conv_group_size": 16, "selector_rank": 64, "selector_top_k": 8}


def draft_config(target: TargetConfig, shape, target_layers: list[int], mask, anchors: int) -> dict[str, Any]:
    """The Qwen3 draft config (qwen3.draft_config) as a DFlash2 draft: architectures DFlash2DraftModel, the DFlash
    1+N query layout, no Markov or confidence head, the four DFlash2 keys under dflash_config. The selector's
    top-k is the largest of DEFAULTS' 8 that llama.cpp's lattice row holds (DSP062); the group size the largest
    divisor of the hidden size up to DEFAULTS' 16."""
    config = qwen3.draft_config(target, shape, target_layers, mask, anchors)
    hidden = config["hidden_size"]
    for key in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        config.pop(key, None)
    config.update(architectures=[ARCHITECTURE], sample_from_anchor=False, block_size=shape.block_size + 1)
    config["dflash_config"] = {
        "mask_token_id": mask.token_id,
        "target_layer_ids": list(target_layers),
        "block_size": shape.block_size + 1,
        "conv_kernel_size": DEFAULTS["conv_kernel_size"],
        "conv_group_size": max(g for g in range(1, DEFAULTS["conv_group_size"] + 1) if hidden % g == 0),
        "selector_rank": DEFAULTS["selector_rank"],
        "selector_top_k": min(DEFAULTS["selector_top_k"], _largest_top_k(hidden)),
    }
    return config


FAMILY = Family(
    name="dflash2",
    architectures=(ARCHITECTURE,),
    title="DFlash2",
    resolve=resolve,
    layer_tensors=layer_tensors,
    layer_linears=qwen3.layer_linears,
    vllm_shares_embeddings=True,
    draft_config=draft_config,
    rules=(selector_keys, selector_geometry, selector_role),
    model_tensors=model_tensors,
)
