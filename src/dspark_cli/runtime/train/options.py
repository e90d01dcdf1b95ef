"""What one `dspark train` run is asked to do (TrainOptions), and the names of a checkpoint's trainer files.

Both the trainer and the checks before a run read these; keeping them here lets neither import the other."""

from __future__ import annotations

from dataclasses import dataclass

TRAINER_STATE = "trainer_state.safetensors"  # AdamW moments, generator state (safetensors)
TRAINER_JSON = "trainer_state.json"  # step, param groups, options


@dataclass(frozen=True)
class TrainOptions:
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    anchors: int | None = None  # per sequence; None: seq_len // 8 (DeepSpec: 512 per 4096 tokens)
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    decay_gamma: float = 4.0  # position weight exp(-j / gamma)
    seed: int = 0
    save_every: int = 0  # 0: only the final checkpoint

    def anchors_per_sequence(self, seq_len: int) -> int:
        return max(1, min(self.anchors or seq_len // 8, seq_len - 1))
