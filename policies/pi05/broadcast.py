"""Weight sync across processes (DESIGN C6): a two-phase broadcast over `torch.distributed`, tensors only.

Nothing is pickled (`dist.broadcast` of tensors, one `dist.all_reduce`), so it runs on gloo and NCCL alike:

1. Header int64[8] (magic, protocol, status, tensors, shape dims, name bytes, bucket bytes, version or -1), then
   the manifest int64[dtype codes | ndims | name lengths | shape dims | UTF-8 names, zero-padded].
2. Each rank with a policy opens its update while the manifest is built and sent; the version must increase.
3. The payload (one region per dtype, tensors back to back) goes in buckets of at most `bucket_bytes`, two in
   flight; each rank with a policy validates and stages what a bucket completes while the next one travels.
4. One vote: all_reduce(MIN) of (ok, -version, 2 x failed rank + phase), the finiteness flag and-ed in on the
   device: every rank commits one version (the given one, else the largest current + 1), or all abort.


A failing rank keeps taking part in every collective until the vote, so nobody hangs; when a rank dies, the
others' collectives fail (at the latest at the group's timeout) and they abort. A commit failing after the vote
cannot be undone elsewhere; that rank then refuses to serve until a complete update (see `weight_sync`).
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
"""Payload bytes per broadcast (rounded up to 16); every rank holds at most two buckets at a time."""
_MAGIC, _PROTOCOL = 0x5049_3035, 6  # "PI05", this layout
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
               torch.int8, torch.uint8, torch.bool)  # fmt: skip
"""The dtypes a manifest can name; a dtype's wire code is its index in this tuple."""


@dataclass
class _Entry:
    """One tensor of the manifest; `offset` is its byte offset in its dtype's region."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    value: Any = None  # rank src only: the source tensor (or DTensor)
    offset: int = 0

    def __post_init__(self) -> None:
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize

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

    Every rank of `group` calls it with the same `src`, `expected` and `bucket_bytes`.

    Args:
        sync: this rank's `policy.weight_sync` (`Pi05Policy.broadcast_weights` passes it), None without a policy.
        source: on rank `src`: an `nn.Module` (its `requires_grad` parameters when `expected="trainable"`), a
            state dict or (name, tensor) pairs; ignored elsewhere. DTensors are materialised while packing.
        src: global rank of the source.
        group: process group (default: the world).
        expected: "trainable", "all" or a list of names, as in `begin_weight_update`; sent parameters outside a
            rank's expected set are skipped there.
        bucket_bytes: payload bytes per broadcast; bounds the extra memory per rank.
        version: the version every rank commits (> every current one); default the largest current + 1.
        device: the communication buffers' device; default the policy's GPU (or the current one) under NCCL,
            else CPU.

    Returns:
        This rank's report (a rank without a policy: the manifest's names and sizes).

    Raises:
        WeightSyncError: on every rank when a rank refused or failed (all keep weights and versions), and when a
            collective fails (a rank died, the group timed out).


    Example:
        >>> report = broadcast_weights(None, trainer) if rank == 0 else policy.broadcast_weights()  # doctest: +SKIP
    """
    if int(bucket_bytes) < 1:
        raise WeightSyncError(f"broadcast_weights: bucket_bytes must be >= 1, got {bucket_bytes}; pass e.g. 256 << 20.")
    run = _Broadcast(sync, src, group, _comm_device(sync, group, device))
    try:
        return run.run(source, expected, -(-int(bucket_bytes) // 16) * 16, version)
    except BaseException as err:
        run.abort()
        if isinstance(err, WeightSyncError) or not isinstance(err, Exception):
            raise
        raise WeightSyncError(  # a collective failed: another rank died or the group timed out
            f"broadcast_weights: a collective failed on rank {run.rank} ({type(err).__name__}: {err}); another rank "
            "died or the process group timed out. This rank keeps its weights and version; rebuild the group."
        ) from err



class _Broadcast:
    """One rank's side of one broadcast; failures are recorded (`fail`), not raised, until the vote."""

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

    def run(self, source: Any, expected: str | Sequence[str], bucket: int, version: int | None) -> WeightUpdateReport:
        started = time.perf_counter()
        self.open(expected)  # needs no manifest: the parameter walk overlaps rank src building it
        entries, bucket, sent_version = self.manifest(source, expected, bucket, version)
        current = self.sync.version if self.sync is not None else -1
        if 0 <= sent_version <= current:
            self.fail(WeightSyncError(f"broadcast_weights: version must increase: rank {self.rank} is at {current}, "
                                      f"received {sent_version}; pass a larger version or None."), refused=True)
        self.transfer(entries, bucket)
        all_ok, max_version, failed, refused = self.vote(entries)
        if not all_ok:
            self.abort()
            what = "refused the update" if refused else "failed while sending, receiving or validating"
            mine = f" This rank's error: {type(self.error).__name__}: {self.error}" if self.error else ""
            raise WeightSyncError(f"broadcast_weights: aborted on every rank; rank {failed} {what}. Every rank keeps "
                                  f"its weights and version.{mine}") from self.error
        final = sent_version if sent_version >= 0 else max_version + 1
        if self.sync is not None:
            return self.sync.commit(final, checked=True, where="broadcast_weights")
        names, nbytes = [e.name for e in entries], sum(e.nbytes for e in entries)
        label = expected if isinstance(expected, str) else "list"
        return WeightUpdateReport(final, names, len(names), nbytes, nbytes, [], time.perf_counter() - started, label)

    def manifest(self, source: Any, expected: Any, bucket: int, version: int | None) -> tuple[list[_Entry], int, int]:
        """1. Rank src sends the header and the manifest; every rank returns (entries, bucket, version or -1)."""
        entries, body, name_bytes, source_error = [], torch.zeros(0, dtype=torch.int64), 0, None
        if self.rank == self.src:
            try:
                entries = _entries(source, expected)
                body, name_bytes = encode_manifest([(e.name, e.shape, e.dtype) for e in entries])
            except Exception as err:  # tell the others before raising
                source_error, entries = err, []
            fields = [_MAGIC, _PROTOCOL, int(source_error is not None), len(entries)]
            fields += [sum(len(e.shape) for e in entries), name_bytes, bucket, -1 if version is None else int(version)]
            header = torch.tensor(fields, dtype=torch.int64).to(self.dev)
        else:
            header = torch.zeros(8, dtype=torch.int64, device=self.dev)
        dist.broadcast(header, self.src, group=self.group)
        magic, protocol, status, n, dims, name_bytes, bucket, sent_version = header.tolist()
        if (magic, protocol) != (_MAGIC, _PROTOCOL):
            raise WeightSyncError(f"broadcast_weights: rank {self.src} speaks protocol {protocol} (magic {magic:#x}), "
                                  f"expected {_PROTOCOL}; run the same phyai-gym version on every rank.")
        if status:
            raise WeightSyncError(f"broadcast_weights: the source on rank {self.src} could not be read "
                                  f"({source_error or 'see its error'}); all keep their weights.") from source_error
        size = manifest_words(n, dims, name_bytes)
        if size:
            wire = body.to(self.dev) if self.rank == self.src else torch.empty(size, dtype=torch.int64, device=self.dev)
            dist.broadcast(wire, self.src, group=self.group)
            if self.rank != self.src:
                entries = [_Entry(*spec) for spec in decode_manifest(wire.cpu(), n, dims, name_bytes)]
        return entries, bucket, sent_version

    def open(self, expected: Any) -> None:
        """2. Open this rank's update (a refusal: keep receiving, vote no)."""
        try:
            if self.sync is not None:
                self.sync.begin(expected)
                self.opened = True
        except WeightSyncError as err:
            self.fail(err, refused=True)

    def transfer(self, entries: list[_Entry], bucket: int) -> None:
        """3. Every region in buckets, two in flight: rank src packs bucket j + 1 while bucket j travels."""
        in_flight: collections.deque = collections.deque()
        assembly: dict[int, torch.Tensor] = {}  # entry -> its bytes, while it spans buckets
        for idx in _regions(entries):
            offsets, size = [entries[i].offset for i in idx], entries[idx[-1]].end
            for lo in range(0, size, bucket):
                hi = min(lo + bucket, size)
                first = max(bisect.bisect_right(offsets, lo) - 1, 0)
                span = [i for i in idx[first:] if entries[i].nbytes and entries[i].offset < hi and entries[i].end > lo]
                buf = self._buffer(entries, span, lo, hi)
                in_flight.append((dist.broadcast(buf, self.src, group=self.group, async_op=True), buf, span, lo, hi))
                if len(in_flight) == 2:
                    self._land(entries, assembly, *in_flight.popleft())
        while in_flight:
            self._land(entries, assembly, *in_flight.popleft())

    def _buffer(self, entries: list[_Entry], span: list[int], lo: int, hi: int) -> torch.Tensor:
        """Rank src: the bucket's bytes; a rank that stages: an empty bucket; any other: scratch."""
        if self.ok and self.rank == self.src:
            try:
                parts = [self._bytes(entries[i], i, lo, hi) for i in span]
                return parts[0] if len(parts) == 1 else torch.cat(parts)
            except Exception as err:  # keep broadcasting (garbage) so nobody hangs; the vote aborts
                self.fail(err)
        if self.ok and self.sync is not None:
            return torch.empty(hi - lo, dtype=torch.uint8, device=self.dev)
        if self.scratch is None or self.scratch.numel() < hi - lo:  # nobody reads it: one buffer serves all
            self.scratch = torch.empty(hi - lo, dtype=torch.uint8, device=self.dev)
        return self.scratch[: hi - lo]

    def _bytes(self, e: _Entry, i: int, lo: int, hi: int) -> torch.Tensor:
        """Rank src: the payload bytes [lo, hi) of entry i, uint8 on the communication device (materialised once)."""
        if self.cached is None or self.cached[0] != i:
            t = materialize(e.value, e.name, "broadcast_weights").detach()
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise WeightSyncError(f"broadcast_weights: {e.name!r} materialised as {list(t.shape)} {t.dtype}, its "
                                      f"metadata said {list(e.shape)} {e.dtype}; do not change sources during a sync.")
            self.cached = (i, t.reshape(-1).view(torch.uint8).to(self.dev))
        return self.cached[1][max(lo, e.offset) - e.offset : min(hi, e.end) - e.offset]

    def _land(self, entries: list[_Entry], assembly: dict[int, torch.Tensor], work: Any, buf: torch.Tensor,
              span: list[int], lo: int, hi: int) -> None:  # fmt: skip
        """Wait for one bucket and stage the tensors it completes (a tensor inside it: a view, no copy)."""
        work.wait()
        if not (self.ok and self.sync is not None):
            return
        ready = []
        for i in span:
            e = entries[i]
            if lo <= e.offset and e.end <= hi:
                ready.append((e.name, buf[e.offset - lo : e.end - lo].view(e.dtype).view(e.shape)))
                continue
            part = assembly.setdefault(i, torch.empty(e.nbytes, dtype=torch.uint8, device=self.dev))
            a, b = max(lo, e.offset), min(hi, e.end)
            part[a - e.offset : b - e.offset].copy_(buf[a - lo : b - lo])
            if e.end <= hi:
                ready.append((e.name, assembly.pop(i).view(e.dtype).view(e.shape)))
        try:  # parameters outside this rank's expected set are skipped
            self.sync.stage(ready, skip_outside=True, where="broadcast_weights")
        except WeightSyncError as err:
            self.fail(err)

    def vote(self, entries: list[_Entry]) -> tuple[bool, int, int, bool]:
        """4. (every rank ok, the largest current version, the lowest failed rank, whether it refused)."""
        flag, sync = None, self.sync
        if sync is not None and self.ok:
            try:  # zero-size tensors carry no bytes
                empty = [(e.name, torch.empty(e.shape, dtype=e.dtype)) for e in entries if not e.nbytes]
                sync.stage(empty, skip_outside=True, where="broadcast_weights")
                flag = sync.check("broadcast_weights")
            except WeightSyncError as err:
                self.fail(err)
        current = sync.version if sync is not None else -1
        rows = torch.tensor([[1, -current, 2 * self.world], [0, -current, 2 * self.rank + int(not self.refused)]])
        rows = rows.to(self.dev)  # votes: ok, and this rank's failure (phase 0: refused, 1: failed later)
        ballot = rows[0 if self.ok else 1] if flag is None else torch.where(flag.to(self.dev), rows[0], rows[1])
        dist.all_reduce(ballot, op=dist.ReduceOp.MIN, group=self.group)
        all_ok, neg_version, code = ballot.tolist()
        if not all_ok and flag is not None and self.error is None and not bool(flag):
            self.error = WeightSyncError(
                f"broadcast_weights: non-finite values (NaN/Inf, after casting to the parameter dtype) in "
                f"{sync.nonfinite()[:10]}; expected finite weights."  # type: ignore[union-attr]
            )
        return bool(all_ok), -neg_version, code // 2, code % 2 == 0


def _entries(source: WeightSource | None, expected: str | Sequence[str]) -> list[_Entry]:
    """Manifest entries (our names) from the source's metadata, sorted into one region per dtype."""
    if source is None:
        raise WeightSyncError("broadcast_weights: rank src needs a source (a module, state dict or pairs), got None.")
    wanted = None if isinstance(expected, str) else {to_internal_name(n) for n in expected}
    entries = []
    for name, value in source_pairs(source, "broadcast_weights", trainable_only=expected == "trainable"):
        ours = to_internal_name(name)
        if ours is None or (wanted is not None and ours not in wanted):
            continue
        if not hasattr(value, "shape") or getattr(value, "dtype", None) not in WIRE_DTYPES:
            raise WeightSyncError(f"broadcast_weights: {name!r} is a {type(value).__name__} of dtype "
                                  f"{getattr(value, 'dtype', None)}; expected a tensor of one of {list(WIRE_DTYPES)}.")
        entries.append(_Entry(ours, tuple(int(s) for s in value.shape), value.dtype, value))
    order = {dt: i for i, dt in enumerate(dict.fromkeys(e.dtype for e in entries))}
    return sorted(entries, key=lambda e: order[e.dtype])  # stable: source order inside a region


def _regions(entries: list[_Entry]) -> list[list[int]]:
    """The entry indices of each region (consecutive entries of one dtype); sets each entry's region offset."""
    regions: list[list[int]] = []
    for i, e in enumerate(entries):
        same = bool(regions) and entries[regions[-1][-1]].dtype == e.dtype
        e.offset = entries[regions[-1][-1]].end if same else 0
        if not same:
            regions.append([])
        regions[-1].append(i)
    return regions



TensorSpec = tuple[str, tuple[int, ...], torch.dtype]
"""What a manifest says of one tensor: (name, shape, dtype)."""


def encode_manifest(specs: Sequence[TensorSpec]) -> tuple[torch.Tensor, int]:
    """The manifest of `specs` as one int64 tensor, and the byte count of the names.

    Layout: [dtype codes | ndims | name lengths | shape dims | UTF-8 names, zero-padded]. With ``len(specs)`` and
    the number of shape dims, the byte count is what `decode_manifest` needs.

    Example:
        >>> wire, name_bytes = encode_manifest([("w", (2, 3), torch.bfloat16)])
        >>> decode_manifest(wire, 1, 2, name_bytes)
        [('w', (2, 3), torch.bfloat16)]
    """
    names = [name.encode() for name, _, _ in specs]
    cols = [WIRE_DTYPES.index(dtype) for _, _, dtype in specs] + [len(shape) for _, shape, _ in specs]
    blob = b"".join(names)
    padded = bytearray(blob.ljust(-(-len(blob) // 8) * 8, b"\0"))
    text = torch.frombuffer(padded, dtype=torch.int64) if padded else torch.zeros(0, dtype=torch.int64)
    dims = [d for _, shape, _ in specs for d in shape]
    return torch.cat([torch.tensor(cols + [len(n) for n in names] + dims, dtype=torch.int64), text]), len(blob)


def manifest_words(n: int, dims: int, name_bytes: int) -> int:
    """The int64 length of the manifest of `n` tensors with `dims` shape dims and `name_bytes` of names."""
    return 3 * n + dims + -(-name_bytes // 8)


def decode_manifest(wire: torch.Tensor, n: int, dims: int, name_bytes: int) -> list[TensorSpec]:
    """The (name, shape, dtype) of each tensor of a CPU manifest `wire` (`encode_manifest`'s inverse)."""
    values, blob = wire[: 3 * n + dims].tolist(), wire[3 * n + dims :].numpy().tobytes()[:name_bytes]
    specs, pos, name_pos = [], 3 * n, 0
    for code, ndim, length in zip(values[:n], values[n : 2 * n], values[2 * n : 3 * n]):
        specs.append((blob[name_pos : name_pos + length].decode(), tuple(values[pos : pos + ndim]), WIRE_DTYPES[code]))
        pos, name_pos = pos + ndim, name_pos + length
    return specs


def _comm_device(sync: WeightSync | None, group: Any, device: Any) -> torch.device:
    if device is not None or "nccl" not in str(dist.get_backend(group)).lower():
        return torch.device(device or "cpu")
    return sync.device if sync is not None and sync.device.type == "cuda" else torch.device("cuda")
