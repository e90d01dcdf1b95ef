"""The registry of Markov head types: one module per type, registered here under the name its tensors have in
`runtime/checkpoint/heads.py` (docs/format.md §3). Every head exposes markov_w1 / markov_w2 and turns the
embedding e_k = W1[prev_k] of one position into the latent u_k whose bias W2 u_k the walk adds
(`step`, `block_latents`); the confidence head reads e_k itself, whatever the type."""

from __future__ import annotations

from dspark_cli.runtime.model.heads.gated import GatedHead
from dspark_cli.runtime.model.heads.rnn import RNNHead
from dspark_cli.runtime.model.heads.vanilla import VanillaHead

HEADS: dict[str, type[VanillaHead]] = {"vanilla": VanillaHead, "gated": GatedHead, "rnn": RNNHead}
