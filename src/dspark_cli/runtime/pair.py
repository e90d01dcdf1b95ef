"""The public Python API: check and load a target + DSpark draft once, then generate per prompt.

    from dspark_cli.runtime.pair import Pair
    pair = Pair.load()                        # the shipped demo pair; Pair.load("Qwen/Qwen3-8B", "./my-draft", ...)
    result = pair.generate("def parse(line):", max_new_tokens=64)
    print(pair.decode(result.tokens))         # result.stats: one RoundRecord per round (metrics.summarize -> τ)

Loading has two steps, so that a caller can refuse bad input before any weight is read: `Pair.check` reads only
headers and configs (validate's rules, device and dtype) and resolves the decode settings once
(settings.resolve_settings: block size, draft top-k, Markov strategy, sampling, verify and length rules), giving a
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

from dspark_cli.errors import DsparkError, SettingError
from dspark_cli.runtime.decode.speculative import (
    GenerationResult,
    TokenCallback,
    autoregressive_generate,
    speculative_generate,
)
from dspark_cli.runtime.devices import resolve_device, resolve_dtype
from dspark_cli.runtime.rounds import CONFIDENCE_RULES
from dspark_cli.runtime.settings import (
    MARKOV_CHOICES,
    DecodeSettings,
    MarkovHead,
    Requested,
    SamplingParams,
    resolve_settings,
)

__all__ = ["Pair", "CheckedPair", "SamplingParams", "DecodeSettings", "Requested", "GenerationResult",
           "CONFIDENCE_RULES", "MARKOV_CHOICES", "first_divergence"]

# --- device, dtype, tokenizer ----------------------------------------------------------------------------------


def _device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """devices.resolve_device / resolve_dtype, their ValueError as a SettingError naming the setting."""
    try:
        torch_device = resolve_device(device)
    except ValueError as error:
        raise SettingError("device", f"{error}.") from None
    try:
        return torch_device, resolve_dtype(dtype, torch_device)
    except ValueError as error:
        raise SettingError("dtype", f"{error}.") from None


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


def check_draft(ckpt, target_config: dict):
    """validate's rules on a draft checkpoint against its target's config.json -> validate's Report; DsparkError
    names the first error dspark itself cannot run (what only a serving engine refuses is a warning here)."""
    from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
    from dspark_cli.runtime.engines import ENGINE_ONLY_CODES

    report = validate_checkpoint(ckpt, target_config)
    errors = [f for f in report.errors if f.code not in ENGINE_ONLY_CODES]  # dspark runs what an engine refuses
    if errors:
        first = errors[0]
        more = f" ({len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise DsparkError(f"{ckpt.source} cannot run with this target: {first.code} {first.message} Fix: "
                          f"{first.hint}{more} Run `dspark validate {ckpt.source}` with the target option for "
                          "every finding.")
    return report


def report_warnings(report) -> list[str]:
    """validate's warnings, and the errors only a serving engine refuses, one sentence each."""
    from dspark_cli.runtime.engines import ENGINE_ONLY_CODES

    engine_only = [f for f in report.errors if f.code in ENGINE_ONLY_CODES]
    return [f"{f.code} {f.message}" for f in report.warnings + engine_only]


def nvfp4_head(report) -> bool:
    """Whether validate found markov_w2 stored as NVFP4."""
    return (report.resolved.get("head_format") or "").startswith("nvfp4")


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
    settings: DecodeSettings  # resolved once, here
    warnings: list[str]  # validate's warnings (and what only vLLM refuses), one sentence each
    draft_config: object  # runtime.checkpoint.config.DraftConfig
    head: MarkovHead

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    @property
    def draft_topk(self) -> int | None:
        return self.settings.draft_topk

    def resolve(self, **changes) -> DecodeSettings:
        """The settings with some requests changed (Requested's fields), resolved by the same rules as the check:
        e.g. pair.generate(prompt, settings=pair.checked.resolve(temperature=1.0))."""
        from dataclasses import replace

        requested = replace(self.settings.requested, **changes)
        return resolve_settings(self.draft_config, self.head, self.device.type == "cuda", requested,
                                self.settings.verify.temperatures)

    @cached_property
    def tokenizer(self):
        return load_tokenizer(self.target_source)

    def chat(self, requested: bool | None = None) -> bool:
        """Whether prompts go through the chat template: `requested`, else whether the tokenizer has one."""
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if requested and not has_template:
            raise DsparkError(f"the chat option: the tokenizer of {self.target_source} has no chat template; pass "
                              "the no-chat option.")
        return has_template if requested is None else requested

    def encode(self, text: str, chat: bool | None = None, thinking: bool | None = None) -> list[int]:
        """Token ids of one prompt (chat: see `chat`; thinking: the template's enable_thinking, None: not passed)."""
        from dspark_cli.runtime.decode.chat import encode_prompt

        return encode_prompt(self.tokenizer, text, self.chat(chat), self.target_source, thinking)

    def check_context(self, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
        """DsparkError when the longest prompt plus max_new_tokens exceeds the target's context."""
        check_context(prompt_lengths, max_new_tokens, context_limit(self.target_config), self.target_source)

    def load(self, progress: bool = True, target=None) -> "Pair":
        """Read the weights: the target (with hidden-state capture) and the draft sharing its embedding / head.
        `target`: an already loaded TargetModel of this target capturing the draft's hidden states (Pair.with_draft)."""
        from dspark_cli.runtime.model.draft_io import load_draft
        from dspark_cli.runtime.model.target import TargetModel

        indices = self.draft_config.hidden_state_indices
        with _progress_bars(progress):
            if target is None:
                target = TargetModel.load(self.target_source, indices, dtype=self.dtype, device=self.device)
            draft = load_draft(self.checkpoint, target_embed=target.embed_weight,
                               target_lm_head=target.lm_head_weight, dtype=self.dtype, device=self.device)
        warnings = list(self.warnings)
        corrupt = nonfinite_warning(self.draft_source, nonfinite_weights(draft))
        if corrupt is not None:
            warnings.append(corrupt)
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
        temperatures: Sequence[float] | None = None,
        **requested,
    ) -> CheckedPair:
        """Resolve and check everything that needs no weights. target/draft: folder or hub id; both None: the demo
        pair. requested: settings.Requested's fields (block_size, draft_topk, markov, temperature, top_p, top_k,
        confidence_threshold, confidence_rule, length_rule), None / "auto" meaning the draft's own; temperatures:
        STS temperatures for the confidences (calibration.load_temperatures). DsparkError names the first problem
        (a SettingError names the setting)."""
        from dspark_cli.runtime.checkpoint.config import DraftConfig
        from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
        from dspark_cli.runtime.checkpoint.stateful import one_at_a_time_warning
        from dspark_cli.runtime.checkpoint.target_files import check_target_files
        from dspark_cli.runtime.demo import demo_pair
        from dspark_cli.runtime.io.paths import non_utf8_problem
        from dspark_cli.runtime.model.target_state import family_of_target

        if (target is None) != (draft is None):
            raise DsparkError("give both a target and a draft, or neither to use the demo pair.")
        if target is None:
            target, draft = demo_pair()
        target, draft = str(target), str(draft)
        wanted = Requested(**requested)
        torch_device, torch_dtype = _device_and_dtype(device, dtype)
        for setting, path in (("target", target), ("draft", draft)):
            problem = non_utf8_problem(path)
            if problem is not None:
                raise SettingError(setting, problem)
        ckpt = open_checkpoint(draft)  # headers only
        target_config = read_target_config(target)
        built = check_target_files(target)  # config values and weight headers: one sentence before any weight is read
        family = family_of_target(built)  # DsparkError: a state dspark cannot roll back
        report = check_draft(ckpt, target_config)
        config = DraftConfig.from_dict(ckpt.config)
        head = MarkovHead.of_config(config, nvfp4_head(report))
        kept = None if temperatures is None else tuple(temperatures)
        settings = resolve_settings(config, head, torch_device.type == "cuda", wanted, kept)
        warnings = report_warnings(report)
        if family is not None and not family.block_scoring:
            warnings.append(one_at_a_time_warning(family))
        return CheckedPair(target, draft, ckpt, target_config, torch_device, torch_dtype, settings, warnings, config,
                           head)

    @classmethod
    def load(cls, target: str | Path | None = None, draft: str | Path | None = None, **options) -> "Pair":
        """Pair.check(target, draft, **options).load(): checked, then loaded (see Pair.check for the options)."""
        return cls.check(target, draft, **options).load()

    def with_draft(self, draft: str | Path) -> "Pair":
        """This pair's loaded target with another draft, checked against it as Pair.check does, with the same
        device, dtype and requested settings; only the draft's weights are read. The new draft must capture the same
        target hidden states (else load a new pair)."""
        checked = Pair.check(self.checked.target_source, draft, device=str(self.device),
                             dtype=str(self.checked.dtype).removeprefix("torch."),
                             temperatures=self.checked.settings.verify.temperatures,
                             **self.checked.settings.requested.to_dict())
        if list(checked.draft_config.hidden_state_indices) != self.target.capture_indices:
            raise DsparkError(f"the draft {draft} reads other target layers than {self.checked.draft_source}; load "
                              "it as a pair of its own.")
        return checked.load(progress=False, target=self.target)

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
        """The draft's family and Markov head type, for reports: "Gemma-4 draft, rnn Markov head" (a DFlash2
        draft: "DFlash2 draft, path selector")."""
        config = self.draft.config
        if config.has_selector:
            stage = "path selector"
        else:
            stage = f"{config.markov_head_type} Markov head" if config.markov_rank else "no Markov head"
        return f"{config.family_title} draft, {stage}"

    @property
    def settings(self) -> DecodeSettings:
        return self.checked.settings

    # --- generation ---

    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int = 128,
        seed: int = 0,
        settings: DecodeSettings | None = None,
        stop_ids: Sequence[int] | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        """Speculative decoding of one prompt (text is encoded with `encode`; ids are used as they are).
        settings / stop_ids None: the pair's (other settings: `self.checked.resolve(...)`); seed: of the
        torch.Generator every random draw uses."""
        return speculative_generate(self.target, self.draft, self._ids(prompt), settings or self.settings,
                                    max_new_tokens=max_new_tokens,
                                    stop_ids=self.stop_ids if stop_ids is None else stop_ids,
                                    generator=self._generator(seed), on_tokens=on_tokens)

    def baseline(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int = 128,
        seed: int = 0,
        settings: DecodeSettings | None = None,
        stop_ids: Sequence[int] | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        """Plain one-token-per-forward decoding of the same prompt by the target alone, with the settings'
        sampling."""
        sampling = (settings or self.settings).sampling
        return autoregressive_generate(self.target, self._ids(prompt), sampling, max_new_tokens=max_new_tokens,
                                       stop_ids=self.stop_ids if stop_ids is None else stop_ids,
                                       generator=self._generator(seed), on_tokens=on_tokens)

    def warm_up(self, prompt, *, max_new_tokens: int, baseline: bool = False, seed: int = 0,
                settings: DecodeSettings | None = None) -> None:
        """A short run of each decoder, so that first-call costs (allocators, kernels) do not land on the first
        prompt's timings."""
        self.generate(prompt, max_new_tokens=min(max_new_tokens, self.block_size + 2), seed=seed, settings=settings)
        if baseline:
            self.baseline(prompt, max_new_tokens=min(max_new_tokens, 4), seed=seed, settings=settings)

    def _ids(self, prompt: str | Sequence[int] | torch.Tensor):
        return self.encode(prompt) if isinstance(prompt, str) else prompt

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)
