"""Activation ranges for FP8's static input scales: the draft's Linear layers observed while the unquantized pair
decodes calibration prompts speculatively (greedy, float32), so every layer sees the inputs it gets while drafting
(target hidden states into fc, the drafted block through the decoder layers). ModelOpt's max calibration does the
same: amax = max |x| over every calibration input of the layer, input_scale = amax / 448.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dspark_cli.errors import DsparkError


def activation_amax(target: str, draft: str, modules: Sequence[str], prompts: Sequence[str],
                    max_new_tokens: int) -> dict[str, float]:
    """max |input| of each draft module (DSparkDraft names, e.g. "layers.0.self_attn.q_proj", "fc") over the
    speculative decoding of `prompts`."""
    from dspark_cli.runtime.pair import Pair

    if not prompts:
        raise DsparkError("the calibration prompt set is empty; give prompts like the ones the draft will serve.")
    pair = Pair.check(target, draft, device="cpu", dtype="float32", temperature=0.0).load(progress=False)
    amax = dict.fromkeys(modules, 0.0)
    handles = [pair.draft.get_submodule(name).register_forward_pre_hook(_observer(amax, name)) for name in modules]
    try:
        for prompt in prompts:
            pair.generate(prompt, max_new_tokens=max_new_tokens)
    finally:
        for handle in handles:
            handle.remove()
    unseen = [name for name, value in amax.items() if value == 0.0]
    if unseen:
        raise DsparkError(f"the draft's {unseen[0]} saw no non-zero input on the calibration prompts; give longer "
                          "prompts or more new tokens per prompt.")
    return amax


def _observer(amax: dict[str, float], name: str):
    def observe(module: torch.nn.Module, args: tuple) -> None:
        x = args[0]  # [..., K]
        if x.numel():
            amax[name] = max(amax[name], float(x.detach().abs().max()))
    return observe
