"""TargetModel: a transformers causal LM behind the three calls speculative decoding needs.

    target = TargetModel.load("Qwen/Qwen3-8B", capture_indices=draft.config.hidden_state_indices)
    logits, features = target.prefill(prompt_ids)      # [V], [T, n*Ht]
    logits, features = target.score(block_ids)         # [k+1, V], [k+1, n*Ht]; appends to the cache
    target.crop(committed_length)                      # roll the cache back after a rejection

A stateful target (Gated DeltaNet, Mamba, short-conv or lightning-attention layers: Qwen3.5, Qwen3-Next, Falcon-H1,
Jamba, Bamba, Granite-4 hybrids, LFM2, Mamba2, MiniMax) gets the cache its own generate builds and an exact
rollback of its states (model/target_state.py): `save_state` before a score pass, `crop` after it.

Features are the hidden states the draft reads, by capture index = target layer id + 1 (DeepSpec's
and vLLM's convention), captured with forward hooks so that only those few tensors are kept: index 0 is
the embedding output and index i in 1..L the raw output of decoder layer i-1 (the residual stream).
That equals HF `output_hidden_states[i]` except for i = L, where transformers stores the final norm's
output instead; DeepSpec's target cache and vLLM's aux capture both use the raw layer output, so dspark
does too (DeepSpec refuses drafts that read layer L-1; `dspark validate` reports them as DSP034).

transformers 5.x portability (docs/development.md §4): the cache kwarg is `cache` from 5.24 and
`past_key_values` before (`cache_params` for Mamba2 before 5.24); `DynamicCache.crop` takes a negative delta
everywhere (a positive length is rejected by 5.24), so `crop` always passes one.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.target_files import first_line, refuse_pickle_only
from dspark_cli.runtime.model.target_state import StateRollback, build_cache, stateful_family


def _refuse_missing_weights(path: str | Path, missing: set[str] | list[str]) -> None:
    """transformers reports (and randomly initialises) weights the files lack; tied weights are not missing."""
    if missing:
        names = sorted(missing)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise DsparkError(f"the target {path} lacks {len(names)} weight tensor(s) its config needs ({shown}); "
                          "transformers would fill them with random values, so its output would be noise. "
                          "Download or save the complete model.")


def _refuse_mismatched_weights(path: str | Path, mismatched: list) -> None:
    """Weights whose stored shape differs from the one config.json implies (a header that lies about a shape)."""
    if mismatched:
        names = sorted(str(entry[0] if isinstance(entry, (tuple, list)) else entry) for entry in mismatched)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise DsparkError(f"the target {path} stores {len(names)} weight tensor(s) in a shape its config.json does "
                          f"not imply ({shown}); the weights and the config do not belong together, re-download "
                          "the model.")


def load_causal_lm(path: str | Path, *, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """AutoModelForCausalLM.from_pretrained on `device` in `dtype`: safetensors only (a pickle is never
    opened: unpickling can run code), never trust_remote_code, and every weight must come from the files
    (transformers would fill a missing one with random values and only log it)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    refuse_pickle_only(path)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its load report would repeat the refusal below as a table
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=False,
                                                           use_safetensors=True, output_loading_info=True,
                                                           ignore_mismatched_sizes=True)  # refused below, by name
    except (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)) as error:
        raise DsparkError(f"not enough memory to load the target model {path} in {dtype} ({first_line(error)}); "
                          "free memory or pick a smaller dtype option.") from error
    except Exception as error:  # transformers and safetensors raise many types for broken files
        raise DsparkError(f"cannot load the target model {path} ({first_line(error)}). It must be a Hugging Face "
                          "causal LM folder or hub id (config.json + safetensors); re-download it.") from error
    finally:
        transformers_logging.set_verbosity(verbosity)
    _refuse_missing_weights(path, info["missing_keys"])
    _refuse_mismatched_weights(path, info.get("mismatched_keys") or [])
    return model.to(device)


def cache_keyword(model: nn.Module) -> str:
    """The forward argument that takes the cache: `cache` from transformers 5.24, `past_key_values` before, and
    `cache_params` for Mamba2 in 5.17/5.18 (where an unknown keyword would be swallowed and the cache left empty)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values", "cache_params") if name in parameters),
                "past_key_values")


class TargetModel:
    """One sequence (batch 1) of a causal LM with its cache, hidden-state capture and exact rollback."""

    def __init__(self, model: nn.Module, capture_indices: Sequence[int] = ()):
        self.model = model.eval()
        self.config = model.config.get_text_config()
        self.capture_indices = list(capture_indices)
        self.cache_kwarg = cache_keyword(model)
        self.family = stateful_family(model.config, type(model))  # None: attention only
        self.state = None if self.family is None else StateRollback(model, self.family)
        self.length = 0  # positions in the cache (a Mamba2 cache has no attention layer to ask)
        self.cache = self._new_cache()
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False
        self._install_hooks()

    @classmethod
    def load(
        cls,
        path: str | Path,
        capture_indices: Sequence[int] = (),
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> "TargetModel":
        """The causal LM at `path` (see load_causal_lm) on `device` in `dtype`, capturing `capture_indices`."""
        return cls(load_causal_lm(path, dtype=dtype, device=device), capture_indices)

    # --- geometry and shared weights -----------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # [V, H]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [V, H]

    @property
    def cache_length(self) -> int:
        """Positions in the cache: the attention cache's own count, or for a stateful target (whose cache may
        have no attention layer at all, Mamba2) the count kept by _forward and crop."""
        return self.length if self.state is not None else self.cache.get_seq_length()

    @property
    def scores_one_at_a_time(self) -> bool:
        """True where transformers cannot continue this target's cache with several tokens in one forward (Jamba):
        score() then runs one forward per token (exact, slower than plain decoding)."""
        return self.family is not None and not self.family.block_scoring

    # --- forwards --------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a new sequence. [T] int64 -> (logits of the last position [V], features [T, n*Ht])."""
        self.cache = self._new_cache()
        logits = self._forward(prompt_ids, capture=True, logits_to_keep=self._last_position(len(prompt_ids)))
        return logits[-1], self._take_features()

    def _last_position(self, length: int) -> int | torch.Tensor:
        """logits_to_keep for the last position's logits alone: 1, or the position as a tensor on a target whose
        KV-sharing layers (Gemma-4 E2B / E4B: num_kv_shared_layers) include a captured one, since transformers runs
        those layers on the kept positions only when logits_to_keep is an int (Gemma4TextModel
        _maybe_slice_kv_shared_inputs), which would leave their hidden states one position long."""
        text = self.config.get_text_config()
        shared = getattr(text, "num_kv_shared_layers", 0) or 0
        if not shared:
            return 1
        first_shared = text.num_hidden_layers - shared  # the first layer that reuses another layer's K/V
        if any(index - 1 >= first_shared for index in self.capture_indices):
            return torch.tensor([length - 1], device=self.device)
        return 1

    @torch.inference_mode()
    def score(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Score [anchor, d1..dk] after the cached context and append them to the cache.
        [k+1] int64 -> (logits [k+1, V], features [k+1, n*Ht]). A stateful target remembers what it needs to
        keep only a prefix of the block (crop)."""
        if self.state is None:
            logits = self._forward(block_ids, capture=True)
            return logits, self._take_features()
        self.state.begin_score(self.cache, self.length, len(block_ids))
        try:
            if self.family.block_scoring:
                logits = self._forward(block_ids, capture=True)
                return logits, self._take_features()
            return self._score_one_at_a_time(block_ids)
        finally:
            self.state.end_score()

    def _score_one_at_a_time(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, features = [], []
        for position in range(len(block_ids)):
            logits.append(self._forward(block_ids[position : position + 1], capture=True)[-1])  # [V]
            features.append(self._take_features())  # [1, n*Ht]
            self.state.after_position(self.cache)
        return torch.stack(logits), torch.cat(features)  # [k+1, V], [k+1, n*Ht]

    def save_state(self) -> None:
        """Snapshot a stateful target's recurrent / conv states before the next score where its rollback needs one
        (a no-op for attention-only and Gated DeltaNet targets, without entering inference mode: the loop calls it
        every round); score() takes it itself when not called first. The speculative loop times it as `snapshot`."""
        if self.state is not None and self.state.needs_snapshot:
            with torch.inference_mode():
                self.state.save(self.cache, self.length)

    @torch.inference_mode()
    def decode_one(self, token: int) -> torch.Tensor:
        """Plain autoregressive step (the baseline): append `token`, return the next-token logits [V]."""
        ids = torch.tensor([token], dtype=torch.long, device=self.device)
        return self._forward(ids, capture=False)[-1]

    @torch.inference_mode()
    def prefill_plain(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Start a new sequence without capturing features (the baseline). [T] -> last logits [V]."""
        self.cache = self._new_cache()
        return self._forward(prompt_ids, capture=False, logits_to_keep=1)[-1]

    def crop(self, length: int) -> None:
        """Keep the first `length` cached positions (a negative delta: portable across transformers 5.x).

        A stateful target can only go back into its last scored block: its states are set to those at the kept
        position (target_state.StateRollback.keep). An attention-only crop slices the K/V (views): no inference
        mode to enter."""
        excess = self.cache_length - length
        if excess < 0:
            raise ValueError(f"cannot crop the target cache to {length}: it holds only {self.cache_length} positions")
        if self.state is None:
            if excess:
                self.cache.crop(-excess)
        else:
            scored = self.state.scored
            if scored is None and excess:
                raise ValueError(f"a {self.family.name} target can only roll back into the block it scored last")
            if scored is not None:
                if length < scored.start:
                    raise ValueError(f"cannot crop the {self.family.name} target to {length}: its last scored block "
                                     f"starts at {scored.start}")
                with torch.inference_mode():  # the states are inference tensors, written in place
                    self.state.keep(self.cache, length - scored.start)
        self.length = length

    # --- internals -------------------------------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, *, capture: bool, logits_to_keep: int = 0) -> torch.Tensor:
        """[T] int64 -> logits [T or logits_to_keep, V]; the cache grows by T. Positions are passed as generate
        passes them: some models count from 0 at every call when left to themselves (Bamba in transformers 5.24)."""
        self._capturing = capture
        try:
            positions = torch.arange(self.length, self.length + len(ids), device=ids.device)[None]  # [1, T]
            out = self.model(input_ids=ids[None], position_ids=positions, use_cache=True,
                             logits_to_keep=logits_to_keep, **{self.cache_kwarg: self.cache})
        finally:
            self._capturing = False
        self.length += len(ids)
        return out.logits[0]

    def _take_features(self) -> torch.Tensor:
        """The captured hidden states, concatenated in the draft's order: [T, n*Ht]."""
        try:
            parts = [self._captured[index][0] for index in self.capture_indices]  # n x [T, Ht]
        finally:
            self._captured = {}
        return torch.cat(parts, dim=-1)

    def _install_hooks(self) -> None:
        decoder = self.model.get_decoder()
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise DsparkError(f"the target {type(self.model).__name__} has no `layers` list in its decoder; dspark "
                              "reads hidden states from decoder layers (Qwen3, Llama, Mistral, Gemma-style models).")
        depth = len(layers)
        for index in self.capture_indices:
            if not 0 <= index <= depth:
                raise DsparkError(f"the draft reads target hidden state {index} (layer id {index - 1}) but the target "
                                  f"has {depth} layers; the draft was trained for a different target.")
            module = decoder.get_input_embeddings() if index == 0 else layers[index - 1]  # never the final norm
            module.register_forward_hook(self._capture_hook(index))

    def _capture_hook(self, index: int):
        def hook(module: nn.Module, inputs, output) -> None:
            if self._capturing:
                self._captured[index] = output[0] if isinstance(output, tuple) else output  # [1, T, Ht]

        return hook

    def _new_cache(self):
        """A lazily laid out DynamicCache for an attention-only target (every layer a full K/V layer, croppable at
        any length); for a stateful one, the cache its own generate builds (target_state.build_cache)."""
        from transformers import DynamicCache

        self.length = 0
        if self.state is None:
            return DynamicCache()
        self.state.reset()
        return build_cache(self.model)
