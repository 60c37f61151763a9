"""Weight sync across processes (DESIGN C6): a two-phase broadcast over `torch.distributed`, tensors only.

Every rank of `group` calls `broadcast_weights` with the same `src`, `expected` and `bucket_bytes`; rank `src`
also passes the source. Nothing is pickled: `dist.broadcast` of tensors and one `dist.all_reduce`, so it runs on
gloo (CPU) and NCCL (GPU) alike.

1. Header int64[8] (magic, protocol, status, tensors, shape dims, name bytes, bucket bytes, version or -1), then
   the manifest int64[dtype codes | ndims | name lengths | shape dims | UTF-8 names, zero-padded]. The payload is
   one region per dtype (first-appearance order), its tensors back to back in manifest order.
2. Each rank with a policy opens its update with the staging buffers in manifest order and checks the manifest
   (names, shapes, duplicates, the expected set complete, the version increasing). A rank that refuses keeps
   receiving (into a scratch buffer) and votes no.
3. Each region is broadcast in buckets of at most `bucket_bytes`, two in flight. A receiver whose staging buffer
   of that dtype holds exactly the region's tensors (same model, same dtypes) receives straight into it; any
   other rank with a policy (rank src too) stages the tensors from the bucket, casting to its parameters' dtypes
   (a tensor spanning buckets is assembled first).
4. One vote: all_reduce(MIN) of (ok, -version, 2 x failed rank + phase), the rank's finiteness flag and-ed in on
   the device. Every rank commits with the same version (the given one, else the largest current + 1), or every
   rank aborts and keeps its own.

A rank that fails keeps taking part in every collective until the vote, so nobody hangs. A rank that dies makes
the others' collectives fail (at the latest at the process group's timeout): they abort, keep their weights and
raise `WeightSyncError`. A failure after the vote (a commit failing on a device) cannot be undone elsewhere; that
rank's policy then refuses to serve until a complete update (see `weight_sync`).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint import to_internal_name
from .weight_sync import (
    WeightSource,
    WeightSync,
    WeightSyncError,
    WeightSyncStateError,
    WeightUpdateReport,
    materialize,
    source_pairs,
)

DEFAULT_BUCKET_BYTES = 256 << 20
"""Payload bytes per broadcast (rounded up to 16). Rank src and ranks that stage from buckets hold at most two."""
_MAGIC = 0x5049_3035  # "PI05"
_PROTOCOL = 6
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)  # fmt: skip
"""Wire dtype codes: the index in this tuple."""


@dataclass
class _Entry:
    """One tensor of the manifest; `offset` is its byte offset in its dtype's region."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    value: Any = None  # rank src only: the source tensor (or DTensor)
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def broadcast_weights(
    sync: WeightSync | None,
    source: WeightSource | None = None,
    *,
    src: int = 0,
    group: Any = None,
    expected: str | Sequence[str] = "trainable",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    version: int | None = None,
    device: str | torch.device | None = None,
) -> WeightUpdateReport:
    """Broadcast weights from rank `src` into every rank's policy as one all-or-nothing update.

    Args:
        sync: this rank's `policy.weight_sync`, or None on a rank without a policy (a trainer-only source rank).
            `Pi05Policy.broadcast_weights(source, ...)` passes its own.
        source: on rank `src`: an `nn.Module` (its parameters; only `requires_grad` ones when
            `expected="trainable"`), a state dict, or (name, tensor) pairs; ignored elsewhere. DTensors are
            materialised with `.full_tensor()` while packing, a collective over their mesh.
        src: global rank of the source.
        group: process group (default: the world).
        expected: what every policy must receive ("trainable", "all" or a list of names), as in
            `begin_weight_update`; sent parameters outside a rank's expected set are skipped there.
        bucket_bytes: payload bytes per broadcast; bounds the extra memory per rank.
        version: the version every rank commits (> every current one); default the largest current + 1.
        device: device of the communication buffers; default the policy's CUDA device (or the current one)
            under NCCL, else CPU.

    Returns:
        This rank's report (a rank without a policy gets the manifest's names and sizes).

    Raises:
        WeightSyncError: on every rank when any rank refused or failed; every rank then keeps its weights and
            version. Also when a collective fails (a rank died, the group timed out).

    Example:
        >>> # every rank, after dist.init_process_group(...); rank 0 holds the trainer and no policy
        >>> report = broadcast_weights(None if rank == 0 else policy.weight_sync,
        ...                            trainer if rank == 0 else None)  # doctest: +SKIP
        >>> policy.broadcast_weights(None).version == policy.weight_version  # a rank with a policy  # doctest: +SKIP
        True
    """
    if int(bucket_bytes) < 1:
        raise WeightSyncError(f"broadcast_weights: bucket_bytes must be >= 1, got {bucket_bytes}; pass e.g. 256 << 20.")
    run = _Broadcast(sync, src, group, _comm_device(sync, group, device))
    try:
        return run.run(source, expected, -(-int(bucket_bytes) // 16) * 16, version)
    except WeightSyncError:
        run.abort()
        raise
    except Exception as err:  # a collective failed: another rank died or the group timed out
        run.abort()
        raise WeightSyncError(
            f"broadcast_weights: a collective failed on rank {run.rank} ({type(err).__name__}: {err}); another "
            "rank died or the process group timed out. This rank keeps its weights and version; rebuild the "
            "process group before the next broadcast."
        ) from err
    except BaseException:
        run.abort()
        raise


class _Broadcast:
    """One rank's side of one broadcast: the manifest, the buckets, the vote. Failures are recorded, not raised,
    until the vote (the rank keeps taking part in every collective).
    """

    def __init__(self, sync: WeightSync | None, src: int, group: Any, dev: torch.device) -> None:
        self.sync, self.src, self.group, self.dev = sync, src, group, dev
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.opened = False  # this call opened `sync`'s update (only that one is aborted here)
        self.ok, self.refused, self.error = True, False, None
        self.scratch: torch.Tensor | None = None
        self.cached: tuple[int, torch.Tensor] | None = None  # rank src: the last tensor's bytes (spans buckets)

    def fail(self, err: BaseException, refused: bool = False) -> None:
        if self.ok:
            self.ok, self.refused, self.error = False, refused, err

    def abort(self) -> None:
        if self.opened and self.sync is not None:
            with contextlib.suppress(WeightSyncStateError):  # already ended (a failed check ends it)
                self.sync.abort()
            self.opened = False

    def run(
        self, source: WeightSource | None, expected: str | Sequence[str], bucket: int, version: int | None
    ) -> WeightUpdateReport:
        started = time.perf_counter()
        entries, bucket, sent_version = self.manifest(source, expected, bucket, version)
        keep = self.open(entries, expected, sent_version)
        direct = self.transfer(entries, keep, bucket)
        all_ok, max_version, failed, refused = self.vote(entries, keep, direct)
        if not all_ok:
            self.abort()
            what = "refused the manifest" if refused else "failed while sending, receiving or validating"
            mine = f" This rank's error: {type(self.error).__name__}: {self.error}" if self.error else ""
            raise WeightSyncError(
                f"broadcast_weights: aborted on every rank; rank {failed} {what}. Every rank keeps its weights and "
                f"version.{mine}"
            ) from self.error
        final = sent_version if sent_version >= 0 else max_version + 1
        if self.sync is not None:
            return self.sync.commit(final, checked=True, where="broadcast_weights")
        names, nbytes = [e.name for e in entries], sum(e.nbytes for e in entries)
        label = expected if isinstance(expected, str) else "list"
        return WeightUpdateReport(final, names, len(names), nbytes, nbytes, [], time.perf_counter() - started, label)

    # ------------------------------------------------------------------------------ 1. header, manifest
    def manifest(
        self, source: WeightSource | None, expected: str | Sequence[str], bucket: int, version: int | None
    ) -> tuple[list[_Entry], int, int]:
        entries: list[_Entry] = []
        body, name_bytes, source_error = torch.zeros(0, dtype=torch.int64), 0, None
        if self.rank == self.src:
            try:
                entries = _entries(source, expected)
                body, name_bytes = _encode(entries)
            except Exception as err:  # tell the others before raising
                source_error = err
            dims = sum(len(e.shape) for e in entries)
            fields = [_MAGIC, _PROTOCOL, int(source_error is not None), len(entries), dims, name_bytes, bucket]
            header = torch.tensor([*fields, -1 if version is None else int(version)], dtype=torch.int64)
        else:
            header = torch.zeros(8, dtype=torch.int64)
        header = header.to(self.dev)
        dist.broadcast(header, self.src, group=self.group)
        magic, protocol, status, n, dims, name_bytes, bucket, sent_version = header.tolist()
        if magic != _MAGIC or protocol != _PROTOCOL:
            raise WeightSyncError(
                f"broadcast_weights: rank {self.src} speaks protocol {protocol} (magic {magic:#x}), expected "
                f"{_PROTOCOL}; run the same phyai-gym version on every rank."
            )
        if status:
            raise WeightSyncError(
                f"broadcast_weights: the source on rank {self.src} could not be read ({source_error or 'see that rank'})"
                "; every rank keeps its weights."
            ) from source_error
        size = 3 * n + dims + -(-name_bytes // 8)
        if size:
            wire = body.to(self.dev) if self.rank == self.src else torch.empty(size, dtype=torch.int64, device=self.dev)
            dist.broadcast(wire, self.src, group=self.group)
            if self.rank != self.src:
                entries = _decode(wire.cpu(), n, dims, name_bytes)
        _regions(entries)  # offsets
        return entries, bucket, sent_version

    # -------------------------------------------------------------------------- 2. open and check
    def open(self, entries: list[_Entry], expected: str | Sequence[str], sent_version: int) -> list[bool]:
        """Open this rank's update in manifest order and check the manifest: per entry, whether it is staged."""
        keep = [False] * len(entries)
        if self.sync is None:
            return keep
        try:
            if 0 <= sent_version <= self.sync.version:
                raise WeightSyncError(
                    f"broadcast_weights: version must increase: rank {self.rank} is at {self.sync.version}, "
                    f"received {sent_version}; pass a larger version or None."
                )
            self.sync.begin(expected, order=[e.name for e in entries])
            self.opened = True
            keep = self.sync.check_manifest([(e.name, e.shape, e.dtype) for e in entries])
        except WeightSyncError as err:
            self.fail(err, refused=True)
        return keep

    # ---------------------------------------------------------------------------------- 3. buckets
    def transfer(self, entries: list[_Entry], keep: list[bool], bucket: int) -> list[str]:
        """Every region in buckets, two in flight; returns the names received straight into staging buffers."""
        direct: list[str] = []
        in_flight: collections.deque = collections.deque()
        assembly: dict[int, torch.Tensor] = {}  # entry -> its bytes, while it spans buckets
        for dtype, idx in _regions(entries):
            names = [entries[i].name for i in idx]
            target = None
            if self.rank != self.src and self.ok and self.sync is not None and all(keep[i] for i in idx):
                target = self.sync.region(dtype, names)
                direct += names if target is not None else []
            offsets = [entries[i].offset for i in idx]
            for lo in range(0, entries[idx[-1]].end, bucket):
                hi = min(lo + bucket, entries[idx[-1]].end)
                first = max(bisect.bisect_right(offsets, lo) - 1, 0)
                span = [i for i in idx[first:] if entries[i].nbytes and entries[i].offset < hi and entries[i].end > lo]
                buf = target[lo:hi] if target is not None else self._buffer(entries, span, lo, hi)
                work = dist.broadcast(buf, self.src, group=self.group, async_op=True)
                in_flight.append((work, buf, span, lo, hi, target is None))
                if len(in_flight) == 2:
                    self._land(entries, keep, assembly, *in_flight.popleft())
        while in_flight:
            self._land(entries, keep, assembly, *in_flight.popleft())
        return direct

    def _buffer(self, entries: list[_Entry], span: list[int], lo: int, hi: int) -> torch.Tensor:
        """Rank src: the bucket's bytes; a rank that stages from buckets: an empty bucket; else scratch."""
        if self.ok and self.rank == self.src:
            try:
                parts = [self._bytes(entries, i)[max(lo, entries[i].offset) - entries[i].offset :
                                                 min(hi, entries[i].end) - entries[i].offset] for i in span]  # fmt: skip
                return parts[0] if len(parts) == 1 else torch.cat(parts)
            except Exception as err:  # keep broadcasting (garbage) so nobody hangs; the vote aborts
                self.fail(err)
        if self.ok and self.sync is not None:
            return torch.empty(hi - lo, dtype=torch.uint8, device=self.dev)
        if self.scratch is None or self.scratch.numel() < hi - lo:  # nobody reads it: one buffer serves all
            self.scratch = torch.empty(hi - lo, dtype=torch.uint8, device=self.dev)
        return self.scratch[: hi - lo]

    def _bytes(self, entries: list[_Entry], i: int) -> torch.Tensor:
        """Rank src: entry i's bytes, flat uint8 on the communication device (materialised once)."""
        if self.cached is None or self.cached[0] != i:
            e = entries[i]
            t = materialize(e.value, e.name, "broadcast_weights").detach()
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise WeightSyncError(
                    f"broadcast_weights: {e.name!r} materialised as {list(t.shape)} {t.dtype}, but its metadata said "
                    f"{list(e.shape)} {e.dtype}; do not change source tensors during a sync."
                )
            self.cached = (i, t.reshape(-1).view(torch.uint8).to(self.dev))
        return self.cached[1]

    def _land(
        self, entries: list[_Entry], keep: list[bool], assembly: dict[int, torch.Tensor],
        work: Any, buf: torch.Tensor, span: list[int], lo: int, hi: int, stage_here: bool,
    ) -> None:  # fmt: skip
        """Wait for one bucket; a rank that stages from buckets stages the tensors it completes."""
        work.wait()
        if not (stage_here and self.ok and self.sync is not None):
            return
        ready = []
        for i in span:
            e = entries[i]
            if not keep[i]:
                continue
            if lo <= e.offset and e.end <= hi:  # whole in this bucket: a view, no copy
                ready.append((e.name, _typed(buf[e.offset - lo : e.end - lo], e)))
                continue
            part = assembly.setdefault(i, torch.empty(e.nbytes, dtype=torch.uint8, device=self.dev))
            a, b = max(lo, e.offset), min(hi, e.end)
            part[a - e.offset : b - e.offset].copy_(buf[a - lo : b - lo])
            if e.end <= hi:
                ready.append((e.name, _typed(assembly.pop(i), e)))
        try:
            self.sync.stage(ready, where="broadcast_weights")
        except WeightSyncError as err:
            self.fail(err)

    # ------------------------------------------------------------------------------------- 4. vote
    def vote(self, entries: list[_Entry], keep: list[bool], direct: list[str]) -> tuple[bool, int, int, bool]:
        """(every rank ok, the largest current version, the lowest failed rank, whether it refused)."""
        flag = None
        sync = self.sync
        if sync is not None and self.ok:
            try:
                received = set(direct) | {entries[i].name for i, k in enumerate(keep) if k and entries[i].nbytes}
                empty = [(e.name, torch.empty(e.shape, dtype=e.dtype)) for e, k in zip(entries, keep)
                         if k and e.name not in received]  # fmt: skip
                sync.stage(empty, where="broadcast_weights")  # zero-size tensors carry no bytes
                if direct:
                    sync.mark_received(direct)
                flag = sync.check("broadcast_weights")
            except WeightSyncError as err:
                self.fail(err)
        current = sync.version if sync is not None else -1
        rows = torch.tensor([[1, -current, 2 * self.world], [0, -current, 2 * self.rank + int(not self.refused)]])
        rows = rows.to(self.dev)
        ballot = rows[0] if self.ok else rows[1]
        if flag is not None:
            ballot = torch.where(flag.to(self.dev), rows[0], rows[1])
        dist.all_reduce(ballot, op=dist.ReduceOp.MIN, group=self.group)
        all_ok, neg_version, code = ballot.tolist()
        if not all_ok and flag is not None and self.error is None and sync is not None and not bool(flag):
            self.error = WeightSyncError(
                f"broadcast_weights: non-finite values (NaN/Inf, after casting to the parameter dtype) in "
                f"{sync.nonfinite()[:10]}; expected finite weights."
            )
        return bool(all_ok), -neg_version, code // 2, code % 2 == 0


def _entries(source: WeightSource | None, expected: str | Sequence[str]) -> list[_Entry]:
    """Manifest entries (our names) from the source's metadata, one region per dtype."""
    if source is None:
        raise WeightSyncError("broadcast_weights: rank src needs a source (a module, state dict or pairs), got None.")
    wanted = None if isinstance(expected, str) else {to_internal_name(n) for n in expected}
    entries = []
    for name, value in source_pairs(source, "broadcast_weights", trainable_only=expected == "trainable"):
        ours = to_internal_name(name)
        if ours is None or (wanted is not None and ours not in wanted):
            continue
        if not hasattr(value, "shape") or getattr(value, "dtype", None) not in _DTYPES:
            raise WeightSyncError(
                f"broadcast_weights: {name!r} is a {type(value).__name__} of dtype {getattr(value, 'dtype', None)}; "
                f"expected a tensor of one of {[str(d) for d in _DTYPES]}."
            )
        entries.append(_Entry(ours, tuple(int(s) for s in value.shape), value.dtype, value))
    order = {dt: i for i, dt in enumerate(dict.fromkeys(e.dtype for e in entries))}
    return sorted(entries, key=lambda e: order[e.dtype])  # stable: source order inside a region


def _regions(entries: list[_Entry]) -> list[tuple[torch.dtype, list[int]]]:
    """(dtype, entry indices) of each region, in payload order; sets each entry's offset in its region."""
    regions: list[tuple[torch.dtype, list[int]]] = []
    offset = 0
    for i, e in enumerate(entries):
        if not regions or regions[-1][0] != e.dtype:
            regions.append((e.dtype, []))
            offset = 0
        e.offset, offset = offset, offset + e.nbytes
        regions[-1][1].append(i)
    return regions


def _encode(entries: list[_Entry]) -> tuple[torch.Tensor, int]:
    """The manifest as int64 [dtype codes | ndims | name lengths | shape dims | names, zero-padded]."""
    names = [e.name.encode() for e in entries]
    cols = [_DTYPES.index(e.dtype) for e in entries] + [len(e.shape) for e in entries] + [len(n) for n in names]
    cols += [d for e in entries for d in e.shape]
    blob = b"".join(names)
    padded = bytearray(blob.ljust(-(-len(blob) // 8) * 8, b"\0"))
    text = torch.frombuffer(padded, dtype=torch.int64) if padded else torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.tensor(cols, dtype=torch.int64), text]), len(blob)


def _decode(wire: torch.Tensor, n: int, dims: int, name_bytes: int) -> list[_Entry]:
    values = wire[: 3 * n + dims].tolist()
    blob = wire[3 * n + dims :].numpy().tobytes()[:name_bytes]
    codes, ndims, lengths, shape_dims = values[:n], values[n : 2 * n], values[2 * n : 3 * n], values[3 * n :]
    entries, pos, name_pos = [], 0, 0
    for code, nd, length in zip(codes, ndims, lengths):
        name = blob[name_pos : name_pos + length].decode()
        entries.append(_Entry(name, tuple(shape_dims[pos : pos + nd]), _DTYPES[code]))
        pos, name_pos = pos + nd, name_pos + length
    return entries


def _typed(raw: torch.Tensor, e: _Entry) -> torch.Tensor:
    """A uint8 view of a tensor's bytes -> the tensor (no copy)."""
    return raw.view(e.dtype).view(e.shape)


def _comm_device(sync: WeightSync | None, group: Any, device: Any) -> torch.device:
    if device is not None:
        return torch.device(device)
    if "nccl" in str(dist.get_backend(group)).lower():
        if sync is not None and sync.device.type == "cuda":
            return sync.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
