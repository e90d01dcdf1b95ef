"""The draft checkpoint's schema, in one place: DeepSpec tensor names, the aliases vLLM renames, the tensors a
config implies, the Linear layers vLLM builds (and the prefixes its quantization config is asked about), and the
Marlin constant (the NVFP4 block size is the kernels'). docs/validate.md and docs/quantize.md describe the format; nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dspark_cli.kernels import NVFP4_GROUP_SIZE as NVFP4_GROUP  # the NVFP4 block size lives with its math

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
NVFP4_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")  # beside `<module>.weight` (docs/quantize.md)
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
    """Every tensor of a DSpark/DFlash draft by on-disk name. Needs hidden/intermediate size, depth, heads, vocab."""
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    D = config.head_dim
    hq, hkv = config.num_attention_heads * D, (config.num_key_value_heads or config.num_attention_heads) * D
    vd, r, ht = config.draft_vocab_size or V, config.markov_rank or None, config.target_hidden_size or H
    n = len(config.layer_ids) if config.layer_ids else None
    out: dict[str, ExpectedTensor] = {}

    def add(name: str, shape: tuple[int | None, ...], formula: str, required: bool = True, dtype: str | None = None):
        out[name] = ExpectedTensor(name, shape, formula, required, dtype)

    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        add(p + "self_attn.q_proj.weight", (hq, H), "[num_attention_heads*head_dim, hidden_size]")
        add(p + "self_attn.k_proj.weight", (hkv, H), "[num_key_value_heads*head_dim, hidden_size]")
        add(p + "self_attn.v_proj.weight", (hkv, H), "[num_key_value_heads*head_dim, hidden_size]")
        add(p + "self_attn.o_proj.weight", (H, hq), "[hidden_size, num_attention_heads*head_dim]")
        if config.attention_bias:
            add(p + "self_attn.q_proj.bias", (hq,), "[num_attention_heads*head_dim]")
            add(p + "self_attn.k_proj.bias", (hkv,), "[num_key_value_heads*head_dim]")
            add(p + "self_attn.v_proj.bias", (hkv,), "[num_key_value_heads*head_dim]")
            add(p + "self_attn.o_proj.bias", (H,), "[hidden_size]")
        add(p + "self_attn.q_norm.weight", (D,), "[head_dim]")
        add(p + "self_attn.k_norm.weight", (D,), "[head_dim]")
        add(p + "mlp.gate_proj.weight", (I, H), "[intermediate_size, hidden_size]")
        add(p + "mlp.up_proj.weight", (I, H), "[intermediate_size, hidden_size]")
        add(p + "mlp.down_proj.weight", (H, I), "[hidden_size, intermediate_size]")
        add(p + "input_layernorm.weight", (H,), "[hidden_size]")
        add(p + "post_attention_layernorm.weight", (H,), "[hidden_size]")
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
        with_markov = config.confidence_head_with_markov and config.markov_rank != 0
        width = (H + r if r else None) if with_markov else H  # None: markov_rank unknown
        formula = "[1, hidden_size+markov_rank]" if with_markov else "[1, hidden_size]"
        add("confidence_head.proj.weight", (1, width), formula, required=False)
        add("confidence_head.proj.bias", (1,), "[1]", required=False)
    return out


def linear_modules(config: "DraftConfig") -> list[LinearModule]:
    """The draft's quantizable Linear layers: qkv/o/gate_up/down per layer, fc, the heads."""
    modules = []
    for i in range(config.num_hidden_layers or 0):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        modules += [
            LinearModule(f"model.{attn}qkv_proj", tuple(f"{attn}{x}_proj.weight" for x in "qkv")),
            LinearModule(f"model.{attn}o_proj", (f"{attn}o_proj.weight",)),
            LinearModule(f"model.{mlp}gate_up_proj", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight")),
            LinearModule(f"model.{mlp}down_proj", (f"{mlp}down_proj.weight",)),
        ]
    for name in ("fc.weight", "lm_head.weight", "confidence_head.proj.weight", MARKOV_W2):
        modules.append(LinearModule(vllm_prefix(name), (name,)))
    return modules
