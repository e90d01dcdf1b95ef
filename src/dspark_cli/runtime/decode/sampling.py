"""Token sampling and the lossless accept/reject decision of speculative decoding.

Everything here works on probabilities over the full vocabulary, in float32, one sequence at a
time (`accept`) or a batch of independent sequences (`accept_batch`, same math). Every random
draw takes an explicit `torch.Generator` so that a run is reproducible from its seed.

Accepting is Leviathan et al. (2023) rejection sampling: with draft tokens d_i ~ q_i, accept
d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a token from
normalize(max(p_i - q_i, 0)); if every draft token is accepted, emit a bonus token from p_k.
The emitted tokens are then distributed exactly as if sampled from the target one by one.
When every target row is one-hot (temperature 0), this reduces to exact greedy matching, which
`accept_batch` runs directly without drawing random numbers, and `accept_greedy` runs on token ids alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark_cli.runtime.settings import SamplingParams

# Below this residual mass a rejection is a rounding artefact of p ~= q: sample from p instead.
RESIDUAL_MASS_EPS = 1e-8


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] -> [n, V] fp32: logits / T, then -inf outside the top-k, then outside the top-p set.

    top-k keeps every token whose scaled logit is >= the k-th largest (ties at the k-th value are
    kept). top-p keeps, in descending probability order, the smallest prefix whose mass is >= top_p
    (a token is dropped when the tokens strictly before it already hold >= top_p). Greedy params
    return logits.float() unchanged: the argmax survives any top-k / top-p cut.
    """
    scaled = logits.float()
    if params.greedy:
        return scaled
    scaled = scaled / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth_largest = scaled.topk(params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_probs, order = scaled.softmax(-1).sort(dim=-1, descending=True)  # [n, V]
        mass_before = F.pad(sorted_probs.cumsum(-1)[..., :-1], (1, 0))  # exclusive prefix sums
        drop = torch.zeros_like(order, dtype=torch.bool).scatter(-1, order, mass_before >= params.top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> [n, V] fp32 probabilities: one-hot argmax when greedy, else
    softmax(processed_logits). Apply the same function to draft logits so that draft (q) and
    target (p) use the same processing."""
    if params.greedy:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return processed_logits(logits, params).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[n, V] fp32 -> [n] int64: argmax for one-hot rows, a multinomial draw otherwise.

    Draws no random numbers when every row is one-hot (greedy), so greedy runs leave the generator
    untouched. The generator must live on probs' device.
    """
    argmax = probs.argmax(-1)  # [n]
    one_hot = probs.amax(-1) == 1.0  # [n]
    if bool(one_hot.all()):
        return argmax
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [n]
    return torch.where(one_hot, argmax, drawn)


def gumbel_noise(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device | str | None = None
) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(U)), U ~ uniform(0, 1), fp32 of `shape`.

    `device` defaults to the generator's. U is clamped away from 0, so the noise is finite; the
    result is Gumbel up to the 2^-24 resolution of fp32 uniforms.
    """
    if device is None:
        device = generator.device if generator is not None else "cpu"
    uniform = torch.rand(shape, generator=generator, device=device)
    return -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))


def gumbel_argmax(logits: torch.Tensor, temperature: float, noise: torch.Tensor) -> torch.Tensor:
    """[n, V] logits, [n, V] Gumbel noise -> [n] int64 tokens distributed as softmax(logits / T).

    argmax(logits / T + g) with g i.i.d. Gumbel is an exact sample of softmax(logits / T)
    (Gumbel-max trick); temperature 0 gives argmax(logits) and ignores the noise. Precomputed noise
    lets different implementations of one walk draw identical tokens. With top-k / top-p, pass
    `processed_logits(logits, params)` and temperature 1.0, so that tokens follow target_probs.
    """
    if temperature == 0.0:
        return logits.argmax(-1)
    return (logits.float() / temperature + noise).argmax(-1)


def accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Accept a prefix of one sequence's draft: [k] int64 tokens, [k, V] fp32 draft probs (None = greedy draft,
    q one-hot), [k + 1, V] fp32 target probs (row i scores draft i; row k is the bonus row).

    Returns (num_accepted in 0..k, next_token): the round commits draft_tokens[:num_accepted] and
    then next_token (the correction after a rejection, or the bonus). k may be 0: a plain target step.
    All tensors and the generator live on one device.
    """
    accepted, next_token = accept_batch(
        draft_tokens[None],
        None if draft_probs is None else draft_probs[None],
        target_probs[None],
        generator,
    )
    return int(accepted[0]), int(next_token[0])


def accept_greedy(draft_tokens: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """`accept` at temperature 0 on token ids: k draft ids, the target's k + 1 argmax ids (row k is the bonus
    row). Accepts while they match; the next token is the target's argmax after the accepted prefix."""
    if len(target_argmax) != len(draft_tokens) + 1:
        raise ValueError(f"need k + 1 = {len(draft_tokens) + 1} target argmax ids, got {len(target_argmax)}")
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_argmax[accepted]:
        accepted += 1
    return accepted, target_argmax[accepted]


def accept_batch(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept` for B independent sequences: [B, k], [B, k, V] | None, [B, k + 1, V] -> ([B], [B]) int64.

    Greedy matching when every target row is one-hot; otherwise rejection sampling, drawing one
    uniform per draft slot ([B, k]) and then one multinomial for the next token.
    """
    batch, k = draft_tokens.shape
    if target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_probs must be [B, k + 1, V] = [{batch}, {k + 1}, V], got {list(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [B, k, V] like target_probs[:, :k], got {list(draft_probs.shape)}")
    rows = torch.arange(batch, device=draft_tokens.device)

    if bool((target_probs.amax(-1) == 1.0).all()):  # greedy target: accept while draft == argmax
        target_argmax = target_probs.argmax(-1)  # [B, k + 1]
        matches = draft_tokens == target_argmax[:, :k]  # [B, k]
        num_accepted = matches.long().cumprod(-1).sum(-1)  # [B]
        return num_accepted, target_argmax[rows, num_accepted]
    if k == 0:  # nothing to accept: one plain target step
        return torch.zeros(batch, dtype=torch.long, device=draft_tokens.device), sample(target_probs[:, 0], generator)

    p_of_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    uniform = torch.rand((batch, k), generator=generator, device=target_probs.device)
    slot_accepted = uniform * q_of_draft < p_of_draft  # u < p / q, without dividing by q
    num_accepted = slot_accepted.long().cumprod(-1).sum(-1)  # [B]

    # The next token comes from row num_accepted: the residual max(p - q, 0) after a rejection,
    # p itself after full acceptance (q is taken as 0 on the bonus row).
    p_next = target_probs[rows, num_accepted]  # [B, V]
    slot = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_next = F.one_hot(draft_tokens[rows, slot], p_next.shape[-1]).float()  # [B, V]
    else:
        q_next = draft_probs[rows, slot]  # [B, V]
    q_next = q_next * (num_accepted < k)[:, None]
    residual = (p_next - q_next).clamp_min(0.0)
    residual_mass = residual.sum(-1, keepdim=True)  # [B, 1]
    next_probs = torch.where(residual_mass > RESIDUAL_MASS_EPS, residual / residual_mass, p_next)
    return num_accepted, sample(next_probs, generator)
