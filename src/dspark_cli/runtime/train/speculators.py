"""speculators' hidden-state files read as dspark's feature contract (`dspark features --from-speculators`).

vLLM's `extract_hidden_states` speculative method, as the `vllm-project/speculators` data generation drives it
(its scripts `launch_vllm.py` and `data_generation_offline.py`, and `src/speculators/train/data.py`; vLLM's
`vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py`; read in 2026-12), writes one
`hs_<i>.safetensors` per sample with two tensors:

    hidden_states  [T, n + 1, Ht]  the aux layers' states, then the target's last state
    token_ids      [T] int64

The layer ids are vLLM's `eagle_aux_hidden_state_layer_ids`: id k is the INPUT of decoder layer k (the residual
stream `hidden_states + residual` before layer k runs), i.e. the output of layer k - 1 in dspark's convention
(train/features.py; aux id 0, the embedding output, is dspark's -1), and speculators appends id L (the layer
count), which vLLM takes after the last layer and BEFORE the final norm. So here: dspark layer id = aux id - 1 for the first n, and the contract's post-norm
`last_hidden` = the target's final norm applied to the last slot. The files hold no loss mask (speculators keeps it
in its preprocessed dataset): every token is a label, as in dspark's own data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
import torch
from torch import nn

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.train.features import FeatureRecord

HS_FILE = re.compile(r"hs_(\d+)\.safetensors")


@dataclass(frozen=True)
class AuxLayers:
    """speculators' layer ids (vLLM's aux ids, the last one the target's layer count) and dspark's for them."""

    aux_ids: tuple[int, ...]
    num_layers: int

    @property
    def layer_ids(self) -> list[int]:
        """dspark's layer ids of the aux layers: aux id k is the output of layer k - 1."""
        return [k - 1 for k in self.aux_ids[:-1]]

    def check(self) -> None:
        ids, L = self.aux_ids, self.num_layers
        if len(ids) < 2 or ids[-1] != L:
            raise DsparkError(f"the aux-layer-ids option {list(ids)} must end with the target's layer count {L}: "
                              "speculators appends it for the last state; give the ids of the extraction, e.g. "
                              f"2,{L // 2},{L - 3},{L}.")
        bad = [k for k in ids[:-1] if not 0 <= k < L]
        if bad:
            raise DsparkError(f"the aux-layer-ids option holds {bad[0]}, but an aux layer id must be in 0..{L - 1} "
                              "before the last one (id k is the input of layer k, 0 the embedding output).")


def hs_files(folder: Path) -> list[Path]:
    """The hs_<i>.safetensors files of a folder, by index."""
    found = [(int(m.group(1)), p) for p in Path(folder).iterdir() if (m := HS_FILE.fullmatch(p.name))]
    if not found:
        raise DsparkError(f"{folder} holds no hs_<i>.safetensors files; give the hidden-states folder that "
                          "speculators' data generation wrote.")
    return [p for _, p in sorted(found)]


def hs_length(path: Path) -> int:
    """Tokens of one file, from its header."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_slice("token_ids").get_shape()[0]
    except (SafetensorError, OSError, KeyError, ValueError) as error:
        raise DsparkError(f"{path} cannot be read as a speculators hidden-states file ({error}).") from None


def read_hs_file(path: Path, layers: AuxLayers, norm: nn.Module, dtype: torch.dtype) -> FeatureRecord:
    """One speculators file as a contract record: the aux layers concatenated, the final norm applied to the
    pre-norm last state (in float32, then stored in `dtype`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise DsparkError(f"{path} cannot be read as a speculators hidden-states file ({error}).") from None
    hidden, tokens = tensors.get("hidden_states"), tensors.get("token_ids")
    if hidden is None or tokens is None:
        raise DsparkError(f"{path} lacks the tensor 'hidden_states' or 'token_ids' of a speculators file.")
    n = len(layers.aux_ids)
    if hidden.dim() != 3 or hidden.shape[0] != tokens.numel() or hidden.shape[1] != n:
        raise DsparkError(f"{path}: 'hidden_states' is {list(hidden.shape)}, expected [{tokens.numel()}, {n}, hidden] "
                          f"for {n} aux layer ids (the aux-layer-ids option, the last one the layer count).")
    with torch.no_grad():
        weight = next(norm.parameters())
        last = norm(hidden[:, -1].to(device=weight.device, dtype=weight.dtype))  # [T, Ht] post-norm
    return FeatureRecord(tokens=tokens.long(), loss_mask=torch.ones(tokens.numel(), dtype=torch.bool),
                         layers=hidden[:, :-1].flatten(1).to(dtype).contiguous(),  # [T, n*Ht]
                         last_hidden=last.to(device="cpu", dtype=dtype))

