"""The training feature contract: what the frozen target gives the draft's training, per sample, and how it is made.

A draft trains on four things per token of a sample, recorded as a `FeatureRecord`:

    tokens       [T] int64     the token ids
    loss_mask    [T] bool      True where the token may be a label (a cached chat sample masks the prompt)
    layers       [T, n*Ht]     the outputs of the draft's n target layers, concatenated in the order of layer_ids
    last_hidden  [T, Ht]       the target's final hidden state AFTER its final norm: what feeds its lm_head

and one `FeatureSpec` per collection of records (target id and revision, layer ids, widths, dtype, tokenizer and
chat-template hashes, max length, contract version). Nothing else is needed: the target's next-token distribution
at any position is recomputed exactly from `last_hidden` with the frozen lm_head (`TargetHead`), and only where the
loss reads it (the anchor blocks' slots), instead of keeping [T, V] logits (for Qwen3-8B-like shapes, hidden 4096,
3 layers + last in bf16: 32 KiB per token against 297 KiB of bf16 logits).

Layer ids (dspark's convention, the one of DeepSpec's `target_layer_ids` and of config.json): layer id k is the raw
OUTPUT of decoder layer k (0-based), the residual stream after it, and -1 the embedding output. That is Hugging Face
`hidden_states[k + 1]` (`hidden_states[0]` is the embedding output) for every k but the last layer, whose HF entry is stored after the
final norm; the capture here always takes the raw output, as `TargetModel` does in generation. Beware the
off-by-one of vLLM's / speculators' `aux_hidden_state_layer_ids` and llama.cpp's extract layers: they count the
INPUT of layer k + 1, i.e. they hold k + 1 for dspark's k (`DraftConfig.hidden_state_indices` converts).

`capture_target_features` is the in-process source of the contract (forward hooks on the chosen layers, the
decoder's own post-norm output, no `output_hidden_states` and no logits at all: the lm_head never runs). A cache of
records written to disk is the other source; the trainer takes `TargetFeatures` from either.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
from torch import nn

from dspark_cli.errors import DsparkError

CONTRACT_VERSION = 2  # 2: the tokenizer hash covers the whole tokenizer definition (1: vocabulary and special ids)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RECORD_KEYS = ("tokens", "loss_mask", "layers", "last_hidden")  # the tensor names of one record
TOKENIZER_PARTS = ("normalizer", "pre_tokenizer", "model", "post_processor", "added_tokens")  # what sets the ids


@dataclass(frozen=True)
class FeatureSpec:
    """What a collection of feature records was made from and how it is laid out (versioned, JSON-able)."""

    target: str  # the target's hub id or folder, as given
    revision: str | None  # hub branch, tag or commit (None: a folder or the default branch)
    layer_ids: tuple[int, ...]  # dspark's convention: output of decoder layer k (HF hidden_states[k + 1]), -1 embedding
    hidden_size: int  # the target's width Ht
    vocab_size: int  # rows of the target's lm_head
    dtype: str  # storage dtype of layers / last_hidden: a key of DTYPES
    tokenizer_hash: str  # tokenizer_hash(tokenizer)
    template_hash: str | None  # template_hash(text) of the chat template used, None when none was
    max_length: int  # tokens per record at most
    version: int = CONTRACT_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def feature_width(self) -> int:
        """n * Ht: the width of `layers`."""
        return len(self.layer_ids) * self.hidden_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's hidden states (layers + last_hidden) in the storage dtype, ids and mask aside."""
        return (len(self.layer_ids) + 1) * self.hidden_size * self.torch_dtype.itemsize

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["layer_ids"] = list(self.layer_ids)
        return doc

    @classmethod
    def from_dict(cls, doc: dict, where: str = "the feature spec") -> "FeatureSpec":
        """The spec a to_dict wrote; one sentence naming `where` and the key when it is not one."""
        if not isinstance(doc, dict):
            raise DsparkError(f"{where} is not a JSON object; rebuild the features.")
        version = doc.get("version")
        if version != CONTRACT_VERSION:
            raise DsparkError(f"{where}: key 'version' is {version!r}, but this dspark reads feature contract "
                              f"version {CONTRACT_VERSION}; rebuild the features with this dspark.")
        fields = {name: doc.get(name) for name in cls.__dataclass_fields__}
        missing = [name for name, value in fields.items() if value is None and name not in ("revision", "template_hash")]
        if missing:
            raise DsparkError(f"{where}: key {missing[0]!r} is missing; rebuild the features.")
        if fields["dtype"] not in DTYPES:
            raise DsparkError(f"{where}: key 'dtype' is {fields['dtype']!r}, not one of {', '.join(DTYPES)}; rebuild "
                              "the features.")
        ids = fields["layer_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= -1 for i in ids)):
            raise DsparkError(f"{where}: key 'layer_ids' is {ids!r}, not a list of layer ids; rebuild the features.")
        for name in ("hidden_size", "vocab_size", "max_length"):
            if not (isinstance(fields[name], int) and fields[name] >= 1):
                raise DsparkError(f"{where}: key {name!r} is {fields[name]!r}, not a positive integer; rebuild the "
                                  "features.")
        return cls(**fields)


def tokenizer_hash(tokenizer) -> str:
    """sha256 of what decides a tokenizer's ids: its whole definition (a fast tokenizer's tokenizer.json: the
    normalizer, pre-tokenizer, model with its vocabulary and merges, post-processor and added tokens; not the
    truncation and padding a call leaves set) and its special ids. A tokenizer without that definition hashes its
    vocabulary and special ids."""
    special = {name: getattr(tokenizer, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        doc = {"definition": {part: definition.get(part) for part in TOKENIZER_PARTS}, "special": special}
    else:
        doc = {"vocab": sorted(tokenizer.get_vocab().items()), "special": special}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def template_hash(template: str | None) -> str | None:
    """sha256 of a chat template's text (None when no template was used)."""
    return None if template is None else hashlib.sha256(template.encode("utf-8")).hexdigest()


@dataclass
class TargetFeatures:
    """The target's features of a batch, as the trainer consumes them."""

    layers: torch.Tensor  # [B, T, n*Ht] outputs of the draft's target layers, in layer_ids order
    last_hidden: torch.Tensor  # [B, T, Ht] after the final norm: the lm_head's input

    def rows(self, index) -> "TargetFeatures":
        """The features of some rows of the batch (index: a slice or an index tensor over B)."""
        return TargetFeatures(self.layers[index], self.last_hidden[index])


@dataclass
class FeatureRecord:
    """One sample of the contract (see the module docstring)."""

    tokens: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    layers: torch.Tensor  # [T, n*Ht]
    last_hidden: torch.Tensor  # [T, Ht]

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors by RECORD_KEYS, contiguous on the CPU (for safetensors)."""
        return {name: getattr(self, name).detach().cpu().contiguous() for name in RECORD_KEYS}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], spec: FeatureSpec, where: str) -> "FeatureRecord":
        """A record read back, checked against its spec; one sentence naming `where` when it does not fit."""
        missing = [name for name in RECORD_KEYS if name not in tensors]
        if missing:
            raise DsparkError(f"{where} lacks the tensor {missing[0]!r}; rebuild the features.")
        record = cls(**{name: tensors[name] for name in RECORD_KEYS})
        record.check(spec, where)
        return record

    def check(self, spec: FeatureSpec, where: str) -> None:
        T = self.tokens.shape[0] if self.tokens.dim() == 1 else -1
        expected = {"tokens": ((T,), (torch.int64,)), "loss_mask": ((T,), (torch.bool,)),
                    "layers": ((T, spec.feature_width), (spec.torch_dtype,)),
                    "last_hidden": ((T, spec.hidden_size), (spec.torch_dtype,))}
        if not 1 <= T <= spec.max_length:
            raise DsparkError(f"{where}: 'tokens' has shape {list(self.tokens.shape)}, not [T] with 1 <= T <= "
                              f"{spec.max_length}; rebuild the features.")
        for name, (shape, dtypes) in expected.items():
            value = getattr(self, name)
            if tuple(value.shape) != shape or value.dtype not in dtypes:
                raise DsparkError(f"{where}: {name!r} is {value.dtype} {list(value.shape)}, expected "
                                  f"{dtypes[0]} {list(shape)}; rebuild the features.")


def stack_records(records: Sequence[FeatureRecord], seq_len: int | None = None):
    """Records of at least seq_len tokens, cut to seq_len (default: the shortest) and stacked.
    -> tokens [B, T], loss_mask [B, T], TargetFeatures"""
    T = min(r.tokens.shape[0] for r in records) if seq_len is None else seq_len
    def stacked(name: str) -> torch.Tensor:
        return torch.stack([getattr(r, name)[:T] for r in records])
    return stacked("tokens"), stacked("loss_mask"), TargetFeatures(stacked("layers"), stacked("last_hidden"))


# --- the in-process source: the frozen target itself ------------------------------------------------------------

def decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """A causal LM's decoder (the model below its lm_head) and its list of decoder layers."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise DsparkError(f"the target {type(model).__name__} has no `layers` list in its decoder; dspark reads "
                          "hidden states from decoder layers (Qwen3, Llama, Mistral, Gemma-style models).")
    return decoder, layers


@torch.no_grad()
def capture_target_features(target: nn.Module, tokens: torch.Tensor, layer_ids: Sequence[int]) -> TargetFeatures:
    """Run the frozen target's decoder over tokens [B, T] and keep the raw outputs of the layers `layer_ids` (forward
    hooks; -1: the embedding's output) and the decoder's final, post-norm hidden state; the lm_head is never run
    (no logits are computed).
    -> TargetFeatures(layers [B, T, n*Ht], last_hidden [B, T, Ht]) in the target's dtype."""
    decoder, layers = decoder_layers(target)
    bad = [k for k in layer_ids if not -1 <= k < len(layers)]
    if bad:
        raise DsparkError(f"the target layer id {bad[0]} does not exist: the target has {len(layers)} layers "
                          f"(ids -1..{len(layers) - 1}, -1 being the embedding); choose other target layers.")
    captured: dict[int, torch.Tensor] = {}

    def keep(k: int):
        def hook(module, inputs, output) -> None:
            captured[k] = output[0] if isinstance(output, tuple) else output  # [B, T, Ht]
        return hook

    modules = {k: decoder.get_input_embeddings() if k == -1 else layers[k] for k in set(layer_ids)}
    handles = [module.register_forward_hook(keep(k)) for k, module in modules.items()]
    try:
        out = decoder(input_ids=tokens, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return TargetFeatures(torch.cat([captured[k] for k in layer_ids], dim=-1), out.last_hidden_state)


class TargetHead(nn.Module):
    """The target's frozen output head, read from the model: its lm_head, then the family's logit transform where its
    config has one (a multiplier `logit_scale`, a divisor `logits_scaling`, a tanh soft-cap
    `final_logit_softcapping`). `check` compares it with the model's own logits once."""

    def __init__(self, model: nn.Module):
        super().__init__()
        config = model.config.get_text_config()
        self.lm_head = model.get_output_embeddings()  # shared, frozen: not a copy
        self.multiplier = float(getattr(config, "logit_scale", None) or 1.0) / float(
            getattr(config, "logits_scaling", None) or 1.0)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """post-norm hidden [..., Ht] -> the target's logits [..., V]"""
        logits = self.lm_head(hidden)
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def at(self, last_hidden: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The target's logits only at the positions `index` [B, A, K] of last_hidden [B, T, Ht], computed for the
        `valid` [B, A, K] slots alone (the lm_head sees one row per valid slot); 0 at the others. -> [B, A, K, V]"""
        B, A, K = index.shape
        rows = last_hidden.gather(1, index.view(B, A * K, 1).expand(-1, -1, last_hidden.shape[-1]))  # [B, A*K, Ht]
        logits = self(rows.view(B, A, K, -1)[valid])  # [n_valid, V]
        out = logits.new_zeros(B, A, K, logits.shape[-1])
        out[valid] = logits
        return out

    @torch.no_grad()
    def check(self, model: nn.Module, tokens: torch.Tensor, where: str) -> None:
        """Refuse a target whose own logits on tokens [1, T] this head does not reproduce (a family with another
        output transform): one sentence naming `where`."""
        own = model(input_ids=tokens, use_cache=False).logits.float()  # [1, T, V]
        last = capture_target_features(model, tokens, [0]).last_hidden
        mine = self(last).float()
        scale = own.abs().max().clamp_min(1.0)
        if own.shape != mine.shape or (own - mine).abs().max() > 1e-2 * scale:
            raise DsparkError(f"the target {where} computes its logits in a way dspark's training does not "
                              "reproduce from its last hidden state (its lm_head with a logit scale or soft-cap); "
                              "this target family is not supported for training.")
