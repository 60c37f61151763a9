"""One Triton kernel for multi-query attention: folded query rows against one K/V head, split over the keys.

The denoise loop's attention is H action tokens x Nh query heads against one K/V head of S = T + H keys (the prefix
cache and the action tokens' own K/V). Folding the heads that share the K/V head into Nh * H query rows (as the
"gemm" backend does), one program computes a block of rows over one contiguous range of keys with an online softmax
(flash-decoding): float32 scores from half operands, the additive key mask added in float32, probabilities cast to
the value dtype for the second product, float32 accumulation. With one key range per row block the program
normalises and writes the output itself; with several (small batches, where row blocks alone would occupy a few SMs)
each writes its float32 partial (sum, max, normaliser) and a second kernel combines them, all ranges of a row in one
tile reduction (a fixed order). Either way the call is deterministic and graph-capturable, and it replaces the
"gemm" path's five kernels (scores GEMM, softmax, cast, PV GEMM with its split-K reduce). K and V arrive by TMA, one
copy per key block through a (batch, keys, width) descriptor whose bounds zero-fill the ragged last block (18 %
faster than per-thread pointer copies at the expert's (a) batch 64 shape, `attention_variants.jsonl` at 253b626).
The prefix LM's calls (all prefix tokens against the prefix keys) run it too. The launch geometry (`Tiles`: rows and
keys per program, warps, pipeline stages) follows the call's size (`tiles_for`); the softmax runs in base 2 (exp2 of
scores scaled by log2(e)).

Rounding: as "gemm" (`attention._gemm`) up to float32 summation order, except that the probabilities are cast to
the value dtype before normalisation instead of after (each rounds once, relative error 2^-9 either way).

Where it runs: CUDA half tensors outside autograd with one K/V head and a head width from 8 to 256
(`serves`); under ``TRITON_INTERPRET=1`` also half CPU tensors (the CPU tests). Everything else is the caller's
to route ("triton" in `attention.attend` hands it to "gemm").

Example:
    >>> import torch
    >>> q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 1, 9, 16), torch.randn(1, 1, 9, 16)
    >>> out = reference(q, k, v, None, 0.25)
    >>> tuple(out.shape)
    (1, 4, 3, 16)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels

LOG2E = 1.4426950408889634
"""log2(e): the kernel's softmax runs in base 2 (exp2), its scores scaled by ``scale * LOG2E``."""
TARGET_PROGRAMS = 132
"""Programs to aim for when splitting the keys (the H200's SM count: one full wave)."""
MAX_SPLITS = 32
"""Most key ranges per row block (the combine kernel reads their maxima as one tile)."""
COMBINE_D = 64
"""Columns per combine program (one row, all key ranges): small, so that many programs load the partials at once."""


@dataclass(frozen=True)
class Tiles:
    """The kernel's launch geometry: folded query rows per program, keys per inner iteration, warps, pipeline stages.

    Example:
        >>> Tiles().block_m, Tiles(block_m=128).block_n
        (64, 64)
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


SMALL_TILES = Tiles(block_m=64, block_n=64, num_warps=4, num_stages=2)
"""Calls whose 128-row blocks fill less than one wave: small batches (split over the keys where even 64-row blocks do
not fill it). The fastest or within 0.3 us of it at (a) / (b) batch 1 on the H200 (`attention_backend.jsonl` rows with
``tune``): expert 12.4 / 11.7 us, prefix 35.7 / 22.1 us."""
LARGE_TILES = Tiles(block_m=128, block_n=64, num_warps=8, num_stages=2)
"""Calls with at least a wave of 128-row blocks (one key range each): the expert at large batch, the prefix LM beyond
batch 1. The fastest of 36 geometries at (a) / (b) batch 64 on the H200: expert (50 queries) 101.5 / 68.6 us against
190 / 126 us at 64 rows, 8 warps; prefix 1,323 / 510 us (SDPA: 1,730 / 730)."""


def tiles_for(batch: int, rows: int) -> Tiles:
    """`LARGE_TILES` where its row blocks alone fill a wave of `TARGET_PROGRAMS`, else `SMALL_TILES`.

    Example:
        >>> tiles_for(64, 400) == LARGE_TILES, tiles_for(1, 400) == SMALL_TILES
        (True, True)
    """
    return LARGE_TILES if batch * _cdiv(rows, LARGE_TILES.block_m) >= TARGET_PROGRAMS else SMALL_TILES


if kernels.HAS_TRITON:  # pragma: no cover - needs a CUDA GPU or the interpreter
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _attend_block(
        q, m_i, l_i, acc, k_desc, v_desc, m_ptr, block, bi, b, n_keys, scale, m_b,
        HAS_MASK: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # One block of BLOCK_N keys folded into the running (max, normaliser, unnormalised sum) of the rows, in
        # base 2: `scale` carries log2(e), so exp2 of the scores is exp of the natural-log scores. K and V arrive
        # by TMA (one copy a block each); the descriptors' bounds zero-fill keys past n_keys and columns past HD.
        keys = block * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < n_keys
        k = k_desc.load([bi, block * BLOCK_N, 0]).reshape(BLOCK_N, D)
        if INTERPRET:  # the interpreter's tl.dot misreads bfloat16; half products are exact in float32
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale  # (BLOCK_M, BLOCK_N) float32
        if HAS_MASK:  # the additive mask is finite (MASK_VALUE), so a fully masked block stays finite
            s = s + tl.load(m_ptr + b * m_b + keys, mask=key_ok, other=0.0).to(tl.float32)[None, :]
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        vt = v_desc.load([bi, block * BLOCK_N, 0]).reshape(BLOCK_N, D)
        pv = p.to(vt.dtype)
        if INTERPRET:
            pv, vt = pv.to(tl.float32), vt.to(tl.float32)
        return m_new, l_i * alpha + tl.sum(p, axis=1), tl.dot(pv, vt, acc * alpha[:, None])

    @triton.jit(do_not_specialize=["n_keys", "iters", "splits", "m_b"])
    def _attend_split_kernel(
        q_ptr, k_desc, v_desc, m_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr,
        rows, inner, n_keys, iters, splits, scale, q_b, q_outer, q_inner, m_b, o_b,
        HAS_MASK: tl.constexpr, INTERPRET: tl.constexpr,  # noqa: N803
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, HD: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # Program (row block, key range, batch row). Row r of the folded queries is (r // inner, r % inner) in
        # q's (outer, inner) dimensions: (token, head) when q is token-major, (head, token) otherwise. Shape-
        # dependent sizes are runtime values (not specialised): one compiled kernel serves every batch bucket.
        pid_m, pid_s, bi = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b = bi.to(tl.int64)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)  # the head width HD padded to a power of two (zeros beyond it)
        d_ok = d < HD
        row_ok = r < rows
        q_rows = b * q_b + (r // inner) * q_outer + (r % inner) * q_inner
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if INTERPRET:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        first = pid_s * iters  # this range's first key block; only the last range is ragged
        if INTERPRET:  # the interpreter runs no `for` over a runtime bound
            i = 0
            while i < iters:
                m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k_desc, v_desc, m_ptr, first + i, bi, b, n_keys,
                                              scale, m_b, HAS_MASK, INTERPRET, BLOCK_N, D)  # fmt: skip
                i += 1
        else:
            for i in range(0, iters):
                m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k_desc, v_desc, m_ptr, first + i, bi, b, n_keys,
                                              scale, m_b, HAS_MASK, INTERPRET, BLOCK_N, D)  # fmt: skip
        if splits > 1:  # float32 partials (B, splits, rows[, HD]) for the combine kernel
            part = (b * splits + pid_s) * rows + r
            tl.store(po_ptr + part[:, None] * HD + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(pm_ptr + part, m_i, mask=row_ok)
            tl.store(pl_ptr + part, l_i, mask=row_ok)
        else:
            out = acc / l_i[:, None]
            tl.store(o_ptr + b * o_b + r[:, None] * HD + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip

    @triton.jit(do_not_specialize=["rows", "splits", "o_b"])
    def _attend_combine_kernel(
        po_ptr, pm_ptr, pl_ptr, o_ptr, rows, splits, o_b,
        MAX_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, HD: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # Program (row, column block, batch row): every key range's partial of the row as one (MAX_SPLITS,
        # BLOCK_D) tile, weighted by exp(m_s - max m_s) and reduced at once (one round of loads, no loop).
        r, pid_d, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        ranges = tl.arange(0, MAX_SPLITS)
        d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        used = ranges < splits
        part = (b * splits + ranges) * rows + r  # (MAX_SPLITS,)
        m_s = tl.load(pm_ptr + part, mask=used, other=float("-inf"))
        w = tl.exp2(m_s - tl.max(m_s, axis=0))  # 0 for the unused ranges (maxima in base 2)
        den = tl.sum(w * tl.load(pl_ptr + part, mask=used, other=0.0), axis=0)
        acc = tl.load(po_ptr + part[:, None] * HD + d[None, :], mask=used[:, None] & (d < HD)[None, :], other=0.0)
        out = tl.sum(w[:, None] * acc, axis=0) / den
        tl.store(o_ptr + b * o_b + r * HD + d, out.to(o_ptr.dtype.element_ty), mask=d < HD)


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `attend` runs this call: CUDA half (or the interpreter), no autograd, one K/V head, 8..256 wide.

    K and V must be addressable by TMA: a 16-byte aligned start, batch and key strides of whole 16-byte units.
    """
    hd = q.shape[-1]
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    tma = all(
        x.data_ptr() % 16 == 0 and all(x.stride(i) * x.element_size() % 16 == 0 or x.shape[i] == 1 for i in (0, 2))
        for x in (k, v)
    )
    return (
        kernels.triton_serves(q)
        and not needs_grad
        and k.shape[1] == 1
        and k.dtype == v.dtype == q.dtype
        and 8 <= hd <= 256
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and tma
    )


def num_splits(batch: int, rows: int, keys: int, tiles: Tiles = SMALL_TILES) -> int:
    """Key ranges per row block: enough programs for one wave (`TARGET_PROGRAMS`), at most one per key block."""
    programs = batch * _cdiv(rows, tiles.block_m)
    return max(1, min(_cdiv(keys, tiles.block_n), TARGET_PROGRAMS // programs, MAX_SPLITS))


def _cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
    splits: int | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Attention of q (B, Nh, T, hd) over one K/V head (B, 1, S, hd); `key_mask` additive (B or 1, 1, 1, S) or None.

    Returns (B, Nh, T, hd) in q's dtype, laid out as q (a token-major q gives a token-major result, whose
    o-projection reshape is free). `splits` (the number of key ranges, default `num_splits`) and `tiles` (the launch
    geometry, default `tiles_for`) are benchmarks' overrides.
    """
    b, n, t, hd = q.shape
    s = k.shape[2]
    token_major = q.stride(1) < q.stride(2)
    inner = n if token_major else t
    q_outer, q_inner = (q.stride(2), q.stride(1)) if token_major else (q.stride(1), q.stride(2))
    rows = n * t
    width = max(16, 1 << (hd - 1).bit_length())  # the head width as a power of two
    out = torch.empty(b, rows, hd, dtype=q.dtype, device=q.device)
    if key_mask is not None:
        if key_mask.dtype == torch.bool:
            raise TypeError("attention_kernel.attend: key_mask must be an additive mask (attention.additive_mask)")
        mask = key_mask.reshape(key_mask.shape[0], s)
        m_b = mask.stride(0) if mask.shape[0] > 1 else 0
        assert mask.stride(1) == 1
    else:
        mask, m_b = q.new_empty(1), 0  # never read
    tiles = tiles or tiles_for(b, rows)
    block_m, block_n = tiles.block_m, tiles.block_n
    splits = min(splits or num_splits(b, rows, s, tiles), MAX_SPLITS)
    iters = _cdiv(_cdiv(s, block_n), splits)  # key blocks per range
    splits = _cdiv(_cdiv(s, block_n), iters)
    if splits > 1:
        part_o = torch.empty(b, splits, rows, hd, dtype=torch.float32, device=q.device)
        part_m = torch.empty(b, splits, rows, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_o, part_m, part_l = (torch.empty(1, dtype=torch.float32, device=q.device) for _ in range(3))  # unused
    m_blocks = _cdiv(rows, block_m)
    k_desc, v_desc = (TensorDescriptor(x[:, 0], [b, s, hd], [x.stride(0) if b > 1 else s * x.stride(2), x.stride(2), 1],
                                       [1, block_n, width]) for x in (k, v))  # fmt: skip
    _attend_split_kernel[(m_blocks, splits, b)](
        q, k_desc, v_desc, mask, out, part_o, part_m, part_l,
        rows, inner, s, iters, splits, scale * LOG2E, q.stride(0), q_outer, q_inner, m_b, out.stride(0),
        HAS_MASK=key_mask is not None, INTERPRET=kernels.INTERPRETED,
        BLOCK_M=block_m, BLOCK_N=block_n, D=width, HD=hd, num_warps=tiles.num_warps if width >= 128 else 4,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    if splits > 1:
        block_d = min(COMBINE_D, width)
        _attend_combine_kernel[(rows, _cdiv(hd, block_d), b)](part_o, part_m, part_l, out, rows, splits, out.stride(0),
                                                              MAX_SPLITS=MAX_SPLITS, BLOCK_D=block_d, HD=hd,
                                                              num_warps=4)  # fmt: skip
    if token_major:
        return out.view(b, t, n, hd).transpose(1, 2)
    return out.view(b, n, t, hd)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """What `attend` computes, in float32 PyTorch: softmax(scale q k^T + mask) v over the shared K/V head."""
    scores = torch.einsum("bntd,bsd->bnts", q.float(), k[:, 0].float()) * scale
    if key_mask is not None:
        scores = scores + key_mask.float().reshape(key_mask.shape[0], 1, 1, -1)
    return torch.einsum("bnts,bsd->bntd", torch.softmax(scores, dim=-1), v[:, 0].float())
