"""The registry of Markov head types and the tensors each adds beside markov_w1 / markov_w2 (docs/format.md §3).

The math of each type is `runtime/model/heads/<type>.py`, registered under the same name; this half is torch-free
so that `dspark validate` can check the tensors. DeepSpec (`deepspec/modeling/dspark/markov_head.py`) and
speculators (`src/speculators/models/dspark/model_definitions.py`, MarkovHead) use these names and shapes.
"""

from __future__ import annotations

from typing import Callable

# (name, shape from (hidden_size H, markov_rank r), formula)
HeadTensor = tuple[str, Callable[[int, int], tuple[int, ...]], str]

HEAD_TYPES: dict[str, tuple[HeadTensor, ...]] = {
    "vanilla": (),
    "gated": (
        ("markov_head.gate_proj.weight", lambda H, r: (r, H + r), "[markov_rank, hidden_size+markov_rank]"),
        ("markov_head.gate_proj.bias", lambda H, r: (r,), "[markov_rank]"),
    ),
    "rnn": (
        ("markov_head.joint_proj.weight", lambda H, r: (3 * r, 2 * r + H),
         "[3*markov_rank, 2*markov_rank+hidden_size]"),
        ("markov_head.joint_proj.bias", lambda H, r: (3 * r,), "[3*markov_rank]"),
    ),
}
