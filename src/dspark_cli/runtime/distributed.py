"""Many processes under torchrun (torch.distributed): where this process stands (`DistContext`), joining and
leaving the process group, the collectives dspark uses, and failures on one rank ended on every rank.

`dspark train` is data-parallel (DistributedDataParallel); its design keeps a many-process run step-for-step equal
to a one-process run with the same global batch:

- every rank draws the same global batch and anchors from the shared seeded generator (as one process does) and
  works on its own contiguous share of the rows (`DistContext.rows`);
- each rank's loss is its share of the global loss (weighted sums over its rows divided by the global sum of
  weights, which is all-reduced), and DDP averages gradients over ranks, so the loss is scaled by the world size
  before backward: the summed gradient equals the one-process gradient up to float summation order;
- the trainer state (step, optimizer, generator) is the same on every rank, so a checkpoint written by rank 0
  resumes at any world size;
- a rank that fails in the local part of a step (data, target and draft forward) says so in the next collective
  (`DistContext.together`), so every rank stops at the same point instead of waiting on a dead peer.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, TypeVar

import torch

from dspark_cli.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, DsparkError, SettingError, Terminated

T = TypeVar("T")
EXIT_CRASH = 1  # an unexpected exception on some rank


class PeerFailed(DsparkError):
    """This rank is fine but another one failed; the failing rank prints the reason."""


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job: rank `rank` of `world_size`, GPU `local_rank` on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def name(self) -> str:
        return f"rank {self.rank} of {self.world_size}"

    def rows(self, batch_size: int) -> slice:
        """This rank's contiguous share of a global batch (shares differ by at most one row; none is empty)."""
        if batch_size < self.world_size:
            raise DsparkError(f"a global batch of {batch_size} sequence(s) cannot be shared by {self.world_size} "
                              "processes; use a batch at least as large as the number of processes.")
        return slice(self.rank * batch_size // self.world_size, (self.rank + 1) * batch_size // self.world_size)

    def device(self, device: torch.device) -> torch.device:
        """The device of this rank: its own GPU (LOCAL_RANK) when training on CUDA."""
        if self.enabled and device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over all ranks (a collective: every rank must call it)."""
        if not self.enabled:
            return tensor
        total = tensor.detach().clone()
        self._all_reduce(total)
        return total

    def together(self, work: Callable[[], T], what: str) -> T:
        """Run `work` on this rank, then agree with the others: if any rank failed, every rank raises (the failing
        one its own error, named by rank; the others PeerFailed), so no rank waits in a later collective.

        Ctrl-C is not caught: it reaches every process of a terminal's job at once, each exits, and a collective
        waiting on a process that exited fails (gloo) or is ended by torchrun."""
        try:
            result, error, code = work(), None, 0
        except DsparkError as failure:
            result, error, code = None, failure, failure.exit_code
        except Exception as failure:  # noqa: BLE001 - reported to every rank, then re-raised with its cause
            result, error, code = None, failure, EXIT_CRASH
        if not self.enabled:
            if error is not None:
                raise error
            return result
        codes = torch.zeros(self.world_size, dtype=torch.int64, device=_collective_device())
        codes[self.rank] = code
        self._all_reduce(codes)
        failed = [rank for rank, value in enumerate(codes.tolist()) if value]
        if error is not None:
            raise self._own_failure(error, code, what) from error
        if failed:
            raise PeerFailed(f"{self.name}: stopped because rank {failed[0]} failed during {what} (its error is "
                             "above).", int(codes[failed[0]]))
        return result

    def exchange(self, work: Callable[[], T], what: str) -> list[T]:
        """Run `work` on this rank and give every rank the results of all ranks, in rank order (a collective).
        Results travel as JSON (no pickle between processes), so they must be JSON-ready; a failure on any rank
        raises on every rank as in `together`."""
        import json

        result = self.together(work, what)
        if not self.enabled:
            return [result]
        payload = torch.tensor(list(json.dumps(result).encode()), dtype=torch.uint8, device=_collective_device())
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=payload.device)
        sizes[self.rank] = payload.numel()
        self._all_reduce(sizes)
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8, device=payload.device)
        padded[: payload.numel()] = payload
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        try:
            torch.distributed.all_gather(gathered, padded)
        except RuntimeError as error:
            raise lost_contact(self, error) from error
        return [json.loads(bytes(g[: int(n)].tolist()).decode()) for g, n in zip(gathered, sizes.tolist())]

    def same_everywhere(self, values: list[int], what: str) -> None:
        """Refuse, on every rank, to go on when these integers are not the same on all ranks (a collective)."""
        if not self.enabled:
            return
        low = torch.tensor(values, dtype=torch.int64, device=_collective_device())
        high = low.clone()
        self._all_reduce(low, torch.distributed.ReduceOp.MIN)
        self._all_reduce(high, torch.distributed.ReduceOp.MAX)
        if torch.equal(low, high):
            return
        message = (f"the {self.world_size} processes do not have the same {what}; every process must be started "
                   "with the same options and read the same files.")
        if self.is_main:
            raise DsparkError(f"{self.name}: {message}")
        raise PeerFailed(message)

    def _all_reduce(self, tensor: torch.Tensor, op=None) -> None:
        """all_reduce in place; a peer that is gone (or a timeout) becomes one sentence naming this rank."""
        try:
            torch.distributed.all_reduce(tensor, op or torch.distributed.ReduceOp.SUM)
        except RuntimeError as error:  # gloo: RuntimeError; NCCL: DistBackendError (a RuntimeError)
            raise lost_contact(self, error) from error

    def _own_failure(self, error: BaseException, code: int, what: str) -> DsparkError:
        if isinstance(error, DsparkError):
            return DsparkError(f"{self.name}: {error.message}", code)
        return DsparkError(f"{self.name} failed during {what}: {type(error).__name__}: {error}", code)

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """`module` under DistributedDataParallel (gradients averaged over ranks in backward), or as is (one
        process, or already wrapped). A collective: every rank must call it."""
        from torch.nn.parallel import DistributedDataParallel

        if not self.enabled or isinstance(module, DistributedDataParallel):
            return module

        # device_ids None: the module lives on one device and its inputs are already there. Parameters start
        # equal on every rank (same seed) and DDP broadcasts rank 0's at construction anyway.
        return DistributedDataParallel(module, device_ids=None)


SINGLE = DistContext()


def _collective_device() -> torch.device:
    """Where the small tensors of a collective live: the current GPU under NCCL, else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_fingerprint(tokens: torch.Tensor, options: object, config: dict, step: int) -> list[int]:
    """Integers that differ when two processes would not train the same way: the token stream (length and two
    sums), the options, the draft's config and the step it starts from."""
    import json
    import zlib
    from dataclasses import asdict

    tokens = tokens.flatten().long()
    weights = torch.arange(tokens.numel()) % 1009
    settings = json.dumps([asdict(options), config], sort_keys=True, default=str).encode()
    return [tokens.numel(), int(tokens.sum()), int((tokens * weights).sum()), zlib.crc32(settings), step]


def context_from_env(environ=os.environ) -> DistContext:
    """The rank, world size and local rank that torchrun (or any launcher) sets; one process when unset."""
    if "WORLD_SIZE" not in environ:
        return SINGLE
    try:
        context = DistContext(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", 0)))
    except (KeyError, ValueError):
        raise DsparkError("WORLD_SIZE is set but RANK / LOCAL_RANK are missing or not integers; start many "
                          "processes with torchrun, which sets all three.") from None
    if not 0 <= context.rank < context.world_size:
        raise DsparkError(f"RANK {context.rank} is outside 0..{context.world_size - 1} (WORLD_SIZE "
                          f"{context.world_size}).")
    return context


def start(context: DistContext, device: torch.device, timeout_s: float) -> str | None:
    """Join the process group (NCCL on CUDA, gloo on CPU; rendezvous from MASTER_ADDR / MASTER_PORT) and return
    the backend's name (None for one process). Every collective that waits longer than `timeout_s` for a peer
    fails instead of hanging."""
    if not context.enabled:
        return None
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(context.local_rank)
        device_id = torch.device("cuda", context.local_rank)  # binds the communicator to this rank's GPU
    try:
        dist.init_process_group(backend, rank=context.rank, world_size=context.world_size,
                                timeout=timedelta(seconds=timeout_s), device_id=device_id)
    except (RuntimeError, ValueError) as error:
        raise DsparkError(f"{context.name}: cannot join the {backend} process group: {error}. Start the processes "
                          "with torchrun (MASTER_ADDR / MASTER_PORT must reach rank 0).") from error
    return backend


@contextmanager
def on_ranks(context: DistContext, device: torch.device, timeout_s: float, quiet: Callable[[], None]
             ) -> Iterator[str | None]:
    """The work of one command on every rank: join the process group (`start`; yields the backend, None for one
    process), run the with-block, leave the group however it ends. Rank 0 alone reports: `quiet` is called on the
    others (the CLI silences its console). On a rank other than 0, a peer's failure (PeerFailed), Ctrl-C or SIGTERM
    ends the process with SystemExit and the exit code (errors.py), saying nothing: the failing rank and rank 0 have
    said why. A peer lost under NCCL becomes one sentence naming this rank (`lost_contact`)."""
    check_timeout(timeout_s)  # every rank refuses it alike, before any joins
    if not context.is_main:
        quiet()
    backend = start(context, device, timeout_s)
    try:
        yield backend
    except PeerFailed as error:
        if context.is_main:
            raise
        raise SystemExit(error.exit_code) from None
    except (KeyboardInterrupt, Terminated) as interrupt:
        if context.is_main:
            raise
        raise SystemExit(EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED) from None
    except torch_distributed_error() as error:
        raise lost_contact(context, error) from error
    finally:
        stop(context)


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer than any step waits; torch takes the timeout as a timedelta


def check_timeout(seconds: float) -> None:
    """SettingError unless the seconds a process waits for the others are a number in (0, MAX_TIMEOUT_S]."""
    if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN fails too; inf overflowed timedelta on every rank
        raise SettingError("dist_timeout", f"must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f} "
                                           f"(a week), got {seconds}.")


def torch_distributed_error() -> type[Exception]:
    """The exception torch.distributed raises when a peer is gone or a collective times out (NCCL; gloo raises a
    plain RuntimeError, caught where dspark calls the collective itself)."""
    return torch.distributed.DistError


def lost_contact(context: DistContext, error: BaseException) -> DsparkError:
    first_line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return DsparkError(f"{context.name} lost contact with the other processes ({type(error).__name__}: "
                       f"{first_line}); one of them stopped or crashed: its error, if any, is above.", EXIT_CRASH)


def stop(context: DistContext) -> None:
    """Leave the process group (a no-op for one process)."""
    if context.enabled and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
