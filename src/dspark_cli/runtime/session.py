"""`dspark eval`'s pair as a session: check it, encode every prompt (checked against the target's context), load
it, then run one prompt per call (the first call warms up first).

    session = open_session(settings, sets, dist, warn=print, loading=contextlib.nullcontext)
    result = session("code", 0, text)   # -> PromptResult

`settings` is the run file's settings dict: what the run requested (`settings["requested"]`, resolved again here)
and what it resolved, which `open_session` fills in (block size, device, dtype, Markov strategy, chat).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Callable

from dspark_cli.errors import DsparkError, SettingError

if TYPE_CHECKING:
    from dspark_cli.runtime.distributed import DistContext

RESOLVED_KEYS = ("block_size", "markov")  # a resumed run must resolve them as the run did
SEED_SPACE = 2**64  # torch.Generator.manual_seed takes 0 .. 2^64 - 1


def open_session(settings: dict, sets: list, dist: "DistContext", warn: Callable[[list[str]], None],
                 loading: Callable[[str], AbstractContextManager], resumed: bool = False):
    """-> session(set_name, index, text) -> PromptResult. `warn` receives the pair's warnings, `loading(what)`
    wraps the load (the CLI's status line); a resumed run must resolve as it did (`check_resolved`)."""
    from dspark_cli.runtime.devices import resolve_device
    from dspark_cli.runtime.measure import evaluation as ev
    from dspark_cli.runtime.pair import Pair

    s = settings
    asked = s.get("requested", s)  # what the run asked for (older files: EvalRun.load's defaults), resolved again
    try:
        device = str(dist.device(resolve_device(asked["device"])))  # under torchrun on CUDA: this rank's GPU
    except ValueError as error:
        raise SettingError("device", f"{error}.") from None
    calibration = s["calibration"]
    checked = Pair.check(s["target"], s["draft"], device=device, dtype=asked["dtype"],
                         temperatures=None if calibration is None else calibration["temperatures"],
                         block_size=asked["block_size"], draft_topk=asked["draft_topk"], markov=asked["markov"],
                         temperature=s["temperature"], top_p=asked["top_p"], top_k=asked["top_k"],
                         confidence_threshold=s["confidence_threshold"], confidence_rule=s["confidence_rule"],
                         length_rule="deepspec")
    if resumed:
        check_resolved(s, checked.settings)
    warn(checked.warnings)
    use_chat = checked.chat(s["chat"])
    encoded = ev.encode_sets(checked, sets, use_chat, s["thinking"], s["max_new_tokens"])
    with loading("loading the target and the draft"):
        pair = checked.load(progress=False)
    warn(pair.warnings[len(checked.warnings) :])
    resolved = pair.settings
    s.update(block_size=resolved.block_size, device=str(pair.device), dtype=str(checked.dtype).removeprefix("torch."),
             markov=resolved.markov, draft_topk=resolved.draft_topk, chat=use_chat, draft_kind=pair.draft_kind)
    lengths = {"max_new_tokens": s["max_new_tokens"]}
    warm = [True]

    def session(set_name: str, index: int, text: str):
        ids = encoded[set_name, index]
        if warm[0]:  # first-call costs (allocators, kernels) would otherwise land on the first prompt
            pair.warm_up(ids, baseline=s["baseline"], seed=s["seed"], **lengths)
            warm[0] = False
        seed = (s["seed"] + index) % SEED_SPACE  # DeepSpec's seed + i, kept within torch's 64-bit seeds
        result = pair.generate(ids, seed=seed, **lengths)
        reference = pair.baseline(ids, seed=seed, **lengths) if s["baseline"] else None
        return ev.prompt_result(set_name, index, text, result, reference)

    return session


def check_resolved(stored: dict, resolved) -> None:
    """A resumed run (its settings already resolved once) must resolve to the same block size and Markov
    strategy: its finished prompts were produced with them."""
    now = {"block_size": resolved.block_size, "markov": resolved.markov}
    for key in RESOLVED_KEYS:
        if stored[key] != now[key]:
            raise DsparkError(f"the run resolved {key.replace('_', ' ')} to {stored[key]!r} and this pair now "
                              f"resolves it to {now[key]!r} (a changed draft or device); start a new run.")
