"""Target/draft pairs for the speculative tests, built so that drafts are often accepted.

A random draft is almost never accepted by a random target, so a greedy "output equals the target's"
test would only exercise the reject-everything path. These pairs fix that:

- `bigram_target` writes a tiny random Qwen3 whose attention and MLP outputs are damped, so its next
  token depends mostly on the current token (damp=0 makes it an exact bigram model: every layer adds
  zero to the residual stream, and logits = lm_head(norm(embed[token]))).
- `bigram_draft` writes a DSpark draft whose Markov head is that bigram: W1[x] = norm(embed[x]),
  W2 = lm_head (rank r = hidden size), with a weak random base lm_head. The Markov walk then predicts
  the target's next token most of the time, and every round mixes accepted and rejected positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from ckpt_factory import DraftSpec, Tensors, nvfp4_quant_configs, tiny_target, write_draft

W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"


def bigram_target(path: Path, spec: DraftSpec, *, damp: float = 0.1, logit_std: float = 0.5, seed: int = 0) -> Path:
    """tiny_target with o_proj / down_proj scaled by `damp` and lm_head ~ N(0, logit_std) (float32). A Gemma-4
    target normalises both outputs again (sandwich norms), so its post-attention / post-feedforward norms are
    scaled instead, and its embedding is enlarged so that the current token dominates the residual stream."""
    from transformers import AutoModelForCausalLM

    tiny_target(path, spec, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        if spec.family == "gemma4":
            model.model.embed_tokens.weight.mul_(20.0)
        for layer in model.model.layers:
            if spec.family == "gemma4":
                layer.post_attention_layernorm.weight.mul_(damp)
                layer.post_feedforward_layernorm.weight.mul_(damp)
                continue
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=_gen(seed)) * logit_std)
    model.save_pretrained(path)
    return path


def bigram_weights(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(embed) [V, H], lm_head [V, H]) of a saved target: bigram logits = the first @ the second^T."""
    from safetensors.torch import load_file

    tensors = load_file(str(target_dir / "model.safetensors"))
    config = json.loads((target_dir / "config.json").read_text())
    embed, norm = tensors["model.embed_tokens.weight"], tensors["model.norm.weight"]
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * norm
    return normed, tensors["lm_head.weight"]


def bigram_draft(
    path: Path,
    spec: DraftSpec,
    target_dir: Path,
    *,
    w2_gain: float = 4.0,
    w2_noise: float = 0.0,
    nvfp4: bool = False,
    edit: dict | None = None,
) -> Path:
    """A draft whose Markov head reproduces the target's bigram (needs spec.markov_rank == hidden size).

    w2_gain sharpens the bias against the random base logits; w2_noise (relative) makes the draft
    disagree with the target now and then; nvfp4 stores W2 as NVFP4 with dspark quantize's configs.
    For a reduced vocabulary, W2's rows are the lm_head rows of the target ids that d2t maps to.
    """
    w1, lm_head = bigram_weights(target_dir)
    if spec.markov_rank != w1.shape[1]:
        raise ValueError(f"bigram_draft needs markov_rank == hidden size {w1.shape[1]}, got {spec.markov_rank}")

    def mutate(tensors: Tensors) -> Tensors:
        rows = torch.arange(spec.vd)
        if "d2t" in tensors:
            rows = rows + tensors["d2t"]
        w2 = lm_head[rows] * w2_gain
        w2 = w2 + w2_noise * w2.std() * torch.randn(w2.shape, generator=_gen(spec.seed + 7))
        out = {**tensors, W1: w1.to(spec.dtype), W2: w2.to(spec.dtype)}
        if "lm_head.weight" in out:
            out["lm_head.weight"] = out["lm_head.weight"] * 0.1
        return _nvfp4_w2(out) if nvfp4 else out

    edit = dict(edit or {})
    if nvfp4:
        edit["quantization_config"] = nvfp4_quant_configs()[0]
    write_draft(path, spec, edit=edit, mutate=mutate)
    if nvfp4:
        (path / "hf_quant_config.json").write_text(json.dumps(nvfp4_quant_configs()[1], indent=2))
    return path


def _nvfp4_w2(tensors: Tensors) -> Tensors:
    from dspark_cli.kernels.nvfp4 import quantize_nvfp4

    weight = quantize_nvfp4(tensors[W2].float())
    return {
        **tensors,
        W2: weight.packed,
        "markov_head.markov_w2.weight_scale": weight.scale,
        "markov_head.markov_w2.weight_scale_2": weight.global_scale,
    }


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def write_byte_tokenizer(path: Path, eos_id: int = 1) -> Path:
    """A 256-token byte-level tokenizer (no merges) saved into `path`, with token `eos_id` as eos, so that
    `dspark generate` can run on the 256-token fixtures."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 printable stand-ins for the bytes
    tokenizer = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=alphabet[eos_id]).save_pretrained(path)
    return path
