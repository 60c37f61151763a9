"""Candidate schedules of the Triton attention kernel at the expert's large-batch shapes, alone in CUDA graphs.

    python -m benchmarks.bench_attention_variants [--out DIR]    # on an sm90 GPU; rows -> attention_variants.jsonl

Why: at case (a) batch 64 the expert's attention (`attention_kernel`, 8 x 50 folded query rows over 1,018 keys of
one K/V head, head width 256) is 180 calls of ~108 us in the denoise loop, 19.4 ms of the 536.7 ms call, at ~260
TFLOP/s of useful work, while FlashAttention-4 runs the prefix LM's attention at ~560. The shipped kernel loads K and
V through per-thread pointers (`cp.async`: eight 16-byte copies a thread and tensor a key block, their addresses
and masks in registers; `compile_sm90`-style facts: 253 registers at 128 x 64, 8 warps). The candidate here, ``tma``,
reads each key block of K and V with one TMA copy through a 3-D descriptor (batch, keys, width) whose bounds
zero-fill the ragged last block (masked to -inf in the scores as before): 228 registers at the same tiles, no
address arithmetic in the loop. It is swept over the launch geometries that fit shared memory, beside the shipped
kernel at its default geometry and FlashAttention-4 (`flash_attn.cute`, where installed) on the same keys moved
valid-first outside the timed call (its kernel time alone, without the scatter the "flash" backend adds).

Each row: ``case``, ``env_batch``, ``variant``, the geometry, ``us_per_call`` (median graph replay of 20 calls),
``tflops`` (useful FLOPs: 4 x rows x keys x width a batch row) and ``max_rel_err`` against the float32 reference.
Under ``TRITON_INTERPRET=1`` `attend_tma` also runs on CPU half tensors (`tests/benchmarks`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_attention_backend import site_inputs
from benchmarks.bench_expert_attention import graph_time_us
from benchmarks.common import run_cli, write_rows
from policies.pi05 import attention, attention_kernel, kernels
from policies.pi05.attention_kernel import LOG2E, Tiles

BENCH = "attention_variants"
GEOMETRIES = (Tiles(128, 64, 8, 2), Tiles(128, 32, 8, 3), Tiles(128, 32, 8, 4), Tiles(64, 32, 4, 2),
              Tiles(64, 32, 4, 3), Tiles(64, 64, 4, 2))  # fmt: skip
SHAPES = (("a", 64), ("b", 64), ("a", 32))

if kernels.HAS_TRITON:  # pragma: no cover - needs a CUDA GPU or the interpreter
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _tma_block(q, m_i, l_i, acc, k_desc, v_desc, m_ptr, start, bi, b, n_keys, scale, m_b,
                   HAS_MASK: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):  # noqa: N803
        k = k_desc.load([bi, start, 0]).reshape(BLOCK_N, D)
        if INTERPRET:  # the interpreter's tl.dot misreads bfloat16
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < n_keys
        if HAS_MASK:
            s = s + tl.load(m_ptr + b * m_b + keys, mask=key_ok, other=0.0).to(tl.float32)[None, :]
        s = tl.where(key_ok[None, :], s, float("-inf"))  # the descriptor zero-fills keys past n_keys
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = v_desc.load([bi, start, 0]).reshape(BLOCK_N, D)
        pv = p.to(v.dtype)
        if INTERPRET:
            pv, v = pv.to(tl.float32), v.to(tl.float32)
        return m_new, l_i * alpha + tl.sum(p, axis=1), tl.dot(pv, v, acc * alpha[:, None])

    @triton.jit(do_not_specialize=["n_keys", "m_b"])
    def _attend_tma_kernel(
        q_ptr, k_desc, v_desc, m_ptr, o_ptr, rows, inner, n_keys, scale, q_b, q_outer, q_inner, m_b, o_b,
        HAS_MASK: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # noqa: N803
        D: tl.constexpr, STAGES: tl.constexpr,  # noqa: N803
    ):  # fmt: skip
        # Program (row block, batch row), all keys in one range: the shipped kernel's splits == 1 path.
        pid_m, bi = tl.program_id(0), tl.program_id(1)
        b = bi.to(tl.int64)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        row_ok = r < rows
        q_rows = b * q_b + (r // inner) * q_outer + (r % inner) * q_inner
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
        if INTERPRET:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        if INTERPRET:  # the interpreter runs no `for` over a runtime bound
            start = 0
            while start < n_keys:
                m_i, l_i, acc = _tma_block(q, m_i, l_i, acc, k_desc, v_desc, m_ptr, start, bi, b, n_keys, scale, m_b,
                                           HAS_MASK, INTERPRET, BLOCK_N, D)
                start += BLOCK_N
        else:
            for start in tl.range(0, n_keys, BLOCK_N, num_stages=STAGES):
                m_i, l_i, acc = _tma_block(q, m_i, l_i, acc, k_desc, v_desc, m_ptr, start, bi, b, n_keys, scale, m_b,
                                           HAS_MASK, INTERPRET, BLOCK_N, D)
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * o_b + r[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def attend_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float,
               tiles: Tiles) -> torch.Tensor:  # fmt: skip
    """`attention_kernel.attend` through the ``tma`` kernel: q (B, Nh, T, 256), k/v (B, 1, S, 256), additive mask."""
    b, n, t, hd = q.shape
    s = k.shape[2]
    token_major = q.stride(1) < q.stride(2)
    inner = n if token_major else t
    q_outer, q_inner = (q.stride(2), q.stride(1)) if token_major else (q.stride(1), q.stride(2))
    rows = n * t
    out = torch.empty(b, rows, hd, dtype=q.dtype, device=q.device)
    mask = key_mask.reshape(key_mask.shape[0], s) if key_mask is not None else q.new_empty(1)
    m_b = mask.stride(0) if key_mask is not None and mask.shape[0] > 1 else 0
    k_desc, v_desc = (TensorDescriptor(x[:, 0], [b, s, hd], [x.stride(0), x.stride(2), 1], [1, tiles.block_n, hd])
                      for x in (k, v))  # fmt: skip
    _attend_tma_kernel[(triton.cdiv(rows, tiles.block_m), b)](
        q, k_desc, v_desc, mask, out, rows, inner, s, scale * LOG2E, q.stride(0), q_outer, q_inner, m_b,
        out.stride(0), HAS_MASK=key_mask is not None, INTERPRET=kernels.INTERPRETED, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, D=hd, STAGES=tiles.num_stages, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if token_major:
        return out.view(b, t, n, hd).transpose(1, 2)
    return out.view(b, n, t, hd)


def _flash_valid_first(x: dict[str, Any], scale: float):
    """FlashAttention-4 on K/V moved valid-first once (outside the timed call), or None where it does not run."""
    if attention.flash_attn_status() is not None:
        return None
    from flash_attn.cute import flash_attn_varlen_func

    kt, vt, lengths = attention._valid_first(x["k"].transpose(1, 2), x["v"].transpose(1, 2), x["mask"])
    qt = x["q"].transpose(1, 2)

    def call():
        return flash_attn_varlen_func(qt, kt, vt, seqused_k=lengths, softmax_scale=scale)[0].transpose(1, 2)

    return call


def measure(case: str, batch: int, device: torch.device) -> list[dict[str, Any]]:
    """The shipped kernel, every ``tma`` geometry and FlashAttention-4 at the expert's shape of (`case`, `batch`)."""
    x = site_inputs("expert", case, batch, device)
    shape = x["shape"]
    scale = shape["head_dim"] ** -0.5
    with torch.no_grad():
        ref = attention.attend(x["q"].float(), x["k"].float(), x["v"].float(), x["mask"], scale, "eager")
    mask = attention.additive_mask(x["mask"], torch.float32)
    flops = 4 * batch * shape["heads"] * shape["queries"] * shape["keys"] * shape["head_dim"]
    calls: list[tuple[dict[str, Any], Any]] = [
        ({"variant": "shipped", **vars(attention_kernel.tiles_for(batch, shape["heads"] * shape["queries"]))},
         lambda: attention_kernel.attend(x["q"], x["k"], x["v"], mask, scale)),
    ]  # fmt: skip
    calls += [({"variant": "tma", **vars(g)}, lambda g=g: attend_tma(x["q"], x["k"], x["v"], mask, scale, g))
              for g in GEOMETRIES]  # fmt: skip
    flash = _flash_valid_first(x, scale)
    if flash is not None:
        calls.append(({"variant": "flash (valid-first outside the call)", "kernel": attention.flash_kernel_name()},
                      flash))  # fmt: skip
    rows = []
    for desc, call in calls:
        row = {"case": case, "env_batch": batch, **shape, **desc}
        try:
            with torch.no_grad():
                out = call()
                row["max_rel_err"] = float((out.float() - ref).abs().max() / ref.abs().max())
                row["us_per_call"] = graph_time_us(call)
            row["tflops"] = flops / row["us_per_call"] / 1e6
            row["status"] = "ran"
        except Exception as err:  # noqa: BLE001 - record the exact failure (e.g. shared memory) and go on
            row["status"] = f"failed: {type(err).__name__}: {err}"[:800]
        print(row, flush=True)
        rows.append(row)
    return rows


def run(out: Path | None = None) -> list[dict[str, Any]]:
    """All `SHAPES`; appends rows to ``attention_variants.jsonl`` under `out`."""
    device = torch.device("cuda")
    rows = []
    for case, batch in SHAPES:
        rows += write_rows(BENCH, measure(case, batch, device), out)
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    run_cli(run, BENCH, __doc__)
