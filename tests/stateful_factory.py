"""Tiny random targets of every stateful family dspark supports, built from transformers' own classes (no downloads).

Each has hidden size 64 and two to four decoder layers mixing the family's stateful layer kind with attention
(Mamba2: none), and the demo tokenizer's vocabulary (1024), so `dspark train / validate / generate / eval` run on
them as a user would.
The stateful mixers' output projections are scaled up (`STATE_GAIN`) so that a state left wrong by a rollback
changes the logits far beyond float32 noise: a random init would otherwise let their contribution hide.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dspark_cli.runtime.demo import demo_pair

VOCAB = 1024  # the demo tokenizer's
STATE_GAIN = 8.0
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
WITHOUT_MLP = {key: value for key, value in COMMON.items() if key != "intermediate_size"}  # MoE-only layers
HYBRID_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                    mamba_expand=2, mamba_chunk_size=16)
GDN = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
           linear_value_head_dim=16, linear_conv_kernel_dim=4,
           layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])


def _configs():
    import transformers as hf

    return {
        "qwen3_5": lambda: hf.Qwen3_5TextConfig(**COMMON, num_hidden_layers=4, **GDN),
        "qwen3_5_moe": lambda: hf.Qwen3_5MoeTextConfig(**WITHOUT_MLP, num_hidden_layers=4, **GDN, num_experts=4,
                                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=32),
        "qwen3_next": lambda: hf.Qwen3NextConfig(**COMMON, num_hidden_layers=4, **GDN, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=32, decoder_sparse_step=1),
        "falcon_h1": lambda: hf.FalconH1Config(**COMMON, num_hidden_layers=2, head_dim=16, mamba_d_ssm=128,
                                               **HYBRID_MAMBA),
        "jamba": lambda: hf.JambaConfig(**COMMON, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                                        expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                                        num_experts_per_tok=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                                        mamba_dt_rank=8),
        "bamba": lambda: hf.BambaConfig(**COMMON, num_hidden_layers=2, attn_layer_indices=[1], **HYBRID_MAMBA),
        "granitemoehybrid": lambda: hf.GraniteMoeHybridConfig(**COMMON, num_hidden_layers=2,
                                                              layer_types=["mamba", "attention"], **HYBRID_MAMBA,
                                                              num_local_experts=2, num_experts_per_tok=1,
                                                              shared_intermediate_size=64),
        "lfm2": lambda: hf.Lfm2Config(**COMMON, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                      conv_L_cache=3, block_ff_dim=128, block_auto_adjust_ff_dim=False),
        "lfm2_moe": lambda: hf.Lfm2MoeConfig(**COMMON, num_hidden_layers=3, moe_intermediate_size=32,
                                             layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                                             num_dense_layers=1, num_experts=4, num_experts_per_tok=2),
        "mamba2": lambda: hf.Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=8,
                                          head_dim=16, n_groups=1, state_size=16, conv_kernel=4, expand=2,
                                          chunk_size=16, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                                          pad_token_id=0),
        "minimax": lambda: hf.MiniMaxConfig(**COMMON, num_hidden_layers=2, head_dim=16,
                                            layer_types=["linear_attention", "full_attention"], num_local_experts=2,
                                            num_experts_per_tok=1, block_size=16),
    }


FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "falcon_h1", "jamba", "bamba", "granitemoehybrid", "lfm2",
            "lfm2_moe", "mamba2", "minimax")
MIXER_OUTPUTS = ("linear_attn.out_proj", "mamba.out_proj", "conv.out_proj", "mixer.out_proj")


def tiny_stateful_model(family: str, seed: int = 0):
    """A random float32 causal LM of `family` (see FAMILIES), its stateful mixers' outputs scaled by STATE_GAIN."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[family](), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(MIXER_OUTPUTS) or (family == "minimax" and name.endswith("self_attn.out_proj")):
                module.weight.mul_(STATE_GAIN)
    return model


def tiny_stateful_target(path: Path, family: str, seed: int = 0) -> Path:
    """tiny_stateful_model saved to `path` (safetensors) with the demo tokenizer beside it."""
    tiny_stateful_model(family, seed).save_pretrained(path)
    demo_target, _ = demo_pair()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(demo_target) / name, path / name)
    return path


def tiny_multimodal_qwen3_5(path: Path, seed: int = 0) -> Path:
    """The layout of every released Qwen3.5 checkpoint: Qwen3_5ForConditionalGeneration (model_type qwen3_5, the text
    model under text_config, a vision tower beside it), here with the tiny qwen3_5 text model and a 1-block tower,
    saved with the demo tokenizer. AutoModelForCausalLM loads its text model."""
    import transformers as hf
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig

    vision = Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                 patch_size=4)
    config = hf.Qwen3_5Config(text_config=_configs()["qwen3_5"]().to_dict(), vision_config=vision.to_dict())
    torch.manual_seed(seed)
    hf.Qwen3_5ForConditionalGeneration(config).save_pretrained(path)
    demo_target, _ = demo_pair()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(demo_target) / name, path / name)
    return path
