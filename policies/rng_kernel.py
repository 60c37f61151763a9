"""The counter-based streams' hash (`rng.bits_reference`) as one Triton kernel, bit-identical to the PyTorch ops.

`rng.bits_reference` evaluates the hash of (seed, counter, stream, element index) as 94 elementwise int64
PyTorch kernels; `bits` computes the same (N, numel) 32-bit values in one launch, optionally already converted to
the uniforms of `rng.uniform` (``((bits >> 8) + 0.5) * 2^-24`` in float32). Only integer operations and that
conversion (a cast exact below 2^24, one IEEE add, a power-of-two product), so the results are bitwise the
reference's on every device:

1. The reference works on int64 holding values below 2^32 and masks every product ``(x * M) & 0xFFFFFFFF``
   (multipliers below 2^31, so the int64 product does not overflow); the kernel computes in uint32, whose
   products wrap modulo 2^32 to the same low 32 bits, and whose right shifts are logical, as the reference's are
   on its non-negative values.
2. The 64-bit seed and counter enter as their low and high 32-bit halves: ``x & 0xFFFFFFFF`` is the truncation
   to uint32, ``(x >> 32) & 0xFFFFFFFF`` the truncation of the arithmetic shift, for negative values too.
3. The stream enters through ``(stream * 0x27D4EB2F) & 0xFFFFFFFF``, computed here on the host in Python
   integers, as the reference does.

Where it runs (`serves`): CUDA integer tensors, and CPU ones under ``TRITON_INTERPRET=1`` (set before import;
the CPU tests). `rng` keeps the PyTorch ops for everything else (CPU, no Triton). The launch allocates only its
output, syncs nothing, and takes the sizes, strides and the stream as runtime arguments, so one compilation serves
every batch size and draw shape, inside CUDA graphs too.

Example:
    >>> import torch
    >>> from policies import rng
    >>> seeds, counters = torch.tensor([3, -7]), torch.tensor([0, 2**40])  # CPU: served under the interpreter
    >>> want = rng.bits_reference(seeds, counters, rng.STREAM_X0, 5)
    >>> not serves(seeds, counters, 5) or bool(torch.equal(bits(seeds, counters, rng.STREAM_X0, 5), want))
    True
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "") == "1"
"""Whether Triton's CPU interpreter runs the kernel (TRITON_INTERPRET=1 at import): tests only."""

_BLOCK = 1024
_MAX_ELEMENTS = 2**40  # N * numel: far below CUDA's grid limit of 2^31 - 1 blocks
_MASK32 = 0xFFFFFFFF
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

if HAS_TRITON:  # pragma: no cover - needs a CUDA GPU or the interpreter
    import triton
    import triton.language as tl

    @triton.jit
    def _mix32(x):
        # rng._mix32 on uint32: products wrap modulo 2**32, shifts are logical
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x046CA68B
        x = x ^ (x >> 16)
        return x

    @triton.jit(do_not_specialize=["total", "numel", "seed_stride", "counter_stride", "stream_term"],
                do_not_specialize_on_alignment=["seed_ptr", "counter_ptr"])  # fmt: skip
    def _bits_kernel(
        seed_ptr, counter_ptr, out_ptr, total, numel, seed_stride, counter_stride, stream_term,
        UNIFORM: tl.constexpr, BLOCK: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # One block of the flat (N * numel) output; element (row, col) hashes col with its row's key (rng._key).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < total
        row = offs // numel
        col = offs - row * numel
        seed = tl.load(seed_ptr + row * seed_stride, mask=keep, other=0).to(tl.int64)
        counter = tl.load(counter_ptr + row * counter_stride, mask=keep, other=0).to(tl.int64)
        h = _mix32(seed.to(tl.uint32))
        h = _mix32(h ^ (seed >> 32).to(tl.uint32) ^ 0x9E3779B9)
        h = _mix32(h ^ counter.to(tl.uint32))
        h = _mix32(h ^ (counter >> 32).to(tl.uint32) ^ 0x85EBCA6B)
        key = _mix32(h ^ stream_term.to(tl.uint32))
        x = _mix32(_mix32(col.to(tl.uint32) ^ key) ^ (key * 0x165667B1))
        if UNIFORM:  # rng.uniform's conversion: 24 bits, exact in float32, then a tie-to-even add and a power of 2
            out = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        else:
            out = x.to(tl.int64)
        tl.store(out_ptr + offs, out, mask=keep)


def serves(seeds: torch.Tensor, counters: torch.Tensor, numel: int) -> bool:
    """Whether `bits` serves these (N,) seeds and counters: integers on one CUDA device (CPU: the interpreter)."""
    return (
        HAS_TRITON
        and seeds.dim() == 1
        and counters.shape == seeds.shape
        and seeds.device == counters.device
        and seeds.dtype in _INTS
        and counters.dtype in _INTS
        and seeds.shape[0] * numel <= _MAX_ELEMENTS
        and (seeds.is_cuda or (INTERPRETED and seeds.device.type == "cpu"))
    )


def bits(seeds: torch.Tensor, counters: torch.Tensor, stream: int, numel: int, uniform: bool = False) -> torch.Tensor:
    """`rng.bits_reference(seeds, counters, stream, numel)`: (N, numel) int64 values below 2^32, in one kernel.

    With `uniform`, (N, numel) float32: those values as `rng.uniform` converts them. Callers test `serves` first.
    """
    n = seeds.shape[0]
    out = torch.empty((n, numel), dtype=torch.float32 if uniform else torch.int64, device=seeds.device)
    total = n * numel
    if total == 0:
        return out
    term = (stream * 0x27D4EB2F) & _MASK32  # rng._key's stream term, as a signed 32-bit argument (one signature)
    term = term - (1 << 32) if term >= 1 << 31 else term
    _bits_kernel[(triton.cdiv(total, _BLOCK),)](
        seeds, counters, out, total, numel, seeds.stride(0), counters.stride(0), term,
        UNIFORM=uniform, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    return out
