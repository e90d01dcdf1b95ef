"""The draft checkpoint's schema, in one place: DeepSpec tensor names, the aliases vLLM renames, the tensors a
config implies, the Linear layers vLLM builds (and the prefixes its quantization config is asked about), and the
Marlin constant (the NVFP4 block size is the kernels'). docs/validate.md and docs/quantize.md describe the format; nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dspark_cli.kernels import NVFP4_GROUP_SIZE as NVFP4_GROUP  # the NVFP4 block size lives with its math
from dspark_cli.runtime.checkpoint.families import FAMILIES
from dspark_cli.runtime.checkpoint.heads import HEAD_TYPES

if TYPE_CHECKING:
    from dspark_cli.runtime.checkpoint.config import DraftConfig

MARKOV_W1 = "markov_head.markov_w1.weight"
MARKOV_W2_MODULE = "markov_head.markov_w2"  # on-disk module name (no `model.` prefix)
MARKOV_W2 = f"{MARKOV_W2_MODULE}.weight"
MARKOV_W2_SCALE = f"{MARKOV_W2_MODULE}.weight_scale"
MARKOV_W2_GLOBAL_SCALE = f"{MARKOV_W2_MODULE}.weight_scale_2"
# vLLM's Qwen3DSparkForCausalLM builds its backbone under prefix "model" and its loader prepends "model." to every
# on-disk name except lm_head* and d2t, so the layer vLLM asks the quant config about is "model.markov_head.markov_w2".
VLLM_MARKOV_W2_PREFIX = f"model.{MARKOV_W2_MODULE}"
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")  # beside a quantized `<module>.weight` (NVFP4, FP8)
MARLIN_K_MULTIPLE = 64  # vLLM's Marlin W4A16 kernel wants the input features (K = r for markov_w2) a multiple of 64
# Names vLLM's DFlash/DSpark loader renames (z-lab DFlash and SpecForge exports).
DFLASH_ALIASES = (("midlayer.", "layers.0."), ("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
IGNORED_BY_VLLM = ("t2d", "mask_embedding")  # t2d* is skipped; mask_embedding is dropped for DSpark


def canonical_name(name: str) -> str:
    """The DeepSpec name vLLM loads an on-disk tensor as: no `model.` prefix, DFlash aliases renamed."""
    name = name.removeprefix("model.")
    for alias, canonical in DFLASH_ALIASES:
        if name.startswith(alias):
            return canonical + name[len(alias) :]
    return name


@dataclass(frozen=True)
class ExpectedTensor:
    """A tensor a draft may hold, with the shape its config implies."""

    name: str
    shape: tuple[int | None, ...]  # None: a dimension the config does not determine
    formula: str  # the shape in config terms, for messages
    required: bool
    dtype: str | None = None  # an exact safetensors dtype (d2t: "I64"); None means any floating dtype

    def matches(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(e is None or e == a for e, a in zip(self.shape, shape))


@dataclass(frozen=True)
class LinearModule:
    """A Linear layer as vLLM builds it: the prefix its quantization config is asked about, and its weights."""

    prefix: str  # e.g. "model.layers.0.self_attn.qkv_proj" (fused) or "lm_head"
    weights: tuple[str, ...]  # on-disk weight names it is loaded from

    @property
    def shard_prefixes(self) -> tuple[str, ...]:
        """vLLM prefixes of the unfused parts of a fused layer (q/k/v, gate/up); empty for a plain layer."""
        if len(self.weights) == 1:
            return ()
        return tuple(vllm_prefix(name) for name in self.weights)


def vllm_prefix(weight_name: str) -> str:
    """vLLM module prefix of an on-disk weight: `model.` is prepended to every name except lm_head*."""
    module = weight_name.rsplit(".", 1)[0]
    return module if module.startswith("lm_head") else f"model.{module}"


def expected_draft_tensors(config: "DraftConfig") -> dict[str, ExpectedTensor]:
    """Every tensor of a DSpark/DFlash draft by on-disk name. Needs hidden/intermediate size, depth, heads, vocab.
    A decoder layer's tensors are its family's (checkpoint/families/), the Markov head's extras its type's
    (checkpoint/heads.py)."""
    H, V = config.hidden_size, config.vocab_size
    vd, r, ht = config.draft_vocab_size or V, config.markov_rank or None, config.target_hidden_size or H
    n = len(config.layer_ids) if config.layer_ids else None
    out: dict[str, ExpectedTensor] = {}

    def add(name: str, shape: tuple[int | None, ...], formula: str, required: bool = True, dtype: str | None = None):
        out[name] = ExpectedTensor(name, shape, formula, required, dtype)

    family = FAMILIES[config.family]
    layer = family.layer_tensors(config)
    for i in range(config.num_hidden_layers):
        for name, shape, formula in layer:
            add(f"layers.{i}.{name}", shape, formula)
        for name, shape, formula in family.optional_layer_tensors:
            add(f"layers.{i}.{name}", shape, formula, required=False)
    for name, shape, formula in family.model_tensors(config):
        add(name, shape, formula)
    add("norm.weight", (H,), "[hidden_size]")
    add("hidden_norm.weight", (H,), "[hidden_size]")
    if config.use_aux_hidden_state:
        add("fc.weight", (H, n * ht if n else None), "[hidden_size, len(target_layer_ids)*target_hidden_size]")
    add("embed_tokens.weight", (V, H), "[vocab_size, hidden_size]", required=False)
    add("lm_head.weight", (vd, H), "[draft_vocab_size, hidden_size]", required=False)
    add("d2t", (vd,), "[draft_vocab_size]", required=False, dtype="I64")
    if config.kind == "dspark":
        if config.markov_rank != 0:  # rank 0: DeepSpec's DFlash ablation, no Markov head
            add(MARKOV_W1, (V, r), "[vocab_size, markov_rank]")
            add(MARKOV_W2, (vd, r), "[draft_vocab_size, markov_rank]")
            for name, shape, formula in HEAD_TYPES.get(config.markov_head_type, ()):
                add(name, shape(H, r) if r else (None,), formula)
        with_markov = config.confidence_head_with_markov and config.markov_rank != 0
        width = (H + r if r else None) if with_markov else H  # None: markov_rank unknown
        formula = "[1, hidden_size+markov_rank]" if with_markov else "[1, hidden_size]"
        add("confidence_head.proj.weight", (1, width), formula, required=False)
        add("confidence_head.proj.bias", (1,), "[1]", required=False)
    return out


def linear_modules(config: "DraftConfig") -> list[LinearModule]:
    """The draft's quantizable Linear layers: qkv/o/gate_up/down per layer, fc, the heads."""
    family = FAMILIES[config.family]
    modules = [LinearModule(prefix, weights) for i in range(config.num_hidden_layers or 0)
               for prefix, weights in family.layer_linears(config, f"layers.{i}.")]
    for name in ("fc.weight", "lm_head.weight", "confidence_head.proj.weight", MARKOV_W2):
        modules.append(LinearModule(vllm_prefix(name), (name,)))
    return modules
