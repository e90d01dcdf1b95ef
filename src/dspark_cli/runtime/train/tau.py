"""τ during training, as `dspark generate` and `dspark eval` measure it: committed tokens per round of the greedy
speculative loop (T = 0, every drafted position scored, no stop token), on a few held-out prompts.

Once per run (`held_out`): each prompt is continued greedily by the target itself (the loop's baseline,
`autoregressive_generate`), block_size tokens beyond the length measured, and the target's features of the whole
sequence are captured. Lossless greedy decoding commits exactly these tokens, so every round of the loop is known
in advance up to the draft: a round anchored at position p drafts d_1..d_K from the context before p, and accepts the
longest prefix with d_i equal to the continuation's token at p + i. `chained_tau` computes, in one batched draft
pass, the accepted length at every anchor, the Markov head fed its OWN previous pick (the walk of
`decode/markov.py` with the pair's resolved strategy, as the loop runs it), then chains the rounds as the loop does:
the first anchor is the first new token, each round commits accepted + 1 tokens and the next anchor follows them,
until `new_tokens` are committed. τ = committed tokens / rounds, pooled over the prompts.

It equals the real loop's τ on the same prompts up to float rounding between a batched and an incremental forward
(a flipped near-tie; tests/train/test_tau.py checks equality on a tiny pair). The training-anchor figure of the loss
(`LossTerms.expected_length`, 1 + Σ Π (1 − TV) over uniformly drawn anchors at T = 1) is not τ: the loop's rounds
start right after a rejection, more often at hard positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_cli.runtime.decode.sampling import SamplingParams
from dspark_cli.runtime.decode.markov import markov_walk
from dspark_cli.runtime.decode.speculative import Drafter, autoregressive_generate
from dspark_cli.runtime.model.draft import DSparkDraft
from dspark_cli.runtime.model.target import TargetModel
from dspark_cli.runtime.settings import MarkovHead, resolve_settings
from dspark_cli.runtime.train.features import capture_target_features
from dspark_cli.runtime.train.loss import block_hidden, build_blocks

GREEDY = SamplingParams(0.0)


@dataclass(frozen=True)
class TauProbe:
    """How train measures τ: every `every` steps (0: never) on `prompts` held-out prompts of `prompt_tokens` tokens,
    over `new_tokens` generated tokens each."""

    every: int = 0
    prompts: int = 8
    prompt_tokens: int = 64
    new_tokens: int = 64

    @property
    def held_tokens(self) -> int:
        """Tokens of training data the probe holds out."""
        return self.prompts * self.prompt_tokens


@dataclass
class HeldOut:
    """Held-out prompts with the target's greedy continuations and its features."""

    tokens: torch.Tensor  # [S, P + M + K]: prompt, then the target's greedy continuation
    layers: torch.Tensor  # [S, P + M + K, n*Ht] the target's features (features.capture_target_features)
    prompt_tokens: int  # P
    new_tokens: int  # M: tokens committed per prompt, as max_new_tokens


@dataclass(frozen=True)
class TauEstimate:
    tau: float  # committed tokens per round, pooled over the prompts
    rounds: int
    accepted_at: list[float]  # share of rounds accepting more than j drafts, j = 0..K-1


@torch.no_grad()
def held_out(target, prompts: torch.Tensor, new_tokens: int, block_size: int, layer_ids) -> HeldOut:
    """prompts [S, P] -> their greedy continuations by the target (new_tokens + block_size tokens: the last round
    may look block_size tokens past the end) and the target's features of the whole sequences."""
    model = TargetModel(target)  # batch 1 with its cache, as the loop's baseline runs it
    rows = [torch.cat([prompt.cpu(), torch.tensor(autoregressive_generate(
        model, prompt, GREEDY, max_new_tokens=new_tokens + block_size).tokens)]) for prompt in prompts]
    tokens = torch.stack(rows).to(prompts.device)  # [S, P + M + K]
    layers = capture_target_features(target, tokens, layer_ids).layers
    return HeldOut(tokens, layers, prompts.shape[1], new_tokens)


def pair_settings(draft: DSparkDraft, device: torch.device):
    """The decode settings `dspark generate` resolves for this draft by default (greedy, every position scored)."""
    return resolve_settings(draft.config, MarkovHead.of_config(draft.config, nvfp4=False), device.type == "cuda")


@torch.no_grad()
def chained_tau(draft: DSparkDraft, held: HeldOut, target_vocab: int) -> TauEstimate:
    """τ of the greedy loop on the held-out prompts (see the module docstring)."""
    settings = pair_settings(draft, held.tokens.device)
    drafter = Drafter.of(draft, settings, target_vocab)
    K, P, M = settings.block_size, held.prompt_tokens, held.new_tokens
    emitted: list[int] = []
    for tokens, layers in zip(held.tokens, held.layers):  # one prompt at a time: the attention mask is [M*K, T+M*K]
        accepted = accepted_lengths(draft, drafter, tokens[None], layers[None], P, M, K)  # [M]
        position = 0  # the anchor, counted from the first new token
        committed = 1  # the first new token comes from the prefill
        while committed < M:
            length = int(accepted[position]) + 1
            emitted.append(length)
            committed += length
            position += length
    accepted_at = [sum(e > j + 1 for e in emitted) / len(emitted) for j in range(K)]
    return TauEstimate(sum(emitted) / len(emitted), len(emitted), accepted_at)


def accepted_lengths(draft: DSparkDraft, drafter: Drafter, tokens: torch.Tensor, layers: torch.Tensor, P: int, M: int,
                     K: int) -> torch.Tensor:
    """tokens [1, T], layers [1, T, n*Ht] -> drafts accepted at each anchor P..P+M-1, the walk fed its own picks. [M]"""
    anchors = torch.arange(P, P + M, device=tokens.device)[None]  # [1, M]
    blocks = build_blocks(tokens, anchors, K, draft.config.mask_token_id)
    hidden = block_hidden(draft, layers.float(), blocks)[0]  # [M, K, H]
    base = draft.base_logits(hidden)  # [M, K, Vd]
    walk = markov_walk(drafter.strategy, drafter.weights, base, tokens[0, P:P + M], GREEDY, None, drafter.draft_topk,
                       hidden=hidden)
    drafted = walk.tokens  # [M, K]
    if drafter.weights is None and drafter.draft_vocab_ids is not None:
        drafted = drafter.draft_vocab_ids[drafted]  # no Markov head: the walk returned draft ids
    matches = drafted == blocks.labels[0]  # [M, K]: the continuation is the target's own greedy choice
    return matches.long().cumprod(-1).sum(-1)  # [M]
