"""The demo's tiny targets: a byte-level BPE tokenizer and a small causal LM trained from scratch, either a Qwen3
(attention only, TargetGeometry) or a Qwen3.5-style hybrid (Gated DeltaNet and attention layers, HybridGeometry).

Ordinary next-token training (cross-entropy, AdamW, linear warm-up then cosine decay), deterministic for a
given seed, corpus and thread count.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from dspark_cli.runtime.train.data import TokenStream

END_OF_TEXT = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


def build_tokenizer(files: list[Path], vocab_size: int):
    """Train a byte-level BPE on `files` (in the given order). -> PreTrainedTokenizerFast.

    Two special tokens: END_OF_TEXT (id 0; eos and pad) and MASK_TOKEN (id 1; the draft's mask token, never
    produced by the text).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT, MASK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(f) for f in files], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                   additional_special_tokens=[MASK_TOKEN])


@dataclass(frozen=True)
class TargetGeometry:
    """A Qwen3ForCausalLM: attention in every layer."""

    architecture: ClassVar[str] = "Qwen3ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048

    def build(self, eos_token_id: int, seed: int):
        """A freshly initialised Qwen3ForCausalLM (tied embeddings, float32)."""
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(**asdict(self), tie_word_embeddings=True, rope_theta=10000.0,
                             bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id)
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config)


@dataclass(frozen=True)
class HybridGeometry(TargetGeometry):
    """A Qwen3.5-style Qwen3_5ForCausalLM: every `full_attention_every`-th layer is gated full attention, the others
    Gated DeltaNet linear attention (a recurrent state per layer instead of a growing KV cache)."""

    architecture: ClassVar[str] = "Qwen3_5ForCausalLM"
    full_attention_every: int = 4
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4

    @property
    def layer_types(self) -> list[str]:
        n = self.full_attention_every
        return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_hidden_layers)]

    def build(self, eos_token_id: int, seed: int):
        """A freshly initialised Qwen3_5ForCausalLM (tied embeddings, float32)."""
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        fields = {k: v for k, v in asdict(self).items() if k != "full_attention_every"}
        config = Qwen3_5TextConfig(**fields, layer_types=self.layer_types, tie_word_embeddings=True,
                                   bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id)
        torch.manual_seed(seed)
        return Qwen3_5ForCausalLM(config)


@dataclass(frozen=True)
class LMStep:
    step: int
    steps: int
    loss: float
    lr: float
    tokens_per_s: float


def cosine_lr(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, cosine decay to 10% of it at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_causal_lm(model, stream: TokenStream, *, steps: int, batch_size: int, seq_len: int, lr: float,
                    seed: int, on_step: Callable[[LMStep], None] | None = None) -> None:
    """Next-token training of `model` in place on random windows of `stream`."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    started = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, lr, warmup=max(1, steps // 50))
        batch = stream.sample(batch_size, seq_len + 1, generator)  # [B, T+1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if on_step is not None:
            elapsed = time.perf_counter() - started
            on_step(LMStep(step + 1, steps, loss.item(), optimizer.param_groups[0]["lr"],
                           (step + 1) * batch.shape[0] * (batch.shape[1] - 1) / elapsed))
    model.eval()


@torch.no_grad()
def evaluate_lm(model, stream: TokenStream, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy over consecutive windows of `stream`."""
    windows = stream.windows(seq_len + 1, limit=max_windows)  # [n, T+1]
    losses = []
    for chunk in windows.split(8):
        logits = model(input_ids=chunk[:, :-1]).logits
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum"))
    return (torch.stack(losses).sum() / (windows.shape[0] * seq_len)).item()
