"""The frozen target sharded across the processes of a `dspark train` job (the shard-target option): PyTorch FSDP2
(`torch.distributed.fsdp.fully_shard`) on every decoder layer, the draft under DDP as without it.

Each rank keeps 1/N of every decoder layer's weights; a layer's forward all-gathers its weights, runs, and frees the
gathered copy (`reshard_after_forward`). The embedding, the final norm and the lm_head stay whole on every rank: the
draft copies the embedding and the lm_head anyway, and the loss reads the lm_head. The target is frozen and runs
without gradients, so FSDP2 only gathers, never reduces. The all-gathered weights are the unsharded ones bit for
bit, so a sharded target computes exactly what a whole one does (a test checks a 2-process sharded run against a
1-process run); every rank must run the target once per step, which the data-parallel step does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.distributed import DistContext


@dataclass(frozen=True)
class ShardReport:
    layers: int  # decoder layers sharded
    local: int  # decoder-layer weights held by this rank
    total: int  # decoder-layer weights of the whole target

    def note(self, world_size: int) -> str:
        return (f"target sharded across {world_size} processes (FSDP2): {self.layers} decoder layers, "
                f"{self.local:,} of their {self.total:,} weights on each process")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (`get_decoder().layers`), or one sentence."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise DsparkError(f"the target {type(model).__name__} has no `layers` list in its decoder, so it cannot be "
                          "sharded; train without the shard-target option.")
    return layers


def shard_target(model: nn.Module, dist: DistContext) -> ShardReport:
    """Shard every decoder layer of the frozen `model` across the job's ranks (FSDP2, in place). A collective:
    every rank calls it, with the same model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.enabled:
        raise DsparkError("the shard-target option shards the target across the processes of a torchrun job, but "
                          "this is one process; start it with torchrun over two or more processes or leave the "
                          "option out.")
    layers = decoder_layers(model)
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    local = sum(_local(p).numel() for p in layers.parameters())
    total = sum(p.numel() for p in layers.parameters())
    return ShardReport(len(layers), local, total)


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (a DTensor under FSDP2), or the whole tensor when it is not sharded."""
    to_local = getattr(parameter, "to_local", None)
    return to_local() if to_local is not None else parameter
