"""torch.distributed for the examples: a process group from torchrun's environment, and collectives that fail clearly.

torchrun (single or multi node) sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every process
it starts; `Launch.from_env` reads them (None when WORLD_SIZE, RANK and LOCAL_RANK are all unset: a plain run),
and `ProcessGroup.from_env` joins the default group: backend "nccl" on CUDA (the rank's GPU is
``cuda:LOCAL_RANK``), "gloo" on the CPU, every collective bounded by `timeout_s`. A collective that fails -- a
rank died, hung, or the network went away -- raises `DistributedError` naming this rank, the collective and what
to do, instead of the backend's bare message. Only tensor collectives are used (nothing is pickled).

    torchrun --nproc_per_node 2 examples/ppo_pi05.py --device cpu     # two gloo ranks on one machine
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from policies.checks import check_device

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets in each process it starts (all of them, or -- a plain run -- none of the first three)."""
_RANK_VARIABLES = LAUNCH_VARIABLES[:3]


class DistributedError(RuntimeError):
    """A collective did not complete on this rank (another rank died or hung, or the group timed out)."""


@dataclass(frozen=True)
class Launch:
    """Where this process sits in a torchrun launch.

    Attributes:
        rank: global rank in [0, world_size).
        local_rank: rank on this node (its GPU on CUDA).
        world_size: G, processes in the launch.

    Example:
        >>> env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        >>> Launch.from_env({**env, "MASTER_PORT": "29500"})
        Launch(rank=1, local_rank=1, world_size=2)
        >>> Launch.from_env({}) is None                 # not launched by torchrun: a plain run
        True
    """

    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Launch | None:
        """The launch described by `environ` (default ``os.environ``); None for a plain run.

        Raises:
            ValueError: the variables are half set or not integers in range (the message says which).
        """
        environ = os.environ if environ is None else environ
        if not any(name in environ for name in _RANK_VARIABLES):
            return None
        missing = [name for name in LAUNCH_VARIABLES if not environ.get(name)]
        if missing:
            present = ", ".join(f"{n}={environ[n]}" for n in LAUNCH_VARIABLES if environ.get(n))
            raise ValueError(
                f"torchrun environment: expected all of {', '.join(LAUNCH_VARIABLES)} (torchrun sets them) or none "
                f"of {', '.join(_RANK_VARIABLES)} (a single-process run), got {present} with {', '.join(missing)} "
                "unset. Fix: launch with `torchrun --nproc_per_node G ...`, or unset "
                f"{', '.join(n for n in _RANK_VARIABLES if n in environ)} for a single-process run."
            )
        values = {}
        for name in _RANK_VARIABLES:
            try:
                values[name] = int(environ[name])
            except ValueError:
                raise ValueError(
                    f"torchrun environment: {name} must be an integer, got {environ[name]!r}. Fix: let torchrun "
                    "set it (`torchrun --nproc_per_node G ...`)."
                ) from None
        rank, local_rank, world = values["RANK"], values["LOCAL_RANK"], values["WORLD_SIZE"]
        if world < 1 or not 0 <= rank < world or not 0 <= local_rank <= rank:
            raise ValueError(
                f"torchrun environment: expected WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE and 0 <= LOCAL_RANK <= "
                f"RANK, got RANK={rank}, LOCAL_RANK={local_rank}, WORLD_SIZE={world}. Fix: let torchrun set them."
            )
        return cls(rank=rank, local_rank=local_rank, world_size=world)


def rank_device(device: str, launch: Launch) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` for "cuda", the CPU for "cpu".

    Example:
        >>> rank_device("cpu", Launch(rank=1, local_rank=1, world_size=2))
        device(type='cpu')
    """
    dev = check_device(device, "--device")
    if dev.type != "cuda":
        return dev
    if dev.index is not None and launch.world_size > 1:
        raise ValueError(
            f"--device: expected 'cuda' under torchrun (rank r uses cuda:LOCAL_RANK), got {device!r}. Fix: pass "
            "--device cuda, and CUDA_VISIBLE_DEVICES to choose which GPUs a node's ranks use."
        )
    index = launch.local_rank if dev.index is None else dev.index
    return check_device(f"cuda:{index}", f"--device cuda on LOCAL_RANK {launch.local_rank}")


class ProcessGroup:
    """The process's member of the default torch.distributed group; collectives raise `DistributedError`.

    Args:
        launch: this process's place (`Launch.from_env`).
        device: "cpu" or "cuda" (the rank's GPU is ``cuda:LOCAL_RANK``); picks the backend (gloo / nccl).
        timeout_s: how long joining the group and every collective wait for the other ranks.

    Attributes:
        rank, world_size, local_rank: from `launch`.
        device: this rank's device; backend: "nccl" or "gloo".

    Example:
        >>> import socket
        >>> with socket.socket() as s:
        ...     s.bind(("127.0.0.1", 0)); port = str(s.getsockname()[1])
        >>> env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        >>> with ProcessGroup(Launch.from_env(env), "cpu", timeout_s=30, environ=env) as group:
        ...     group.all_reduce_sum(torch.ones(2), "a test sum").tolist()
        [1.0, 1.0]
    """

    def __init__(
        self, launch: Launch, device: str, *, timeout_s: float, environ: Mapping[str, str] | None = None
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"--dist-timeout: expected seconds > 0, got {timeout_s!r}. Fix: pass e.g. 300.")
        self.rank, self.local_rank, self.world_size = launch.rank, launch.local_rank, launch.world_size
        self.device = rank_device(device, launch)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.timeout_s = float(timeout_s)
        if dist.is_initialized():
            raise RuntimeError(
                "ProcessGroup: torch.distributed is already initialised in this process. Fix: create one "
                "ProcessGroup per process and close it (or use it as a context manager) before making another."
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        store = None
        if environ is not None:  # an explicit environment (tests, doctests): its rendezvous, not os.environ's
            store = dist.TCPStore(
                environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), self.world_size, is_master=self.rank == 0,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )  # fmt: skip
        with self.guard("joining the process group (rendezvous at MASTER_ADDR:MASTER_PORT)"):
            dist.init_process_group(
                self.backend, store=store, rank=self.rank, world_size=self.world_size,
                timeout=datetime.timedelta(seconds=self.timeout_s),
                device_id=self.device if self.device.type == "cuda" else None,
            )  # fmt: skip

    @classmethod
    def from_env(cls, device: str, *, timeout_s: float) -> ProcessGroup | None:
        """The group of a torchrun launch, or None when this process was not started by torchrun."""
        launch = Launch.from_env()
        return None if launch is None else cls(launch, device, timeout_s=timeout_s)

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turns a failing collective inside the block into a `DistributedError` that names it and this rank."""
        try:
            yield
        except DistributedError:
            raise
        except RuntimeError as error:  # dist.DistBackendError, gloo's "Connection closed by peer", timeouts
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: {what} did not complete ({self.backend}: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}). Another "
                f"rank has most likely died or hung (a collective waits at most {self.timeout_s:g} s, "
                "--dist-timeout). Fix: find the rank that failed first (torchrun's summary names it and its exit "
                "code; its own error is above), fix that, and rerun the same command."
            ) from error

    def all_reduce_sum(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        with self.guard(what):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast(self, tensors: Sequence[torch.Tensor], what: str, src: int = 0) -> None:
        """Overwrites `tensors` on every rank with rank `src`'s, in place."""
        with self.guard(what):
            for tensor in tensors:
                dist.broadcast(tensor, src=src)

    def all_gather(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """(G, *tensor.shape): every rank's `tensor` (same shape everywhere), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self.guard(what):
            dist.all_gather(out, tensor.contiguous())
        return torch.stack(out)

    def close(self) -> None:
        """Leaves the group (idempotent)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GradientMean:
    """Averages gradients over the ranks with one all-reduce of a flat float32 buffer (allocated once).

    Example (one rank, so the mean is the gradient itself):
        >>> import socket
        >>> with socket.socket() as s:
        ...     s.bind(("127.0.0.1", 0)); port = str(s.getsockname()[1])
        >>> env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        >>> w = torch.ones(3, requires_grad=True); (2 * w).sum().backward()
        >>> with ProcessGroup(Launch.from_env(env), "cpu", timeout_s=30, environ=env) as group:
        ...     GradientMean(group)([w], "gradient all-reduce")
        >>> w.grad.tolist()
        [2.0, 2.0, 2.0]
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self._flat: torch.Tensor | None = None

    def __call__(self, params: Sequence[torch.Tensor], what: str) -> None:
        """Replaces each ``p.grad`` with its mean over the ranks (params without a gradient are skipped)."""
        grads = [p.grad for p in params if p.grad is not None]
        reduce_sum = lambda flat: self.group.all_reduce_sum(flat, what)  # noqa: E731
        self._flat = average_gradients_(grads, reduce_sum, self.group.world_size, self._flat)


@torch.no_grad()
def average_gradients_(
    grads: Sequence[torch.Tensor],
    reduce_sum: Callable[[torch.Tensor], object],
    world_size: int,
    flat: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Replaces each of `grads` with its mean over `world_size` ranks through one flat float32 buffer.

    `reduce_sum` sums the buffer over the ranks in place (an all-reduce on the group the gradients belong to);
    `flat` is reused when it fits. Returns the buffer (`flat` unchanged when there are no gradients).
    """
    if not grads:
        return flat
    numel = sum(g.numel() for g in grads)
    if flat is None or flat.numel() != numel or flat.device != grads[0].device:
        flat = torch.empty(numel, dtype=torch.float32, device=grads[0].device)
    torch.cat([g.reshape(-1).float() for g in grads], out=flat)
    reduce_sum(flat)
    flat.div_(world_size)
    for grad, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(piece.view_as(grad))
    return flat
