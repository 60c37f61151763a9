"""Counter-based random streams computed on the device (DESIGN C3).

Every random input of env i is a pure function of (seed_i, counter_i, draw kind, element index), evaluated
with a vectorised integer hash. There is no generator state, no host sync, and the result for env i does not
depend on which other envs share the batch, on padding, or on the batch bucket -- so padded/split/grouped
calls are bit-identical to single-env calls in stochastic modes too. Works inside CUDA graphs (pure tensor
ops on static buffers). On CUDA the hash (and the uniform conversion) runs as one Triton kernel
(`policies.rng_kernel`), bitwise equal to the PyTorch ops of `bits_reference`, which serve everywhere else.

Example:
    >>> import torch
    >>> seeds = torch.tensor([1, 2]); counters = torch.tensor([0, 0])
    >>> a = normal(seeds, counters, STREAM_X0, (3,))
    >>> b = normal(seeds[1:], counters[1:], STREAM_X0, (3,))
    >>> bool(torch.equal(a[1:], b))
    True
"""

from __future__ import annotations

import math

import torch

from policies import rng_kernel

STREAM_X0 = 1
"""Draw kind: the initial noise x_0 of the denoise chain."""
STREAM_XI = 2
"""Draw kind: per-step noise xi_i of stochastic denoise steps."""
STREAM_J = 3
"""Draw kind: the stochastic step index j."""
STREAM_AUX = 4
"""Draw kind: anything else (baseline policies, tests)."""

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31 so that a 32-bit value times a multiplier stays below 2**63 in int64.
_M1 = 0x7FEB352D
_M2 = 0x046CA68B


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash on int64 tensors holding values in [0, 2**32)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    x = x ^ (x >> 16)
    return x


def _key(seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """(N,) 32-bit key from the 64-bit seed, the call counter and the draw kind."""
    seeds = seeds.to(torch.int64)
    counters = counters.to(torch.int64)
    h = _mix32(seeds & _MASK32)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ (counters & _MASK32))
    h = _mix32(h ^ ((counters >> 32) & _MASK32) ^ 0x85EBCA6B)
    return _mix32(h ^ (stream * 0x27D4EB2F & _MASK32))


def bits_reference(seeds: torch.Tensor, counters: torch.Tensor, stream: int, numel: int) -> torch.Tensor:
    """(N, numel) independent 32-bit values (int64), as PyTorch ops: the definition `rng_kernel.bits` computes."""
    key = _key(seeds, counters, stream)[:, None]
    idx = torch.arange(numel, device=key.device, dtype=torch.int64)[None, :]
    return _mix32(_mix32(idx ^ key) ^ (key * 0x165667B1 & _MASK32))


def uniform(seeds: torch.Tensor, counters: torch.Tensor, stream: int, shape: tuple[int, ...]) -> torch.Tensor:
    """(N, *shape) float32 uniforms in (0, 1] (1.0 with probability 2^-24: the + 0.5 of the top value ties to even).

    The hash and this conversion run as one kernel where `rng_kernel` serves (CUDA), else as `bits_reference`'s
    PyTorch ops; the two are bitwise equal.
    """
    numel = math.prod(shape)
    if rng_kernel.serves(seeds, counters, numel):
        u = rng_kernel.bits(seeds, counters, stream, numel, uniform=True)
    else:
        bits = bits_reference(seeds, counters, stream, numel) >> 8  # 24 bits
        u = (bits.to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return u.reshape(seeds.shape[0], *shape)


def normal(seeds: torch.Tensor, counters: torch.Tensor, stream: int, shape: tuple[int, ...]) -> torch.Tensor:
    """(N, *shape) float32 standard normals (Box-Muller on two hashed uniforms per element)."""
    numel = math.prod(shape)
    u = uniform(seeds, counters, stream, (2, numel))
    radius = torch.sqrt(-2.0 * torch.log(u[:, 0]))
    z = radius * torch.cos((2.0 * math.pi) * u[:, 1])
    return z.reshape(seeds.shape[0], *shape)


def randint(seeds: torch.Tensor, counters: torch.Tensor, stream: int, high: torch.Tensor | int) -> torch.Tensor:
    """(N,) int64 uniform integers in [0, high) (high may be a per-env tensor)."""
    u = uniform(seeds, counters, stream, (1,))[:, 0]
    high_t = torch.as_tensor(high, device=u.device, dtype=torch.float32)
    return torch.clamp((u * high_t).to(torch.int64), max=(high_t - 1).to(torch.int64))


def explicit_counters(where: str, counters: object, n: int, device: torch.device, seeds: object = None) -> torch.Tensor:
    """`counters` of a side-effect-free call as (N,) int64 on `device`; refuses a bad shape or `seeds` beside it."""
    if seeds is not None:
        raise ValueError(
            f"{where}: got both `seeds` and `counters`; a call with explicit counters draws from the streams' "
            "current seeds and changes nothing. Fix: pass one of them (seed the streams first, then read "
            "their counters with stream_state())."
        )
    counters_t = torch.as_tensor(counters)
    if counters_t.shape != (n,) or counters_t.is_floating_point() or counters_t.dtype == torch.bool:
        raise ValueError(
            f"{where}: argument `counters` must be {n} integer counters (one per observation row), got "
            f"{counters_t.dtype} of shape {tuple(counters_t.shape)}. Fix: pass stream_state(env_ids)[1]."
        )
    return counters_t.to(device=device, dtype=torch.int64)


class StreamTable:
    """Per-env (seed, counter) pairs on a device, addressed by env id, growing on demand.

    Example:
        >>> t = StreamTable(torch.device("cpu"))
        >>> t.set_seeds(torch.tensor([0, 1]), torch.tensor([10, 11]))
        >>> s, c = t.take(torch.tensor([1]))
        >>> int(s[0]), int(c[0])
        (11, 0)
        >>> int(t.counters[1])
        1
    """

    def __init__(self, device: torch.device, size: int = 64) -> None:
        self.device = device
        self.seeds = torch.arange(size, dtype=torch.int64, device=device)
        self.counters = torch.zeros(size, dtype=torch.int64, device=device)

    def _grow(self, env_ids: torch.Tensor, upper: int | None) -> None:
        size = self.seeds.shape[0]
        need = upper if upper is not None else size
        if need <= size:
            return
        new = max(need, 2 * size)
        seeds = torch.arange(new, dtype=torch.int64, device=self.device)
        seeds[:size] = self.seeds
        counters = torch.zeros(new, dtype=torch.int64, device=self.device)
        counters[:size] = self.counters
        self.seeds, self.counters = seeds, counters

    def set_seeds(self, env_ids: torch.Tensor, seeds: torch.Tensor, upper: int | None = None) -> None:
        """Set the seeds of `env_ids` and zero their counters (`upper` = an upper bound of env_ids + 1)."""
        self._grow(env_ids, upper)
        self.seeds[env_ids] = seeds.to(device=self.device, dtype=torch.int64)
        self.counters[env_ids] = 0

    def take(self, env_ids: torch.Tensor, upper: int | None = None, advance: bool = True) -> tuple[torch.Tensor, ...]:
        """(seeds, counters) for `env_ids` as of now; then advance their counters by one."""
        self._grow(env_ids, upper)
        seeds = self.seeds[env_ids]
        counters = self.counters[env_ids]
        if advance:
            self.counters[env_ids] = counters + 1
        return seeds, counters

    def advance(self, env_ids: torch.Tensor, counters: torch.Tensor, upper: int | None = None) -> None:
        """Record a call that drew from `counters`: the counters of `env_ids` become ``counters + 1``."""
        self._grow(env_ids, upper)
        self.counters[env_ids] = counters.to(device=self.device, dtype=torch.int64) + 1

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the whole table (for tests that check streams are unchanged)."""
        return self.seeds.clone(), self.counters.clone()
