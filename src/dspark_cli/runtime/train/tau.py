"""τ during training, as `dspark generate` and `dspark eval` measure it: committed tokens per round of the greedy
speculative loop (T = 0, every drafted position scored), on a few prompts the draft is not trained on.

The prompts: a held-out tail of the training data (no stop token, as many new tokens as asked), or a prompt set read
and encoded as `dspark eval --data FILE` reads and encodes it by default (its chat template when the tokenizer has
one, enable_thinking off, the pair's stop tokens).

Once per run (`held_out`): each prompt is continued greedily by the target itself (the loop's baseline,
`autoregressive_generate`, up to a stop token), block_size tokens beyond the length measured, and the target's
features of the whole sequence are captured. Lossless greedy decoding commits exactly these tokens, so every round
of the loop is known in advance up to the draft: a round anchored at position p drafts d_1..d_K from the context
before p, and accepts the longest prefix with d_i equal to the continuation's token at p + i. `chained_tau` computes,
in one batched draft pass, the accepted length at every anchor, the Markov head fed its OWN previous pick (the walk
of `decode/markov.py` with the strategy the pair resolves, as the loop runs it), then chains the rounds as the
loop's `commit` does: the first anchor is the first new token, each round commits accepted + 1 tokens (up to and
including an accepted stop token, which ends generation; a stop token as the next token ends it too) and the next
anchor follows them, until `new_tokens` are committed. τ = committed tokens / rounds, pooled over the prompts.

It equals the real loop's τ on the same prompt tokens up to float rounding between a batched and an incremental
forward (a flipped near-tie; tests/train/test_tau.py checks equality round for round on the shipped demo pair). At
T = 0 feeding the Markov head the true previous token instead would give the same accepted lengths (a round ends at
its first mismatch, and before it the draft's own pick is the true token). The training-anchor figure of the loss
(`LossTerms.expected_length`, 1 + Σ Π (1 − TV) over uniformly drawn anchors at T = 1) is not τ: the loop's rounds
start right after a rejection, more often at hard positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.decode.sampling import SamplingParams
from dspark_cli.runtime.decode.markov import markov_walk
from dspark_cli.runtime.decode.selector import selector_walk
from dspark_cli.runtime.decode.speculative import Drafter, autoregressive_generate
from dspark_cli.runtime.model.draft import DSparkDraft
from dspark_cli.runtime.model.target import TargetModel
from dspark_cli.runtime.settings import MarkovHead, resolve_settings
from dspark_cli.runtime.train.features import capture_target_features
from dspark_cli.runtime.train.loss import block_hidden, build_blocks

GREEDY = SamplingParams(0.0)


@dataclass(frozen=True)
class TauProbe:
    """How train measures τ: every `every` steps (0: never) over `new_tokens` generated tokens per prompt, on
    `prompts` prompts of `prompt_tokens` tokens held out from the end of the data, or on the prompt set `data`."""

    every: int = 0
    prompts: int = 8
    prompt_tokens: int = 64
    new_tokens: int = 64
    data: Path | None = None  # a prompt set as `dspark eval` reads it (.jsonl / .txt)

    @property
    def held_tokens(self) -> int:
        """Tokens of training data the probe holds out (none with a prompt set)."""
        return 0 if self.data is not None else self.prompts * self.prompt_tokens


@dataclass
class HeldPrompt:
    """One prompt with the target's greedy continuation and its features."""

    tokens: torch.Tensor  # [P + G]: prompt, then the continuation (G <= new_tokens + K; shorter after a stop token)
    layers: torch.Tensor  # [P + G, n*Ht] the target's features (features.capture_target_features)
    prompt_tokens: int  # P


@dataclass
class HeldOut:
    prompts: list[HeldPrompt]
    new_tokens: int  # M: tokens committed per prompt at most, as max_new_tokens
    stop_ids: tuple[int, ...]  # tokens that end generation (none for the held-out tail of the data)


@dataclass(frozen=True)
class TauEstimate:
    tau: float | None  # committed tokens per round, pooled over the prompts (None: no round)
    rounds: int
    accepted_at: list[float]  # share of rounds accepting more than j drafts, j = 0..K-1


@torch.no_grad()
def held_out(model: TargetModel, prompts: list[torch.Tensor], new_tokens: int, block_size: int, layer_ids,
             stop_ids: tuple[int, ...] = ()) -> HeldOut:
    """prompts (each [P_i]) -> their greedy continuations by the target (new_tokens + block_size tokens at most: the
    last round may look block_size tokens past the end; up to a stop token) and the target's features. model: the
    target as the loop's baseline runs it (batch 1 with its cache)."""
    held = []
    for prompt in prompts:
        continuation = autoregressive_generate(model, prompt, GREEDY, max_new_tokens=new_tokens + block_size,
                                               stop_ids=stop_ids).tokens
        tokens = torch.cat([prompt, torch.tensor(continuation, device=prompt.device)])  # [P + G]
        layers = capture_target_features(model.model, tokens[None], layer_ids).layers[0]  # [P + G, n*Ht]
        held.append(HeldPrompt(tokens, layers, len(prompt)))
    return HeldOut(held, new_tokens, tuple(stop_ids))


def eval_prompts(path: Path, tokenizer, source: str) -> list[list[int]]:
    """The prompts of a prompt set as `dspark eval --data` encodes them by default (chat template when the tokenizer
    has one, enable_thinking off)."""
    from dspark_cli.runtime.decode.chat import encode_prompt
    from dspark_cli.runtime.measure.evaluation import read_prompt_set

    chat = bool(getattr(tokenizer, "chat_template", None))
    encoded = [encode_prompt(tokenizer, text, chat, source, False) for text in read_prompt_set(path).prompts]
    empty = next((i for i, ids in enumerate(encoded) if not ids), None)
    if empty is not None:
        raise DsparkError(f"prompt {empty + 1} of {path} encodes to no tokens; remove it.")
    return encoded


def pair_settings(draft: DSparkDraft, device: torch.device):
    """The decode settings `dspark generate` resolves for this draft by default (greedy, every position scored)."""
    return resolve_settings(draft.config, MarkovHead.of_config(draft.config, nvfp4=False), device.type == "cuda")


@torch.no_grad()
def chained_tau(draft: DSparkDraft, held: HeldOut, target_vocab: int) -> TauEstimate:
    """τ of the greedy loop on the held-out prompts (see the module docstring)."""
    settings = pair_settings(draft, draft.fc.weight.device)
    drafter = Drafter.of(draft, settings, target_vocab)
    K, M, stops = settings.block_size, held.new_tokens, set(held.stop_ids)
    emitted: list[int] = []  # per round: tokens committed
    taken: list[int] = []  # per round: drafts accepted (an accepted stop token is the round's last)
    for prompt in held.prompts:
        new = prompt.tokens[prompt.prompt_tokens:].tolist()  # the continuation: new[q] is the anchor of round q
        accepted = accepted_lengths(draft, drafter, prompt, min(M, len(new)), K).tolist()  # [anchors]
        q, committed, stopped = 0, 1, new[0] in stops  # the first new token comes from the prefill
        while not stopped and committed < M:
            drafted = new[q + 1:q + 1 + accepted[q]]  # the accepted drafts are the continuation's tokens
            stop_at = next((j for j, token in enumerate(drafted) if token in stops), None)
            length = len(drafted) + 1 if stop_at is None else stop_at + 1
            stopped = stop_at is not None or new[q + length] in stops
            emitted.append(length)
            taken.append(len(drafted) if stop_at is None else length)
            committed += length
            q += length
    if not emitted:
        return TauEstimate(None, 0, [0.0] * K)
    accepted_at = [sum(a > j for a in taken) / len(taken) for j in range(K)]
    return TauEstimate(sum(emitted) / len(emitted), len(emitted), accepted_at)


def accepted_lengths(draft: DSparkDraft, drafter: Drafter, prompt: HeldPrompt, count: int, K: int) -> torch.Tensor:
    """Drafts accepted at the first `count` anchors after the prompt, the walk fed its own picks. -> [count]"""
    P, tokens = prompt.prompt_tokens, prompt.tokens[None]  # [1, T]
    anchors = torch.arange(P, P + count, device=tokens.device)[None]  # [1, count]
    from_anchor = draft.config.sample_from_anchor  # else the DFlash layout: K + 1 slots, the anchor's predicts nothing
    blocks = build_blocks(tokens, anchors, K if from_anchor else K + 1, draft.config.mask_token_id,
                          sample_from_anchor=from_anchor)
    slots = slice(0, K) if from_anchor else slice(1, K + 1)
    hidden = block_hidden(draft, prompt.layers[None].float(), blocks)[0, :, slots]  # [count, K, H]
    base = draft.base_logits(hidden)  # [count, K, Vd]
    first = tokens[0, P:P + count]  # [count] the anchors
    if draft.candidate_selector is not None:  # DFlash2: the selector walk (decode/selector.py)
        ids, unary = draft.candidate_selector.candidates(base)
        scores = draft.candidate_selector(hidden, ids, unary, first)  # [count, K, k, k]
        drafted = selector_walk(scores, ids, base.shape[-1], GREEDY, None).tokens  # [count, K]
    else:
        walk = markov_walk(drafter.strategy, drafter.weights, base, first, GREEDY, None, drafter.draft_topk,
                           hidden=hidden)
        drafted = walk.tokens  # [count, K]
        if drafter.weights is None and drafter.draft_vocab_ids is not None:
            drafted = drafter.draft_vocab_ids[drafted]  # no Markov head: the walk returned draft ids
    labels, valid = blocks.labels[0, :, slots], blocks.valid[0, :, slots]
    matches = (drafted == labels) & valid  # [count, K]: the continuation is the target's choice
    return matches.long().cumprod(-1).sum(-1)  # [count]
