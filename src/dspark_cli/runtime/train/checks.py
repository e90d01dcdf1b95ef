"""Checks that `dspark train` runs before it allocates anything: the window against the target's context and
the block, one step's memory against what the device has, and a --resume checkpoint against this run.

Every refusal is one sentence (DsparkError, exit 2) naming the value, the file or the key, and what to do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.families import family_for
from dspark_cli.runtime.checkpoint.target_config import TargetConfig
from dspark_cli.runtime.train.options import TRAINER_JSON, TRAINER_STATE, TrainOptions
from dspark_cli.runtime.units import format_bytes

if TYPE_CHECKING:
    import torch

    from dspark_cli.runtime.train.new_draft import DraftShape

MAX_JSON_BYTES = 16 << 20  # trainer_state.json / config.json of a checkpoint are a few kB
LOGIT_COPIES = 4  # [B, A*K, V] fp32 tensors alive at the loss, at least: log q, q, p, |q - p| (and more)


# --- the training window -------------------------------------------------------------------

def check_window(requested: int, seq_len: int, data_tokens: int, block_size: int, max_positions: int | None) -> None:
    """A window (`requested` tokens, `seq_len` once cut to the data) holds an anchor and its whole block's labels,
    within the target's context."""
    if max_positions and block_size >= max_positions:
        raise DsparkError(f"the block-size option {block_size} does not fit the target's context "
                          f"(max_position_embeddings {max_positions}) with its anchor; use a block of at most "
                          f"{max_positions - 1} tokens "
                          "(DeepSpec's Qwen3 drafts use 7).")
    if max_positions and requested > max_positions:
        raise DsparkError(f"the seq-len option {requested} is longer than the target's context "
                          f"(max_position_embeddings {max_positions}); use the seq-len option {max_positions} or less.")
    if seq_len <= block_size:
        raise DsparkError(f"the seq-len option {seq_len} is too short for the block-size option {block_size}: a "
                          f"window needs the anchor plus {block_size} labels; use the seq-len option {block_size + 1} "
                          "or more.")
    if data_tokens <= block_size:
        raise DsparkError(f"the training data tokenizes to {data_tokens} tokens, fewer than one anchor plus "
                          f"the block-size option {block_size} labels; give more text or a smaller value of the "
                          "block-size option.")


# --- memory ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryEstimate:
    """A lower estimate of one training step's peak memory, in bytes."""

    target_weights: int
    draft_state: int  # trainable fp32 weights + gradients + two AdamW moments
    activations: int  # target states and logits, the draft's logits, attention scores and saved layer inputs

    @property
    def total(self) -> int:
        return self.target_weights + self.draft_state + self.activations


def decoder_layer_parameters(config: dict) -> int:
    """Weights of one Qwen3 decoder layer (attention with q/k norms, gated MLP, two norms). A config without
    attention heads or an MLP width (a pure state-space target such as Mamba2) counts a transformer layer's
    12 H^2 per layer, the same order as a Mamba2 block with expand 2."""
    if "num_attention_heads" not in config or "intermediate_size" not in config:
        return 12 * config["hidden_size"] ** 2
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return hidden * head_dim * 2 * (heads + kv_heads) + 3 * hidden * config["intermediate_size"] + 2 * (
        hidden + head_dim)


def estimate_memory(target: dict, draft: dict, *, batch_size: int, seq_len: int, anchors: int,
                    trainable_rows: int, half_precision: bool) -> MemoryEstimate:
    """Memory of one step for a target config and a draft config (both as in config.json).

    trainable_rows: rows of embedding / lm_head copies the draft trains (0 when they are the target's, frozen).
    """
    weight_bytes = 2 if half_precision else 4
    vocab, width, depth = target["vocab_size"], target["hidden_size"], target["num_hidden_layers"]
    tied = target.get("tie_word_embeddings", False)
    target_params = depth * decoder_layer_parameters(target) + vocab * width * (1 if tied else 2) + width
    hidden, rank, layers = draft["hidden_size"], draft.get("markov_rank") or 0, draft["num_hidden_layers"]
    draft_vocab = draft.get("draft_vocab_size") or draft["vocab_size"]
    features = len(draft["target_layer_ids"]) * width
    confidence = hidden + (rank if draft.get("confidence_head_with_markov") else 0) + 1
    draft_params = (layers * decoder_layer_parameters(draft) + features * hidden + 2 * hidden  # fc, two norms
                    + rank * (draft["vocab_size"] + draft_vocab) + trainable_rows * hidden
                    + (confidence if draft.get("enable_confidence_head") else 0))
    queries = anchors * draft["block_size"]
    keys = seq_len + queries
    # The target's forward keeps no logits and no per-layer outputs: the captured layers and the post-norm last
    # state (float32 for the draft), one decoder layer's activations at a time (residual, attention and MLP
    # inputs), and its distribution at the anchor-block slots only (logits and softmax, float32).
    target_states = (batch_size * seq_len * ((features + width) * 4 + 4 * width * weight_bytes)
                     + batch_size * queries * vocab * 4 * 2)
    logits = batch_size * queries * draft_vocab * 4 * LOGIT_COPIES
    scores = layers * batch_size * draft["num_attention_heads"] * queries * keys * 4 * 2  # scores and softmax
    attention = scores + batch_size * queries * keys  # + the boolean mask
    saved = layers * batch_size * keys * (6 * hidden + 3 * draft["intermediate_size"]) * 4
    return MemoryEstimate(target_params * weight_bytes, draft_params * 16,
                          target_states + logits + attention + saved)


def check_memory(estimate: MemoryEstimate, available: int | None, device) -> None:
    if available is None or estimate.total <= available:
        return
    size = [format_bytes(count, decimal=True) for count in
            (estimate.total, estimate.draft_state, estimate.activations, estimate.target_weights, available)]
    raise DsparkError(f"one training step needs about {size[0]} ({size[1]} for the draft's weights and optimizer "
                      f"state, {size[2]} for activations, {size[3]} for the target) but {device} has {size[4]} free; "
                      "lower the batch-size option, the seq-len option, the anchors option, the block-size option, "
                      "the layers option or the markov-rank option.")


# --- resuming --------------------------------------------------------------------------------------------------

def read_json_object(path: Path, what: str) -> dict:
    """A small JSON object file, or one sentence saying what is wrong with it."""
    if not path.is_file():
        raise DsparkError(f"{path} is missing; {what}")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise DsparkError(f"{path} is {format_bytes(path.stat().st_size, decimal=True)}, too large for a checkpoint's "
                          f"JSON; {what}")
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = "nested too deeply" if isinstance(error, RecursionError) else "not valid JSON"
        raise DsparkError(f"{path} is {reason}; {what}") from None
    if not isinstance(value, dict):
        raise DsparkError(f"{path} holds a JSON {type(value).__name__}, not an object; {what}")
    return value


REDO = "the resume option takes a checkpoint-N folder written by `dspark train`; pick an earlier intact checkpoint."


def _resume_folder(folder: Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise DsparkError(f"the resume option {folder}: no such folder; {REDO}")
    return folder


@dataclass
class ResumePoint:
    """What a checkpoint folder gives --resume: the draft's config, the trainer's JSON state and tensors."""

    folder: Path
    config: dict
    state: dict  # step, options, param_groups
    tensors: dict  # name -> torch.Tensor (draft.*, optimizer.*, generator)

    @property
    def step(self) -> int:
        return self.state["step"]


def read_resume_point(folder: Path) -> ResumePoint:
    """config.json, trainer_state.json and trainer_state.safetensors of a checkpoint, checked for shape."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = _resume_folder(folder)
    config = read_json_object(folder / "config.json", REDO)
    state = read_json_object(folder / TRAINER_JSON, REDO)
    step, groups = state.get("step"), state.get("param_groups")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise DsparkError(f"{folder / TRAINER_JSON}: key 'step' is {step!r}, not a step count; {REDO}")
    if not (isinstance(groups, list) and groups and all(isinstance(g, dict) and "params" in g for g in groups)):
        raise DsparkError(f"{folder / TRAINER_JSON}: key 'param_groups' is missing or malformed; {REDO}")
    state_file = folder / TRAINER_STATE
    if not state_file.is_file():
        raise DsparkError(f"{state_file} is missing; {REDO}")
    try:
        tensors = load_file(str(state_file))
    except (SafetensorError, OSError, ValueError) as error:
        raise DsparkError(f"{state_file} cannot be read ({error}); it is truncated or not a safetensors file; "
                          f"{REDO}") from None
    if "generator" not in tensors:
        raise DsparkError(f"{state_file} has no 'generator' tensor; {REDO}")
    return ResumePoint(folder, config, state, tensors)


GEOMETRY_KEYS = {"layers": "num_hidden_layers", "block_size": "block_size", "markov_rank": "markov_rank",
                 "target_layers": "target_layer_ids", "confidence": "enable_confidence_head",
                 "mask_token_id": "mask_token_id", "markov_head_type": "markov_head_type"}


def check_resume_shape(point: ResumePoint, shape, target: TargetConfig, steps: int) -> None:
    """The checkpoint must be this shape (a DraftShape), for this target, and short of `steps`."""
    config, where = point.config, point.folder / "config.json"
    family = family_for(config.get("architectures") or []).name
    if shape.arch is not None and shape.arch != family:
        raise DsparkError(f"{where}: the checkpoint is a {family} draft but this run asks for the draft-arch option "
                          f"{shape.arch}; resume with the checkpoint's family (or omit the draft-arch option).")
    ids = config.get("target_layer_ids")
    for key in ("num_hidden_layers", "block_size", "markov_rank", "hidden_size", "intermediate_size",
                "num_attention_heads", "vocab_size", "mask_token_id"):
        if not _count(config.get(key)) or (config[key] == 0 and key not in ("markov_rank", "mask_token_id")):
            raise DsparkError(f"{where}: key {key!r} is {config.get(key)!r}, not a valid size or id; "
                              "pick an earlier intact checkpoint.")
    if not (isinstance(ids, list) and ids and all(_count(i + 1 if isinstance(i, int) else i) for i in ids)):
        raise DsparkError(f"{where}: key 'target_layer_ids' is {ids!r}, not a list of layer ids; pick an earlier "
                          "intact checkpoint.")
    for field, key in GEOMETRY_KEYS.items():
        wanted = getattr(shape, field)
        if wanted is None:  # not pinned: the checkpoint's value is used
            continue
        have = config.get(key)
        if isinstance(have, list):
            wanted = list(wanted)
        if have != wanted:
            flag = "--" + field.replace("_", "-")
            raise DsparkError(f"{where}: {key} is {have!r} but this run asks for {flag} {wanted!r}; resume with "
                              f"the checkpoint's value (or omit {flag}) or start a new run.")
    with_markov = bool(shape.confidence and shape.confidence_with_markov and shape.markov_rank)
    if bool(config.get("confidence_head_with_markov")) != with_markov:
        raise DsparkError(f"{where}: confidence_head_with_markov is {config.get('confidence_head_with_markov')!r} "
                          "but this run asks otherwise; resume with the checkpoint's choice (the "
                          "confidence-with-markov option or the confidence-without-markov option) or start a new run.")
    rows = target.vocab_size
    vocab, mask = config.get("vocab_size"), config.get("mask_token_id")
    if vocab not in (rows, rows + 1) or (vocab == rows + 1 and mask != rows):
        raise DsparkError(f"{where}: vocab_size {vocab!r} does not fit this target's vocabulary ({rows}, or {rows + 1} "
                          "with an added mask row); resume with the target the checkpoint was trained for.")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if config.get(key) != target.text.get(key):
            raise DsparkError(f"{where}: {key} is {config.get(key)!r} but the target's is {target.text.get(key)!r}; "
                              "resume with the target the checkpoint was trained for.")
    if point.step >= steps:
        raise DsparkError(f"{point.folder} is at step {point.step}, already at or past the steps option {steps}; raise "
                          "the steps option to continue training.")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def checkpoint_shape(folder: Path):
    """The DraftShape a checkpoint folder was trained with, from its config.json (for options a resumed run
    does not pin)."""
    from dspark_cli.runtime.train.new_draft import DraftShape

    config = read_json_object(_resume_folder(folder) / "config.json", REDO)
    ids = config.get("target_layer_ids")
    rank = config.get("markov_rank")
    return DraftShape(layers=config.get("num_hidden_layers"), block_size=config.get("block_size"),
                      target_layers=tuple(ids) if isinstance(ids, list) else ids, markov_rank=rank,
                      confidence=config.get("enable_confidence_head"),
                      confidence_with_markov=bool(config.get("confidence_head_with_markov", True)) or not (
                          rank and config.get("enable_confidence_head")),
                      mask_token_id=config.get("mask_token_id"),
                      arch=family_for(config.get("architectures") or []).name,
                      markov_head_type=str(config.get("markov_head_type") or "vanilla"))


# --- the plan of a run -----------------------------------------------------------------------------------------

def plan_draft(target: TargetConfig, tokenizer, shape: DraftShape, options: TrainOptions, seq_len: int,
               data_tokens: int, point: ResumePoint | None, device: torch.device,
               resident_layers: int | None = None) -> tuple[dict, list[str]]:
    """The draft's config (new, or the checkpoint's after checking it against this run) and what was decided,
    once the run is known to fit (checked on the geometry alone, before any list of layers is built).
    resident_layers: the target's decoder layers one process holds (None: all; fewer when sharded, 0 from features)."""
    from dspark_cli.runtime.train.new_draft import choose_mask_token, draft_config_dict, draft_target_layers

    anchors = options.anchors_per_sequence(seq_len)
    if point is not None:
        check_resume_shape(point, shape, target, options.steps)
        check_before_allocating(target, point.config, shape, options, seq_len, data_tokens, device, resident_layers)
        return point.config, [f"resuming {point.folder} at step {point.step} (draft geometry from its config.json)"]
    layers = draft_target_layers(target, shape)
    mask = choose_mask_token(tokenizer, target.vocab_size, shape.mask_token_id)
    one_layer = draft_config_dict(target.raw, replace(shape, layers=1), layers, mask, anchors)
    geometry = {**one_layer, "num_hidden_layers": shape.layers}  # no layer_types list of a huge layer count
    check_before_allocating(target, geometry, shape, options, seq_len, data_tokens, device, resident_layers)
    return draft_config_dict(target.raw, shape, layers, mask, anchors), [mask.note]


def check_before_allocating(target: TargetConfig, config: dict, shape: DraftShape, options: TrainOptions,
                            seq_len: int, data_tokens: int, device: torch.device,
                            resident_layers: int | None = None) -> None:
    """The window and one step's memory; config: the draft's config.json as a dict (layer_types not needed)."""
    from dspark_cli.runtime.devices import available_memory

    check_window(options.seq_len, seq_len, data_tokens, config["block_size"], target.max_position_embeddings)
    text = target.text if resident_layers is None else {**target.text, "num_hidden_layers": resident_layers}
    estimate = run_memory_estimate(text, config, shape, options, seq_len, device)
    check_memory(estimate, available_memory(device), device)


def run_memory_estimate(target_config: dict, config: dict, shape: DraftShape, options: TrainOptions, seq_len: int,
                        device: torch.device) -> MemoryEstimate:
    """MemoryEstimate of one step of this run (target_config: the target's text config, config: the draft's config.json,
    both as dicts)."""
    vocab, target_vocab = config["vocab_size"], target_config["vocab_size"]
    trainable_rows = (vocab if shape.train_embeddings or vocab > target_vocab else 0) + (
        (config.get("draft_vocab_size") or vocab) if shape.train_lm_head else 0)
    return estimate_memory(target_config, config, batch_size=options.batch_size, seq_len=seq_len,
                           anchors=options.anchors_per_sequence(seq_len), trainable_rows=trainable_rows,
                           half_precision=device.type == "cuda")
