"""GGUF rules (DSP8xx): can llama.cpp b11434 load this `dflash` draft GGUF and run it as it was trained.

What llama.cpp reads was taken from its source at b11434 (ggml-org/llama.cpp, tag b11434):
- src/models/dflash.cpp, load_arch_hparams: `dflash.target_layers` required (else "DFlash model requires
  'target_layers'"), `dflash.attention.layer_norm_rms_epsilon` required, `dflash.attention.sliding_window` optional
  (0 or absent: every layer dense) with `dflash.attention.sliding_window_pattern` then required (one bool per layer);
  load_arch_tensors: the tensors and shapes `REQUIRED` lists, `markov_w1` [rank, n_vocab] selecting the DSpark path,
  `markov_w2` [rank, n_vocab_draft], `conf_proj` [n_embd + rank, 1]; the graph reads `dflash.sample_from_anchor`
  as true when absent.
- src/llama-model.cpp, llama_model_base::load_hparams: `context_length`, `embedding_length`, `block_count` required.
- common/speculative.cpp, common_speculative_impl_draft_dflash: `dflash.block_size` read with a default of 16
  (a DFlash draft without it is run at block 16 whatever it was trained at; a DSpark draft's Markov head, in
  src/models/dflash.cpp, asserts the key and llama-server aborts), `dflash.attention.causal` (the whole draft
  causal when "true", non-causal when absent), the mask token from
  `tokenizer.ggml.mask_token_id`, the target layers' inputs extracted with llama_set_embeddings_layer_inp, which
  asserts `id <= n_layer` of the target (src/llama-context.cpp).
`validate_gguf` runs them on a draft GGUF and, given one, its target (a GGUF or a model folder).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dspark_cli.runtime.checkpoint.gguf_read import (
    FLOAT_TYPES,
    LAYER_IDS_KEY,
    GgufFile,
    deepspec_layer_ids,
    is_gguf,
    read_gguf,
)
from dspark_cli.runtime.checkpoint.read import read_json, read_target_config
from dspark_cli.runtime.checkpoint.rules.codes import Finding, Report, Results, SkippedCheck, sort_findings
from dspark_cli.runtime.checkpoint.rules.context import MAX_DRAFT_LAYERS
from dspark_cli.runtime.checkpoint.rules.values import as_dict, positive_int
from dspark_cli.runtime.checkpoint.target_config import TargetConfig

ARCH = "dflash"
REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                 "target_layers")
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                 "ffn_gate", "ffn_down", "ffn_up")
NORMS = ("enc.output_norm.weight", "output_norm.weight")  # plus blk.N.*_norm.weight
CONVERT = "re-convert the draft folder to GGUF with dspark convert"
CONVERT_FIX = "Re-convert the draft folder to GGUF with dspark convert."


@dataclass(frozen=True)
class GgufTarget:
    """The facts of the target a draft GGUF is checked against, from its GGUF or its folder."""

    source: str
    vocab_size: int | None
    hidden_size: int | None
    depth: int | None
    tokens: dict[int, str]  # id -> token text, the ids the target's tokenizer names


@dataclass(frozen=True)
class GgufDraft:
    """A draft GGUF as the rules see it."""

    file: GgufFile
    target: GgufTarget | None
    deep: bool

    @property
    def vocab(self) -> list:
        tokens = self.file.keys.get("tokenizer.ggml.tokens")
        return tokens if isinstance(tokens, list) else []

    @property
    def markov_rank(self) -> int | None:
        w1 = self.file.tensors.get("markov_w1.weight")
        return w1.shape[0] if w1 is not None else None

    @property
    def layer_ids(self) -> list[int] | None:
        """dflash.target_layers as DeepSpec's ids; None when absent or not a list of integers."""
        raw = self.file.key("target_layers")
        ok = isinstance(raw, list) and raw and all(isinstance(k, int) and not isinstance(k, bool) for k in raw)
        return deepspec_layer_ids(raw) if ok else None


def validate_gguf(path: str, target: str | None = None, deep: bool = False) -> Report:
    """Every GGUF rule on a draft GGUF; `target` a target GGUF or folder (its vocabulary, width, depth)."""
    draft = GgufDraft(read_gguf(path), read_gguf_target(target) if target else None, deep)
    rules = (architecture,) if draft.file.architecture != ARCH else GGUF_RULES
    results = [result for rule in rules for result in rule(draft)]
    return Report(source=str(path), format="gguf-dflash",
                  findings=sort_findings([r for r in results if isinstance(r, Finding)]),
                  skipped=[r for r in results if isinstance(r, SkippedCheck)], resolved=resolved(draft), deep=deep)


def read_gguf_target(source: str) -> GgufTarget:
    if is_gguf(source):
        file = read_gguf(source)
        tokens = file.keys.get("tokenizer.ggml.tokens")
        tokens = tokens if isinstance(tokens, list) else []
        return GgufTarget(source, len(tokens) or None, _int(file.key("embedding_length")),
                          _int(file.key("block_count")), dict(enumerate(tokens)))
    config = TargetConfig.from_dict(read_target_config(source))
    return GgufTarget(source, config.vocab_size, config.hidden_size, config.num_hidden_layers, _folder_tokens(source))


def _folder_tokens(source: str) -> dict[int, str]:
    """tokenizer.json's tokens by id (the model's vocabulary and its added tokens); empty without the file."""
    path = Path(source).expanduser() / "tokenizer.json"
    if not path.is_file():
        return {}
    tokenizer = as_dict(read_json(path, "target tokenizer.json"))
    vocab = as_dict(as_dict(tokenizer.get("model")).get("vocab"))
    tokens = {index: token for token, index in vocab.items() if isinstance(index, int)}
    added = tokenizer.get("added_tokens") if isinstance(tokenizer.get("added_tokens"), list) else []
    tokens.update({t["id"]: t["content"] for t in map(as_dict, added) if isinstance(t.get("id"), int)
                   and isinstance(t.get("content"), str)})
    return tokens


def architecture(draft: GgufDraft) -> Results:
    out = Results()
    out.add("DSP802", f"general.architecture is {draft.file.architecture!r}; llama.cpp runs a DSpark or DFlash "
            "draft only as a 'dflash' model.", "Pass the draft's GGUF, not the target's, or " + CONVERT + ".")
    out.skip("DSP803-DSP814", "the file is not a dflash GGUF (DSP802)")
    return out


def required_keys(draft: GgufDraft) -> Results:
    out = Results()
    for key in REQUIRED_KEYS:
        if draft.file.key(key) is None:
            out.add("DSP803", f"the GGUF has no {ARCH}.{key}, which llama.cpp requires to load a dflash draft.",
                    CONVERT_FIX)
    layers = draft.file.key("block_count")
    if positive_int(layers) and layers > MAX_DRAFT_LAYERS:
        out.add("DSP803", f"{ARCH}.block_count is {layers}, not a draft's layer count (at most {MAX_DRAFT_LAYERS}).",
                CONVERT_FIX)
    return out


def required_tensors(draft: GgufDraft) -> Results:
    """DSP804: a tensor llama.cpp's load_arch_tensors requires that is missing or has another shape."""
    out, file = Results(), draft.file
    n_embd, layers = _int(file.key("embedding_length")), _int(file.key("block_count"))
    ids = draft.layer_ids
    expected: dict[str, tuple[int, ...] | None] = {"fc.weight": (len(ids) * n_embd, n_embd) if ids and n_embd else None,
                                                   **{name: (n_embd,) for name in NORMS}}
    for index in range(layers if layers and layers <= MAX_DRAFT_LAYERS else 0):
        expected.update({f"blk.{index}.{name}.weight": None for name in LAYER_TENSORS})
    rank = draft.markov_rank
    if rank is not None:
        expected["markov_w2.weight"] = None
        if "conf_proj.weight" in file.tensors and n_embd:
            expected["conf_proj.weight"] = (n_embd + rank, 1)
    for name, shape in expected.items():
        tensor = file.tensors.get(name)
        if tensor is None:
            out.add("DSP804", f"the GGUF has no tensor {name}, which llama.cpp's dflash model requires.",
                    CONVERT_FIX)
        elif shape is not None and tensor.shape != shape:
            out.add("DSP804", f"tensor {name} is {list(tensor.shape)} (ggml order); llama.cpp's dflash model needs "
                    f"{list(shape)}.", _shape_fix(name))
    return out


def block_size(draft: GgufDraft) -> Results:
    out, value = Results(), draft.file.key("block_size")
    if value is None:
        effect = ("llama-server aborts on the first draft (a DSpark draft's Markov head asserts the key)"
                  if draft.markov_rank is not None else "llama.cpp then drafts blocks of 16 whatever block the draft "
                  "was trained at, so most drafted tokens are rejected")
        out.add("DSP805", f"the GGUF has no {ARCH}.block_size; {effect}.",
                f"Re-convert with dspark convert, which writes {ARCH}.block_size from the config's block_size.")
    elif not positive_int(value):
        out.add("DSP805", f"{ARCH}.block_size is {value!r}; it must be the positive block length the draft was "
                "trained at.", "Re-convert from a config whose block_size is right.")
    return out


def target_layers(draft: GgufDraft) -> Results:
    """DSP806 malformed or +1 missing, DSP807 beyond the target, DSP808 against dspark's record of the ids."""
    out, raw, ids = Results(), draft.file.key("target_layers"), draft.layer_ids
    if raw is None:
        return out  # DSP803
    if ids is None or any(i < 0 for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
        out.add("DSP806", f"{ARCH}.target_layers is {raw!r}; llama.cpp reads the input of each listed target layer, "
                "so the ids must be increasing and at least 1 (DeepSpec's layer id plus one; an id 0 feeds the "
                "token embeddings, the mark of ids written without the +1).",
                "Write DeepSpec's target_layer_ids plus one, as dspark convert does.")
        return out
    recorded = draft.file.keys.get(LAYER_IDS_KEY)
    if isinstance(recorded, list) and recorded != ids:
        out.add("DSP808", f"{ARCH}.target_layers {raw} are not the converted folder's target_layer_ids {recorded} "
                "plus one, so the draft reads other target layers than it was trained on.",
                "Write DeepSpec's target_layer_ids plus one, as dspark convert does.")
    target = draft.target
    if target is None or target.depth is None:
        return out
    beyond = [i + 1 for i in ids if i + 1 > target.depth]
    if beyond:
        out.add("DSP807", f"{ARCH}.target_layers {raw} name layer inputs {beyond} beyond the target's "
                f"{target.depth} layers; llama-server aborts on them (llama_set_embeddings_layer_inp asserts "
                "id <= n_layer).", "Convert the draft trained for this target, or pass the target it was trained for.")
    n_embd = _int(draft.file.key("embedding_length"))
    if target.hidden_size and n_embd and target.hidden_size != n_embd:
        out.add("DSP807", f"the draft is {n_embd} wide and the target {target.hidden_size}; llama.cpp feeds the "
                f"draft's fc {len(ids)} target layers of the draft's width.",
                "Pass the target the draft was trained for.")
    return out


def sample_from_anchor(draft: GgufDraft) -> Results:
    out, value = Results(), draft.file.key("sample_from_anchor")
    dflash2 = "selector_hidden.weight" in draft.file.tensors  # DFlash2: its selector, no anchor layout to state
    if value is None and not dflash2:
        out.add("DSP809", f"the GGUF has no {ARCH}.sample_from_anchor; llama.cpp then assumes true (the anchor-first "
                "layout), wrong for a draft trained in the 1+N (bonus-anchor) layout.",
                f"Re-convert with dspark convert, which writes {ARCH}.sample_from_anchor from the config.")
    return out


def mask_token(draft: GgufDraft) -> Results:
    out, mask, size = Results(), draft.file.keys.get("tokenizer.ggml.mask_token_id"), len(draft.vocab)
    if mask is None:
        out.add("DSP810", "the GGUF has no tokenizer.ggml.mask_token_id; llama.cpp fills the draft block with token "
                "-1 instead of the mask token.", "Re-convert from a config that names mask_token_id.")
    elif not isinstance(mask, int) or mask < 0 or (size and mask >= size):
        out.add("DSP810", f"tokenizer.ggml.mask_token_id is {mask!r}, outside the GGUF's {size} tokens.",
                "Re-convert from a config whose mask_token_id is the mask token the draft was trained with.")
    return out


def vocabulary(draft: GgufDraft) -> Results:
    """DSP811: the draft GGUF's tokens against the target's (llama.cpp passes token ids between them as they are)."""
    out, target = Results(), draft.target
    if target is None:
        out.skip("DSP807, DSP811", "no target option: the target's depth, width and vocabulary are not checked")
        return out
    tokens = draft.vocab
    if target.vocab_size and len(tokens) != target.vocab_size:
        out.add("DSP811", f"the GGUF has {len(tokens)} tokens and the target {target.vocab_size}; llama.cpp hands "
                "token ids between them as they are.", "Convert the draft with its own target (the target option).")
        return out
    differ = [i for i, token in target.tokens.items() if i < len(tokens) and tokens[i] != token]
    if differ:
        first = differ[0]
        out.add("DSP811", f"{len(differ)} token ids mean other text in the draft GGUF than in the target (first: id "
                f"{first}, {tokens[first]!r} against {target.tokens[first]!r}), so every drafted id is another token.",
                "Convert the draft with its own target's tokenizer (the target option).")
    return out


def window(draft: GgufDraft) -> Results:
    out, file = Results(), draft.file
    size, pattern = file.key("attention.sliding_window"), file.key("attention.sliding_window_pattern")
    layers = _int(file.key("block_count"))
    windowed = isinstance(pattern, list) and any(pattern)
    if windowed and not (positive_int(size)):
        out.add("DSP812", f"{ARCH}.attention.sliding_window_pattern marks sliding layers but "
                f"{ARCH}.attention.sliding_window is {size!r}; llama.cpp then runs every layer dense, not as the "
                "draft was trained.", "Re-convert with dspark convert, which writes the window from the "
                "config's sliding_window.")
    elif positive_int(size) and not isinstance(pattern, list):
        out.add("DSP812", f"{ARCH}.attention.sliding_window is {size} but the GGUF has no "
                f"{ARCH}.attention.sliding_window_pattern, which llama.cpp then requires (the model fails to load).",
                "Re-convert with dspark convert, which writes one pattern entry per layer.")
    elif isinstance(pattern, list) and layers and len(pattern) != layers:
        out.add("DSP812", f"{ARCH}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers.",
                "Re-convert with dspark convert, which writes one pattern entry per layer.")
    return out


def head_dtypes(draft: GgufDraft) -> Results:
    """DSP813: a Markov or confidence tensor stored in a type llama.cpp's graph cannot use as weights."""
    out = Results()
    for name in ("markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias"):
        tensor = draft.file.tensors.get(name)
        if tensor is not None and tensor.dtype.startswith("I"):
            out.add("DSP813", f"{name} is stored as {tensor.dtype}, an integer type llama.cpp's dflash graph cannot "
                    "multiply with.", "Re-convert from the float weights (F32, F16 or BF16).")
    return out


def confidence_flag(draft: GgufDraft) -> Results:
    out, flag = Results(), draft.file.key("has_confidence_head")
    has = "conf_proj.weight" in draft.file.tensors
    if flag is False and has:
        out.add("DSP814", f"{ARCH}.has_confidence_head is false but conf_proj is in the GGUF; llama.cpp refuses a "
                "confidence threshold (p-min) for it.", "Re-convert with dspark convert, which sets the key from the "
                "tensors.")
    elif flag is not False and not has and draft.markov_rank is not None:
        out.add("DSP814", f"{ARCH}.has_confidence_head is {flag!r} but the GGUF has no conf_proj; llama.cpp accepts "
                "a confidence threshold and has no head to compute it.", "Set the key to false, or re-convert.")
    return out


def norm_values(draft: GgufDraft) -> Results:
    """DSP607 on the GGUF's norm vectors (read with numpy; only with the deep option)."""
    from dspark_cli.runtime.checkpoint.rules.deep import untrained_norm

    out = Results()
    if not draft.deep:
        out.skip("DSP607", "norm values are checked only with the deep option")
        return out
    for name, tensor in draft.file.tensors.items():
        if name.endswith("norm.weight") and tensor.dtype in FLOAT_TYPES:
            out += untrained_norm(name, draft.file.values(name).tolist())
    return out


GGUF_RULES = (required_keys, required_tensors, block_size, target_layers, sample_from_anchor, mask_token,
              vocabulary, window, head_dtypes, confidence_flag, norm_values)


def resolved(draft: GgufDraft) -> dict:
    """What llama.cpp would run: the values the report prints."""
    file = draft.file
    return {"format": "gguf-dflash", "architecture": file.architecture, "block_size": file.key("block_size"),
            "target_layers": file.key("target_layers"), "target_layer_ids": draft.layer_ids,
            "sample_from_anchor": file.key("sample_from_anchor"),
            "mask_token_id": file.keys.get("tokenizer.ggml.mask_token_id"), "tokens": len(draft.vocab),
            "markov_rank": draft.markov_rank, "confidence_head": "conf_proj.weight" in file.tensors,
            "sliding_window": file.key("attention.sliding_window"),
            "causal": file.key("attention.causal") is True,  # common/speculative.cpp: "true", else non-causal
            "tensors": len(file.tensors)}


def _shape_fix(name: str) -> str:
    if name == "conf_proj.weight":
        return ("llama.cpp's confidence head reads the hidden state and the Markov state; convert a draft trained "
                "with confidence_head_with_markov.")
    return CONVERT_FIX


def _int(value) -> int | None:
    return value if positive_int(value) else None

