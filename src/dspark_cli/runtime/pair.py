"""The public Python API: check and load a target + DSpark draft once, then generate per prompt.

    from dspark_cli.runtime.pair import Pair
    pair = Pair.load()                        # the shipped demo pair; Pair.load("Qwen/Qwen3-8B", "./my-draft", ...)
    result = pair.generate("def parse(line):", max_new_tokens=64)
    print(pair.decode(result.tokens))         # result.stats: one RoundRecord per round (metrics.summarize -> τ)

Loading has two steps, so that a caller can refuse bad input before any weight is read: `Pair.check` reads only
headers and configs (validate's rules, block size, top-k, Markov strategy name, device and dtype) and gives a
CheckedPair that encodes prompts and checks them against the target's context; `CheckedPair.load` reads the
weights (and warns about NaN/inf in the draft). `Pair.load` does both. `dspark generate` and `dspark eval` are
this API plus option parsing and rendering.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator, Sequence

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.devices import resolve_device, resolve_dtype
from dspark_cli.runtime.decode.markov import STRATEGIES, MarkovWeights, choose_strategy
from dspark_cli.runtime.decode.sampling import SamplingParams
from dspark_cli.runtime.decode.speculative import (
    GenerationResult,
    TokenCallback,
    autoregressive_generate,
    max_block_size,
    speculative_generate,
)
from dspark_cli.runtime.rounds import CONFIDENCE_RULES

MARKOV_CHOICES = ("auto", *STRATEGIES)
__all__ = ["Pair", "CheckedPair", "SamplingParams", "GenerationResult", "CONFIDENCE_RULES", "MARKOV_CHOICES",
           "first_divergence"]
GREEDY = SamplingParams()

# --- device, dtype, tokenizer ----------------------------------------------------------------------------------


def _device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """devices.resolve_device / resolve_dtype, their ValueError as one sentence naming the option."""
    try:
        torch_device = resolve_device(device)
    except ValueError as error:
        raise DsparkError(f"--device {error}.") from None
    try:
        return torch_device, resolve_dtype(dtype, torch_device)
    except ValueError as error:
        raise DsparkError(f"--dtype {error}.") from None


def load_tokenizer(target: str):
    from dspark_cli.runtime.checkpoint.target_files import load_target_tokenizer

    return load_target_tokenizer(target)


def stop_ids(target_model, tokenizer) -> list[int]:
    """The target's generation_config eos ids (int or list), else the tokenizer's eos."""
    config = getattr(target_model.model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter length when one extends the other), or None."""
    for index, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


# --- pre-load checks ---------------------------------------------------------------------------------------------


@dataclass
class PairCheck:
    """What check_pair resolved before any weights are loaded."""

    block_size: int  # draft tokens per round
    trained_block_size: int | None  # the most the draft was trained for (None: its config does not say)
    draft_topk: int | None  # candidate count of the gathered Markov strategies (None: dense)
    warnings: list[str]  # validate's warnings, one sentence each


def check_pair(ckpt, target_config: dict, block_size: int | None, draft_topk: int | None) -> PairCheck:
    """Pre-load checks of a draft checkpoint against its target's config.json: validate's rules (vocab,
    hidden size, depth, tensors), then the block size and --draft-topk. DsparkError names the first problem."""
    from dspark_cli.runtime.checkpoint.config import DraftConfig
    from dspark_cli.runtime.checkpoint.rules import VLLM_ONLY, validate_checkpoint

    report = validate_checkpoint(ckpt, target_config)
    errors = [f for f in report.errors if f.code not in VLLM_ONLY]  # dspark runs what only vLLM cannot serve
    if errors:
        first = errors[0]
        more = f" ({len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise DsparkError(f"{ckpt.source} cannot run with this target: {first.code} {first.message} Fix: "
                          f"{first.hint}{more} Run `dspark validate {ckpt.source} --target ...` for every finding.")
    config = DraftConfig.from_dict(ckpt.config)
    trained = max_block_size(config)
    if block_size is None:
        if trained is None:
            raise DsparkError(f"{ckpt.source}: config.json has no block_size; pass --block-size N.")
        block_size = trained
    if block_size < 1:
        raise DsparkError(f"--block-size must be at least 1, got {block_size}.")
    if trained is not None and block_size > trained:
        raise DsparkError(f"--block-size {block_size} is larger than the {trained} draft tokens per round "
                          f"{ckpt.source} was trained for; pass --block-size {trained} or less.")
    draft_topk = config.dspark_draft_topk if draft_topk is None else draft_topk
    vd = config.draft_vocab_size
    if draft_topk is not None and not 1 <= draft_topk <= vd:
        raise DsparkError(f"--draft-topk must be between 1 and the draft vocabulary size {vd}, got {draft_topk}.")
    warnings = [f"{f.code} {f.message}" for f in report.warnings + [e for e in report.errors if e not in errors]]
    return PairCheck(block_size, trained, draft_topk, warnings)


def context_limit(target_config: dict) -> int | None:
    """The target's max_position_embeddings (of its text config for a multimodal model), or None."""
    from dspark_cli.runtime.checkpoint.target_config import TargetConfig

    return TargetConfig.from_dict(target_config).max_position_embeddings


def check_context(prompt_lengths: Sequence[int], max_new_tokens: int, limit: int | None, source: str) -> None:
    """Refuse, before any weights are loaded, a prompt that cannot fit with its new tokens in the target's context
    (prefilling it would take minutes of uninterruptible work and the positions would be meaningless)."""
    if limit is None:
        return
    index, longest = max(enumerate(prompt_lengths), key=lambda item: item[1])
    if longest + max_new_tokens > limit:
        raise DsparkError(f"prompt {index + 1} has {longest:,} tokens, and with {max_new_tokens:,} new tokens that is "
                          f"{longest + max_new_tokens:,} positions, more than the {limit:,} of {source}'s context "
                          "(max_position_embeddings); shorten the prompt or ask for fewer new tokens.")


def nonfinite_weights(module: torch.nn.Module) -> list[str]:
    """Names of the floating-point parameters and buffers of `module` that hold NaN or inf."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [name for name, tensor in tensors if tensor.is_floating_point() and not torch.isfinite(tensor).all()]


def nonfinite_warning(source: str, names: list[str]) -> str | None:
    """One sentence about a draft whose weights hold NaN or inf, or None when they are all finite."""
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{source} has NaN or inf values in {len(names)} weight tensor(s) ({shown}): its proposals will mostly "
            "be rejected and its confidences are meaningless (the output is still exactly the target's).")


@contextlib.contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """transformers' download/loading progress bars off inside the block unless `shown` (then restored)."""
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    if not shown:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not shown:
            transformers_logging.enable_progress_bar()


# --- the pair ----------------------------------------------------------------------------------------------------


@dataclass
class CheckedPair:
    """A target + draft checked against each other from headers and configs only (Pair.check); no weights read."""

    target_source: str
    draft_source: str
    checkpoint: object  # runtime.checkpoint.Checkpoint of the draft (config + safetensors headers)
    target_config: dict
    device: torch.device
    dtype: torch.dtype
    markov: str  # requested: one of MARKOV_CHOICES
    confidence_threshold: float | None
    check: PairCheck

    @property
    def block_size(self) -> int:
        return self.check.block_size

    @property
    def draft_topk(self) -> int | None:
        return self.check.draft_topk

    @property
    def warnings(self) -> list[str]:
        return self.check.warnings

    @cached_property
    def tokenizer(self):
        return load_tokenizer(self.target_source)

    def chat(self, requested: bool | None = None) -> bool:
        """Whether prompts go through the chat template: `requested`, else whether the tokenizer has one."""
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if requested and not has_template:
            raise DsparkError(f"--chat: the tokenizer of {self.target_source} has no chat template; pass --no-chat.")
        return has_template if requested is None else requested

    def encode(self, text: str, chat: bool | None = None, thinking: bool | None = None) -> list[int]:
        """Token ids of one prompt (chat: see `chat`; thinking: the template's enable_thinking, None: not passed)."""
        from dspark_cli.runtime.decode.chat import encode_prompt

        return encode_prompt(self.tokenizer, text, self.chat(chat), self.target_source, thinking)

    def check_context(self, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
        """DsparkError when the longest prompt plus max_new_tokens exceeds the target's context."""
        check_context(prompt_lengths, max_new_tokens, context_limit(self.target_config), self.target_source)

    def load(self, progress: bool = True) -> "Pair":
        """Read the weights: the target (with hidden-state capture) and the draft sharing its embedding / head."""
        from dspark_cli.runtime.checkpoint.config import DraftConfig
        from dspark_cli.runtime.model.draft_io import load_draft
        from dspark_cli.runtime.model.target import TargetModel

        indices = DraftConfig.from_dict(self.checkpoint.config).hidden_state_indices
        with _progress_bars(progress):
            target = TargetModel.load(self.target_source, indices, dtype=self.dtype, device=self.device)
            draft = load_draft(self.checkpoint, target_embed=target.embed_weight,
                               target_lm_head=target.lm_head_weight, dtype=self.dtype, device=self.device)
        warnings = list(self.warnings)
        corrupt = nonfinite_warning(self.draft_source, nonfinite_weights(draft))
        if corrupt is not None:
            warnings.append(corrupt)
        if self.confidence_threshold is not None and draft.confidence_head is None:
            raise DsparkError(f"{self.draft_source} has no confidence head, so --confidence-threshold cannot be used.")
        return Pair(self, target, draft, stop_ids(target, self.tokenizer), warnings)


@dataclass
class Pair:
    """A loaded target + draft: generate (speculative, lossless) and baseline (plain decoding) per prompt."""

    checked: CheckedPair
    target: object  # runtime.target.TargetModel
    draft: object  # runtime.model.draft.DSparkDraft
    stop_ids: list[int]
    warnings: list[str] = field(default_factory=list)  # the check's, then NaN/inf in the draft's weights

    @classmethod
    def check(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int | None = None,
        draft_topk: int | None = None,
        markov: str = "auto",
        confidence_threshold: float | None = None,
    ) -> CheckedPair:
        """Resolve and check everything that needs no weights. target/draft: folder or hub id; both None: the demo
        pair. block_size / draft_topk None: the draft config's. DsparkError names the first problem."""
        from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
        from dspark_cli.runtime.demo import demo_pair
        from dspark_cli.runtime.io.paths import require_utf8_path
        from dspark_cli.runtime.checkpoint.target_files import check_target_files
        from dspark_cli.runtime.checkpoint.stateful import one_at_a_time_warning
        from dspark_cli.runtime.model.target_state import family_of_target

        if (target is None) != (draft is None):
            raise DsparkError("pass both --target and --draft, or neither to use the demo pair.")
        if target is None:
            target, draft = demo_pair()
        target, draft = str(target), str(draft)
        if confidence_threshold is not None and not 0.0 < confidence_threshold <= 1.0:
            raise DsparkError(f"--confidence-threshold must be in (0, 1], got {confidence_threshold}.")
        if markov not in MARKOV_CHOICES:
            raise DsparkError(f"--markov must be one of {', '.join(MARKOV_CHOICES)}, got {markov!r}.")
        torch_device, torch_dtype = _device_and_dtype(device, dtype)
        require_utf8_path(target, "--target")
        require_utf8_path(draft, "--draft")
        ckpt = open_checkpoint(draft)  # headers only
        target_config = read_target_config(target)
        built = check_target_files(target)  # config values and weight headers: one sentence before any weight is read
        family = family_of_target(built)  # DsparkError: a state dspark cannot roll back
        check = check_pair(ckpt, target_config, block_size, draft_topk)
        if family is not None and not family.block_scoring:
            check.warnings.append(one_at_a_time_warning(family))
        return CheckedPair(target, draft, ckpt, target_config, torch_device, torch_dtype, markov, confidence_threshold,
                           check)

    @classmethod
    def load(cls, target: str | Path | None = None, draft: str | Path | None = None, **options) -> "Pair":
        """Pair.check(target, draft, **options).load(): checked, then loaded (see Pair.check for the options)."""
        return cls.check(target, draft, **options).load()

    # --- what the check resolved ---

    @property
    def block_size(self) -> int:
        return self.checked.block_size

    @property
    def draft_topk(self) -> int | None:
        return self.checked.draft_topk

    @property
    def device(self) -> torch.device:
        return self.checked.device

    @property
    def tokenizer(self):
        return self.checked.tokenizer

    def encode(self, text: str, chat: bool | None = None, thinking: bool | None = None) -> list[int]:
        return self.checked.encode(text, chat, thinking)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    @property
    def draft_kind(self) -> str:
        """The draft's family and Markov head type, for reports: "Gemma-4 draft, rnn Markov head"."""
        config = self.draft.config
        head = f"{config.markov_head_type} Markov head" if config.markov_rank else "no Markov head"
        return f"{config.family_title} draft, {head}"

    def strategy(self, params: SamplingParams = GREEDY) -> str:
        """The Markov strategy the requested one resolves to under `params`; DsparkError when it cannot run."""
        markov = self.checked.markov
        try:
            return choose_strategy(markov, MarkovWeights.from_draft(self.draft), self.draft_topk, params,
                                   self.device.type == "cuda")
        except ValueError as error:
            raise DsparkError(f"--markov {markov}: {error}.") from None

    # --- generation ---

    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int = 128,
        params: SamplingParams = GREEDY,
        seed: int = 0,
        block_size: int | None = None,
        confidence_rule: str = "survival",
        confidence_temperatures: Sequence[float] | None = None,
        length_rule: str = "stop",
        stop_ids: Sequence[int] | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        """Speculative decoding of one prompt (text is encoded with `encode`; ids are used as they are).
        block_size / stop_ids None: the pair's; seed: of the torch.Generator every random draw uses;
        confidence_temperatures: STS temperatures for the confidences (calibration.load_temperatures)."""
        return speculative_generate(self.target, self.draft, self._ids(prompt), params,
                                    block_size=self.block_size if block_size is None else block_size,
                                    max_new_tokens=max_new_tokens, strategy=self.strategy(params),
                                    draft_topk=self.draft_topk, confidence_threshold=self.checked.confidence_threshold,
                                    confidence_rule=confidence_rule,
                                    confidence_temperatures=confidence_temperatures, length_rule=length_rule,
                                    stop_ids=self.stop_ids if stop_ids is None else stop_ids,
                                    generator=self._generator(seed), on_tokens=on_tokens)

    def baseline(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int = 128,
        params: SamplingParams = GREEDY,
        seed: int = 0,
        stop_ids: Sequence[int] | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        """Plain one-token-per-forward decoding of the same prompt by the target alone."""
        return autoregressive_generate(self.target, self._ids(prompt), params, max_new_tokens=max_new_tokens,
                                       stop_ids=self.stop_ids if stop_ids is None else stop_ids,
                                       generator=self._generator(seed), on_tokens=on_tokens)

    def warm_up(self, prompt, *, max_new_tokens: int, baseline: bool = False, params: SamplingParams = GREEDY,
                seed: int = 0, **options) -> None:
        """A short run of each decoder, so that first-call costs (allocators, kernels) do not land on the first
        prompt's timings. options: as for generate."""
        self.generate(prompt, max_new_tokens=min(max_new_tokens, self.block_size + 2), params=params, seed=seed,
                      **options)
        if baseline:
            self.baseline(prompt, max_new_tokens=min(max_new_tokens, 4), params=params, seed=seed)

    def _ids(self, prompt: str | Sequence[int] | torch.Tensor):
        return self.encode(prompt) if isinstance(prompt, str) else prompt

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)
