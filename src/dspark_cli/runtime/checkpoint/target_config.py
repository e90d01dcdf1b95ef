"""A target model's config.json as one typed view (torch-free): validate, serve's checks, pair, train and the stateful
families read the target through it.

The text config is read by one rule: a multimodal config's `text_config` when it is an object, else the config
itself. That is transformers' `PretrainedConfig.get_text_config()`, i.e. the model AutoModelForCausalLM loads and
`model/target.py` runs (every released Qwen3.5, a Gemma-4 with vision). validate once preferred a top-level
`vocab_size` over `text_config`; transformers' composite configs write none (PaliGemma writes the same value in
both), and the loaded model's vocabulary is text_config's, so the one rule is the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TargetConfig:
    """The target's config.json (`raw`) and its text model's config (`text`), with the values callers read typed."""

    raw: dict[str, Any]
    text: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TargetConfig":
        inner = raw.get("text_config")
        return cls(raw, inner if isinstance(inner, dict) else raw)

    @property
    def model_type(self) -> str | None:
        """The text model's model_type ("gemma4_text" for a multimodal Gemma-4, "qwen3" for a Qwen3)."""
        return _str(self.text.get("model_type"))

    @property
    def outer_model_type(self) -> str | None:
        """The whole config's model_type ("gemma4" for a multimodal Gemma-4; model_type for a text-only one)."""
        return _str(self.raw.get("model_type"))

    @property
    def architectures(self) -> tuple[str, ...]:
        value = self.raw.get("architectures")
        return tuple(a for a in value if isinstance(a, str)) if isinstance(value, list) else ()

    @property
    def vocab_size(self) -> int | None:
        return _positive(self.text.get("vocab_size"))

    @property
    def hidden_size(self) -> int | None:
        return _positive(self.text.get("hidden_size"))

    @property
    def num_hidden_layers(self) -> int | None:
        return _positive(self.text.get("num_hidden_layers"))

    @property
    def max_position_embeddings(self) -> int | None:
        """The target's context in positions; None when unknown or not a positive integer."""
        return _positive(self.text.get("max_position_embeddings"))


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
