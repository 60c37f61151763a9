"""Weight sync across processes (DESIGN C6): a two-phase broadcast over `torch.distributed`, tensors only.

Every rank of `group` calls `broadcast_weights` with the same `src`, `expected` and `bucket_bytes`; rank `src`
also passes the source. Nothing is pickled: no object collectives, only tensor broadcasts and reductions,
so it runs on gloo (CPU) and NCCL (GPU) alike.

Protocol 5:

1. First message, int64[16384]: the header (magic, protocol, status, tensors, name bytes, payload bytes,
   bucket bytes, buckets, version (-1: none given), shape dims), then the manifest [name lengths | dtype codes |
   ndims | payload offsets | byte sizes | shape dims | the UTF-8 names, zero-padded to 8 bytes]; a manifest
   that does not fit sends its rest in a second message. Rank src reuses the manifest (and the message) it
   built last while the source holds the same tensors.
2. Each rank with a policy opens its update and checks the manifest against its model (names, shapes,
   duplicates, the expected set complete, the version increasing; a manifest it passed before is not checked
   again) and finds its receive buffers. A rank that refuses keeps receiving (into one scratch buffer) and votes
   no. Where that host work runs: a receiver that kept its staging buffers from its last update
   (`kept_weight_staging`) and finds every window's region in them queues all its receives there as soon as it
   has the manifest, and opens its update while the data travels (nothing in a staging buffer is visible; if
   the update stages elsewhere, its plan having been rebuilt, the tensors are staged from the kept buffers).
   Other receivers open their update once they have the manifest, rank src while the first message travels.
   A receiver holds its policy's lock from the manifest to the end of its check, not while it waits for the
   message (under gloo, whose waits block the host, that includes receiving the windows it queued early).
3. Buckets: the payload is laid out per dtype (one region per dtype, 16-byte aligned, tensors packed back to
   back in manifest order inside it) and sent in windows of at most `bucket_bytes` that never cross a region and
   end at tensor boundaries (a tensor larger than a bucket is cut into pieces, its last piece a window alone).
   A rank whose staging buffer for that dtype holds exactly the region's tensors in the same order (the usual
   case: the same model class on both sides, same dtype) receives the windows straight into that buffer, and
   reduces each window to its min and max as it lands; any other rank receives into a temporary window and
   stages the tensors from it (a tensor spanning windows is assembled first). Broadcasts are asynchronous:
   rank src packs window w + 1 (one flatten of its tensors) while window w is on the wire, two at most in flight.
4. One vote: each rank's completeness check runs on the host, its finiteness flag stays on the device
   (`weight_update_ok`, which also queues the weight-derived tables from the staged values) and is and-ed into
   all_reduce(MIN) of (ok, -version, 2 x failed rank + phase). Every rank commits with the same version (the
   given one, else the largest current version + 1), or every rank aborts and keeps its own.

A rank that fails keeps taking part in every collective until the vote, so nobody hangs. A failure after
the vote (the commit itself failing on a device) cannot be undone on the other ranks; that rank's policy then
refuses to serve until a complete update (see `weight_sync`).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import operator
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors

from .checkpoint import to_internal_name
from .weight_sync import (
    _PLAIN_TENSOR_TYPES,
    WeightSource,
    WeightSyncError,
    WeightUpdateReport,
    materialize,
    source_lists,
    source_pairs,
)

if TYPE_CHECKING:
    from .policy import Pi05Policy

DEFAULT_BUCKET_BYTES = 256 << 20
"""Payload bytes per broadcast. Rank src holds at most two packed windows of this size (one packed while the
other is on the wire); a receiver whose staging buffers match the manifest needs none. Each window costs the
receiver ~0.2-0.3 ms of host time to queue (H200 host), about what 128 MiB take on the wire, so fewer, larger
windows keep the link busy: expert + heads (1.1 GB) went 7.45 ms in 9 windows of 128 MiB vs 6.11 ms in 5 of
277 MB (6588222)."""
window_checks = True
"""Reduce each window received into a staging buffer as it lands (on a side stream); False: one reduction of the
whole staging buffers after the last window (`weight_update_ok`). Benchmarks compare the two."""
_PACK_DELAY_CYCLES = 30_000
"""GPU clock cycles (~15-20 us) rank src waits, once a window has left, before packing the next-but-one (see
`_WindowStream._pack`)."""
_MAGIC = 0x5049_3035  # "PI05"
_PROTOCOL = 5
_ALIGN = 16
_HEADER = 10
_FIRST = 16384
"""int64 elements of the first message: the header, then the manifest (the rest, if any, in a second message).
pi05_base's whole manifest (813 tensors) takes ~11,000."""
_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
"""Wire dtype codes: the index in this tuple."""


@dataclass
class _Entry:
    """One tensor of the manifest."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # payload byte offset (regions per dtype, 16-byte aligned; packed inside a region)
    nbytes: int
    value: Any = None  # source rank only: the tensor (or DTensor), materialised when its bytes are packed

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


PhaseHook = Callable[[str], None]
phase_hook: PhaseHook | None = None
"""Called with a phase name as each phase of `broadcast_weights` ends on this rank ("posted", "begin", "manifest",
"check", "queued", "received", "flag", "vote_queued", "vote", "commit"); benchmarks set it to time the protocol
without a profiler."""


def _phase(name: str) -> None:
    if phase_hook is not None:
        phase_hook(name)


def broadcast_weights(
    policy: Pi05Policy | None,
    source: WeightSource | None = None,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    expected: str | Sequence[str] = "trainable",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    version: int | None = None,
    device: str | torch.device | None = None,
) -> WeightUpdateReport:
    """Broadcast weights from rank `src` into every rank's policy as one all-or-nothing update.

    Args:
        policy: this rank's policy, or None on a rank without one (e.g. a trainer-only source rank).
        source: on rank `src`: an `nn.Module` (its parameters; only `requires_grad` ones when
            `expected="trainable"`), a state dict, or (name, tensor) pairs; ignored on other ranks. DTensors are
            materialised with `.full_tensor()` while packing, a collective over their mesh.
        src: global rank of the source.
        group: process group (default: the world).
        expected: what every policy must receive ("trainable", "all" or a list of names), as in
            `begin_weight_update`; sent parameters outside a rank's expected set are skipped there.
        bucket_bytes: payload bytes per broadcast (rounded up to 16); bounds the extra memory per rank.
        version: the version every rank commits (> every current one); default the largest current + 1.
        device: device of the communication buffers; default the policy's CUDA device (or the current one)
            under NCCL, else CPU.

    Returns:
        This rank's report (a rank without a policy gets the manifest's names and sizes).

    Raises:
        WeightSyncError: on every rank when any rank refused; every rank then keeps its weights and version.

    Example:
        >>> # on every rank, after dist.init_process_group(...) and building the policy (rank 0: trainer)
        >>> report = broadcast_weights(policy, trainer.model if rank == 0 else None)  # doctest: +SKIP
        >>> report.version == policy.weight_version  # doctest: +SKIP
        True
    """
    try:
        return _broadcast(policy, source, src, group, expected, bucket_bytes, version, device)
    finally:  # the manifest cache must not keep the source's tensors alive
        _release_values(_SENT.get("entries", []))


def _broadcast(
    policy: Pi05Policy | None,
    source: WeightSource | None,
    src: int,
    group: dist.ProcessGroup | None,
    expected: str | Sequence[str],
    bucket_bytes: int,
    version: int | None,
    device: str | torch.device | None,
) -> WeightUpdateReport:
    """`broadcast_weights` (the manifest cache's references to the source are dropped by the caller)."""
    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = _comm_device(policy, group, device)
    bucket = max(_ALIGN, -(-int(bucket_bytes) // _ALIGN) * _ALIGN)

    # ---- 1. header and manifest, one message (rank src builds them from the source's metadata)
    entries: list[_Entry] = []
    source_error: BaseException | None = None
    message = torch.zeros(0, dtype=torch.int64)
    if rank == src:
        try:
            entries, meta, blob = _manifest(source, expected)
        except Exception as err:  # tell the others before raising
            source_error, meta, blob = err, torch.zeros(0, dtype=torch.int64), b""
        first, message = _first_message(entries, meta, blob, bucket, version, source_error, dev)
    else:
        first = torch.empty(_FIRST, dtype=torch.int64, device=dev)
    first_work = dist.broadcast(first, src, group=group, async_op=True)
    _phase("posted")

    # Rank src (with a policy: colocated) opens its update while the message travels.
    ours: Pi05Policy | None = None  # the policy whose update this call opened (only that one is aborted here)
    begin_error: BaseException | None = None
    if rank == src:
        ours, begin_error = _begin(policy, expected)
    first_work.wait()
    head = first.cpu() if rank != src else message[:_FIRST]
    fields = head[:_HEADER].tolist()
    magic, protocol, status, n, name_bytes, total, bucket, num_buckets, sent_version, dims = fields
    if magic != _MAGIC or protocol != _PROTOCOL or status != 0:
        _abort(ours)
    if magic != _MAGIC or protocol != _PROTOCOL:
        raise WeightSyncError(
            f"broadcast_weights: rank {src} speaks protocol {protocol} (magic {magic:#x}), expected {_PROTOCOL}; "
            "run the same phyai-gym version on every rank."
        )
    if status != 0:
        if source_error is not None:
            raise WeightSyncError(
                f"broadcast_weights: the source on rank {src} could not be read "
                f"({type(source_error).__name__}: {source_error}); every rank keeps its weights."
            ) from source_error
        raise WeightSyncError(
            f"broadcast_weights: the source on rank {src} could not be read (see rank {src}'s error); "
            "every rank keeps its weights."
        )
    size = _HEADER + 5 * n + dims + -(-name_bytes // 8)  # the message: header, manifest columns, names
    if size > _FIRST:  # a manifest too large for the first message: the rest in a second one
        rest = torch.empty(size - _FIRST, dtype=torch.int64, device=dev)
        if rank == src:
            rest.copy_(message[_FIRST:])
        dist.broadcast(rest, src, group=group)
        if rank != src:
            head = torch.cat([head, rest.cpu()])
    if rank != src:
        entries = _decode_cached(head[_HEADER:size], n, dims, name_bytes)
    windows = _windows(entries, bucket)
    if len(windows) != num_buckets:
        _abort(ours)
        raise WeightSyncError(
            f"broadcast_weights: rank {src} announced {num_buckets} buckets, the manifest gives {len(windows)}; "
            "run the same phyai-gym version on every rank."
        )
    _phase("manifest")

    # A receiver that kept its staging buffers from the last update queues its receives into them now, and opens
    # its update (parameter table and plan checks) while the data travels. It holds the policy lock from here to
    # the manifest check (not while it waited for the message), so no other update opens on those buffers.
    packer = _Packer(entries, windows, dev) if rank == src else None
    stream = _WindowStream(policy, entries, windows, src, group, dev, packer)
    kept_staging = policy.kept_weight_staging() if policy is not None and rank != src else None
    with kept_staging if kept_staging is not None else contextlib.nullcontext() as kept:
        early = {}  # region start -> kept buffer: every window received there before the update opens
        if kept is not None:
            early = _direct_regions(kept, entries, [True] * n)[0]
            if all(region in early for _, _, region in windows):
                stream.post_all(early)
                _phase("queued")
            else:
                early = {}
        if rank != src:
            ours, begin_error = _begin(policy, expected)

        # ---- 2. the manifest check and the receive buffers
        keep = [False] * n
        direct: dict[int, tuple[torch.Tensor, torch.dtype]] = {}  # region start -> (staging buffer as bytes, dtype)
        direct_names: list[str] = []
        moved = False  # the data goes into kept buffers this update does not stage into (its plan was rebuilt)
        if policy is not None:
            try:
                if sent_version >= 0 and sent_version <= policy.weight_version:
                    raise WeightSyncError(
                        f"broadcast_weights: version must increase: rank {rank} is at {policy.weight_version}, "
                        f"received {sent_version}; pass a larger version or None."
                    )
                if begin_error is not None:
                    raise begin_error
                keep = policy.check_weight_manifest([(e.name, e.shape, e.dtype) for e in entries])
                direct, direct_names = _direct_regions(policy.staging_layout(), entries, keep)
                if early and not _same_buffers(direct, early):  # staged from the kept buffers instead
                    moved, direct, direct_names = True, {}, []
                staged_directly = set(direct_names)
                for e, k in zip(entries, keep):  # zero-size tensors carry no bytes
                    if k and e.nbytes == 0 and e.name not in staged_directly:
                        policy.update_weights([(e.name, torch.empty(e.shape, dtype=e.dtype))])
            except Exception as err:
                stream.fail(err)
        stream.refused = not stream.ok
        rows = _vote_rows(policy.weight_version if policy is not None else -1, rank, world, dev)
    _phase("check")

    # ---- 3. the buckets (rank src packs and sends; the others receive)
    if not early:
        stream.post_all(direct, keep=keep)
        _phase("queued")
    stream.wait()
    _phase("received")

    # ---- 4. one vote on the device: every rank commits with the same version, or every rank aborts
    flag: torch.Tensor | None = None  # this rank's staged values are finite (not read on the host)
    if policy is not None and stream.ok:
        try:
            checked = set(stream.bounds)  # the dtypes whose windows were reduced as they landed
            if moved:  # staged from the kept buffers like any source (and reduced again)
                policy.update_weights(_views(entries, keep, early))
                checked = set()
            elif direct_names:
                policy.mark_staged(direct_names)
            flag = policy.weight_update_ok(checked)
            if stream.window_flag is not None and not moved:
                flag = torch.logical_and(flag, stream.window_flag)
        except Exception as err:
            stream.fail(err)
    _phase("flag")
    ok, max_version, failed, failed_refused = _vote(stream.ok, stream.refused, flag, rows, group)
    _phase("vote")
    error = stream.error
    if not ok:
        if flag is not None and error is None and not bool(flag):  # name the non-finite tensors
            try:
                policy.validate_weight_update()  # type: ignore[union-attr]
            except Exception as err:
                error = err
        _abort(ours)
        what = "refused the manifest" if failed_refused else "failed while sending, receiving or validating"
        raise _failure(what, failed, rank, error)
    final = sent_version if sent_version >= 0 else max_version + 1
    if policy is not None:
        report = policy.finish_weight_update(version=final, checked=True)
        _phase("commit")
        return report
    names = [e.name for e in entries]
    return WeightUpdateReport(
        version=final,
        names=names,
        num_tensors=len(names),
        num_bytes=sum(e.nbytes for e in entries),
        source_bytes=sum(e.nbytes for e in entries),
        duration_s=time.perf_counter() - started,
        expected=expected if isinstance(expected, str) else "list",
    )


def _begin(policy: Pi05Policy | None, expected: str | Sequence[str]) -> tuple[Pi05Policy | None, BaseException | None]:
    """Open this rank's update: (the policy, None), or (None, the error: this rank's refusal of the manifest)."""
    try:
        if policy is not None:
            policy.begin_weight_update(expected)
        return policy, None
    except Exception as err:
        return None, err
    finally:
        _phase("begin")


def _first_message(
    entries: list[_Entry],
    meta: torch.Tensor,
    blob: bytes,
    bucket: int,
    version: int | None,
    source_error: BaseException | None,
    dev: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank src's first message on `dev` (header, then as much of the manifest as fits) and the whole message.

    The device copy is kept with the manifest cache while header and manifest stay the same.
    """
    key = (bucket, version, dev)
    cached = _SENT.get("first")
    if source_error is None and cached is not None and cached[0] == key and cached[1] is meta:
        return cached[2], cached[3]
    header = [
        _MAGIC,
        _PROTOCOL,
        0 if source_error is None else 1,
        len(entries),
        len(blob),
        entries[-1].end if entries else 0,
        bucket,
        len(_windows(entries, bucket)),
        -1 if version is None else int(version),
        sum(len(e.shape) for e in entries),
    ]
    message = torch.cat([torch.tensor(header, dtype=torch.int64), meta])
    head = torch.zeros(_FIRST, dtype=torch.int64)
    head[: min(_FIRST, message.numel())] = message[:_FIRST]
    first = head.to(dev)
    if source_error is None:
        _SENT["first"] = (key, meta, first, message)
    return first, message


class _WindowStream:
    """One rank's side of the bucket windows: packing and sending (rank src), receiving and staging (the others).

    Broadcasts are queued asynchronously: on rank src the packing of window w + 1 runs while window w is on the
    wire. A window received into a staging buffer is not waited for by the
    host: a side stream waits for it and reduces its values (min and max) for the finiteness check; on the current
    stream that reduction would hold back window w + 1 (a collective first waits for that stream). A temporary
    window is waited for at once (its tensors are staged from it). A rank that refused the manifest, or has no
    policy, receives every window into one scratch buffer and discards it. A failure is recorded (`fail`), never
    raised: the rank keeps broadcasting so that nobody hangs, and votes no.
    """

    def __init__(
        self,
        policy: Pi05Policy | None,
        entries: list[_Entry],
        windows: list[tuple[int, int, int]],
        src: int,
        group: dist.ProcessGroup | None,
        dev: torch.device,
        packer: _Packer | None,
    ) -> None:
        self.policy, self.entries, self.windows = policy, entries, windows
        self.dev, self.packer = dev, packer
        self.ok, self.refused, self.error = True, False, None
        self.works: list[tuple[Any, torch.Tensor]] = []  # (broadcast, its buffer), waited for before the vote
        self.bounds: dict[torch.dtype, torch.Tensor] = {}  # per dtype: [min; max] of each window received in staging
        self.window_flag: torch.Tensor | None = None  # every bound finite (on the side stream)
        self.widest = max((hi - lo for lo, hi, _ in windows), default=0)
        self.in_flight: collections.deque[Any] = collections.deque()  # rank src: its last two windows' broadcasts
        # each window goes straight to the process group: what `dist.broadcast` adds (argument checks, group-rank
        # translation, logging wrappers) is per call host time, ~5 calls per update on every rank
        self.pg = group if group is not None else dist.group.WORLD
        self.options = dist.BroadcastOptions()
        self.options.rootRank = dist.get_group_rank(self.pg, src) if group is not None else src
        self.options.rootTensor = 0
        self.options.asyncOp = True
        self.scratch: torch.Tensor | None = None

    def fail(self, err: BaseException) -> None:
        if self.ok:
            self.error, self.ok = err, False

    def post_all(self, direct: dict[int, tuple[torch.Tensor, torch.dtype]], keep: list[bool] | None = None) -> None:
        """Queue every window.

        A window of a region in `direct` is received into (on rank src: sent from) that buffer; any other is
        staged from a temporary window when `keep` (the manifest check's flags) is given, else discarded.
        """
        entries, n, policy = self.entries, len(self.entries), self.policy
        side = _side_stream(self.dev)
        counts = collections.Counter(
            direct[region][1]
            for _, _, region in self.windows
            if region in direct and direct[region][1].is_floating_point
        )
        if policy is None or not self.ok or not window_checks:
            counts.clear()
        self.bounds = {dt: torch.empty(2, c, dtype=dt, device=self.dev) for dt, c in counts.items()}
        used = dict.fromkeys(counts, 0)
        assembly: dict[int, torch.Tensor] = {}
        first_entry = 0  # first entry not yet fully received
        for j, (lo, hi, region) in enumerate(self.windows):
            target = direct.get(region) if self.ok else None
            stage_here = target is None and keep is not None and policy is not None and self.ok
            buf = self._pack(j, target) if self.packer is not None else self._buffer(j, target, stage_here)
            work = self.pg.broadcast([buf], self.options)
            if self.packer is not None:  # not kept in `works`: a packed window's memory is freed once it left
                self.in_flight.append(work)
            if not stage_here:
                dtype = target[1] if target is not None else None
                if self.ok and dtype in used:
                    k = used[dtype]
                    used[dtype] += 1
                    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                        work.wait()  # NCCL: the side stream waits for the window (gloo: the host does)
                        torch.aminmax(buf.view(dtype), out=(self.bounds[dtype][0, k], self.bounds[dtype][1, k]))
                if self.packer is None:
                    self.works.append((work, buf))
                del buf
                continue
            work.wait()
            ready: list[tuple[str, torch.Tensor]] = []
            for i in range(first_entry, n) if self.ok else ():
                e = entries[i]
                if e.offset >= hi:
                    break
                if not keep[i] or e.nbytes == 0 or e.end <= lo:  # type: ignore[index]
                    continue
                if lo <= e.offset and e.end <= hi:  # whole tensor in this window: a view, no copy
                    ready.append((e.name, _typed(buf[e.offset - lo : e.end - lo], e)))
                    continue
                part_lo, part_hi = max(lo, e.offset), min(hi, e.end)
                if i not in assembly:
                    assembly[i] = torch.empty(e.nbytes, dtype=torch.uint8, device=self.dev)
                assembly[i][part_lo - e.offset : part_hi - e.offset].copy_(buf[part_lo - lo : part_hi - lo])
                if e.end <= hi:
                    ready.append((e.name, _typed(assembly.pop(i), e)))
            while first_entry < n and entries[first_entry].end <= hi:
                first_entry += 1
            if self.ok and ready:
                try:
                    policy.update_weights(ready)  # type: ignore[union-attr]
                except Exception as err:
                    self.fail(err)
            del buf, ready
        if self.bounds:  # queued now, so that nothing of it is left to the host once the data has landed
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                self.window_flag = torch.stack([torch.isfinite(b).all() for b in self.bounds.values()]).all()

    def _buffer(self, j: int, target: tuple[torch.Tensor, torch.dtype] | None, stage_here: bool) -> torch.Tensor:
        """The buffer a receiver takes window j into."""
        lo, hi, region = self.windows[j]
        if target is not None:  # straight into a staging buffer
            return target[0][lo - region : hi - region]
        if stage_here:
            return torch.empty(hi - lo, dtype=torch.uint8, device=self.dev)
        return self._scratch(hi - lo)

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of one buffer that every discarded (or, after a failure, garbage) window shares."""
        if self.scratch is None:  # broadcasts run in order, so one buffer serves them all
            self.scratch = torch.empty(self.widest, dtype=torch.uint8, device=self.dev)
        return self.scratch[:nbytes]

    def _pack(self, j: int, target: tuple[torch.Tensor, torch.dtype] | None) -> torch.Tensor:
        """Rank src: window j's bytes, packed once the window two before it has left (at most two in flight).

        Written into `target` (this rank's own staging buffer) when given. After a failure: garbage of the right
        size, so that every rank keeps receiving; the vote aborts.
        """
        lo, hi, region = self.windows[j]
        if len(self.in_flight) == 2:
            self.in_flight.popleft().wait()  # NCCL: the current stream waits, and the packing below with it
            if self.dev.type == "cuda" and hasattr(torch.cuda, "_sleep"):
                # Window j - 1's broadcast starts as window j - 2 ends, when this packing may start too: a packing
                # kernel that takes every SM first holds the broadcast back until it drains (~0.16 ms per 256 MiB
                # window on the H200). A one-thread spin lets the broadcast's blocks in first.
                torch.cuda._sleep(_PACK_DELAY_CYCLES)
        data = None
        if self.ok:
            try:
                data = self.packer.window(j)  # type: ignore[union-attr]
            except Exception as err:  # keep broadcasting (garbage) so nobody hangs; the vote aborts
                self.fail(err)
        if data is None:
            data = self._scratch(hi - lo)
        if target is None:
            return data
        buf = target[0][lo - region : hi - region]
        buf.copy_(data)
        return buf

    def wait(self) -> None:
        """Wait (on the current stream, or the host under gloo) for every window and its reduction."""
        for work, _ in self.works:
            work.wait()
        for work in self.in_flight:
            work.wait()
        self.works = []
        self.in_flight.clear()
        side = _side_stream(self.dev)
        if side is not None:
            current = torch.cuda.current_stream(self.dev)
            current.wait_stream(side)
            if self.window_flag is not None:
                self.window_flag.record_stream(current)  # made on the side stream, read on this one


_Regions = dict[int, tuple[torch.Tensor, torch.dtype]]
"""Region start -> (the buffer it is received into, as bytes; its dtype)."""


def _same_buffers(a: _Regions, b: _Regions) -> bool:
    """Both map the same regions to the same memory."""
    return a.keys() == b.keys() and all(
        a[r][0].data_ptr() == b[r][0].data_ptr() and a[r][0].numel() == b[r][0].numel() and a[r][1] == b[r][1]
        for r in a
    )


def _views(
    entries: list[_Entry], keep: list[bool], buffers: dict[int, tuple[torch.Tensor, torch.dtype]]
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every kept entry with bytes, as views of the region buffers its bytes were received in."""
    out = []
    for start, _, idx in _regions(entries):
        raw = buffers[start][0]
        out += [
            (entries[i].name, _typed(raw[entries[i].offset - start : entries[i].end - start], entries[i]))
            for i in idx
            if keep[i] and entries[i].nbytes
        ]
    return out


# ------------------------------------------------------------------------------------------------ helpers
_SIDE: dict[torch.device, Any] = {}


def _side_stream(dev: torch.device) -> Any:
    """A stream of its own per CUDA device for the per-window finiteness reductions (None off CUDA)."""
    if dev.type != "cuda":
        return None
    if dev not in _SIDE:
        _SIDE[dev] = torch.cuda.Stream(dev)
    return _SIDE[dev]


def _comm_device(policy: Pi05Policy | None, group: dist.ProcessGroup | None, device: Any) -> torch.device:
    if device is not None:
        return torch.device(device)
    if "nccl" in str(dist.get_backend(group)).lower():
        if policy is not None and policy.device.type == "cuda":
            return policy.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_SENT: dict[str, Any] = {}
"""Rank src's last manifest: the source's fingerprint, the entries (values detached), the encoded manifest."""


def _manifest(source: WeightSource | None, expected: str | Sequence[str]) -> tuple[list[_Entry], torch.Tensor, bytes]:
    """Entries (their values set), encoded manifest and name bytes of `source`.

    Reused while the source holds the same tensor objects under the same names with the same shapes and dtypes,
    as a trainer's parameters are every iteration. The cache holds weak references only (a dead tensor's id
    can be reused, its weak reference then no longer matches); call `_release_values` when done.
    """
    if source is None:
        raise WeightSyncError("broadcast_weights: rank src needs a source (a module, state dict or pairs), got None.")
    trainable_only = isinstance(expected, str) and expected == "trainable"
    names, values = source_lists(source, "broadcast_weights", trainable_only=trainable_only)
    key = expected if isinstance(expected, str) else tuple(expected)
    refs = _SENT.get("refs")
    if not (
        _SENT.get("key") == key
        and _SENT["names"] == names
        and all(map(operator.is_, [r() for r in refs], values))
        and [getattr(v, "shape", None) for v in values] == _SENT["shapes"]
        and [getattr(v, "dtype", None) for v in values] == _SENT["dtypes"]
    ):
        _SENT.clear()
        entries = _build_entries(list(zip(names, values)), expected)
        position = {id(v): i for i, v in enumerate(values)}
        blob = b"".join(e.name.encode() for e in entries)
        _SENT.update(
            key=key,
            names=names,
            refs=[_weak(v) for v in values],
            shapes=[getattr(v, "shape", None) for v in values],
            dtypes=[getattr(v, "dtype", None) for v in values],
            entries=entries,
            order=[position[id(e.value)] for e in entries],
            meta=_encode_meta(entries, blob),
            blob=blob,
        )
    entries = _SENT["entries"]
    for e, i in zip(entries, _SENT["order"]):
        e.value = values[i]
    return entries, _SENT["meta"], _SENT["blob"]


def _weak(value: Any) -> Any:
    try:
        return weakref.ref(value)
    except TypeError:  # not weak-referenceable: never matches, so the manifest is rebuilt each time
        return lambda: None


def _release_values(entries: list[_Entry]) -> None:
    """Drop the entries' references to the source tensors (the manifest cache must not keep them alive)."""
    for e in entries:
        e.value = None


def _build_entries(source: WeightSource | None, expected: str | Sequence[str]) -> list[_Entry]:
    """Manifest entries (our names) from the source's metadata; payload offsets 16-byte aligned."""
    if source is None:
        raise WeightSyncError("broadcast_weights: rank src needs a source (a module, state dict or pairs), got None.")
    wanted = None
    if not isinstance(expected, str):
        wanted = {to_internal_name(n) for n in expected}
    entries: list[_Entry] = []
    trainable_only = isinstance(expected, str) and expected == "trainable"
    for name, value in source_pairs(source, "broadcast_weights", trainable_only=trainable_only):
        ours = to_internal_name(name)
        if ours is None or (wanted is not None and ours not in wanted):
            continue
        if not hasattr(value, "shape") or value.dtype not in _DTYPES:
            raise WeightSyncError(
                f"broadcast_weights: {name!r} is a {type(value).__name__} of dtype {getattr(value, 'dtype', None)}; "
                f"expected a tensor of one of {[str(d) for d in _DTYPES]}."
            )
        shape = tuple(int(s) for s in value.shape)
        nbytes = torch.Size(shape).numel() * value.dtype.itemsize
        entries.append(_Entry(ours, shape, value.dtype, 0, nbytes, value))
    # one region per dtype (first-appearance order), 16-byte aligned, tensors back to back inside it
    order = {dt: i for i, dt in enumerate(dict.fromkeys(e.dtype for e in entries))}
    entries.sort(key=lambda e: order[e.dtype])  # stable: manifest order inside a region
    offset, previous = 0, None
    for e in entries:
        if e.dtype != previous:
            offset, previous = -(-offset // _ALIGN) * _ALIGN, e.dtype
        e.offset = offset
        offset += e.nbytes
    return entries


def _regions(entries: list[_Entry]) -> list[tuple[int, int, list[int]]]:
    """(start, end, entry indices) of each dtype region of the payload, in payload order."""
    regions: list[tuple[int, int, list[int]]] = []
    for i, e in enumerate(entries):
        if regions and entries[regions[-1][2][0]].dtype == e.dtype:
            start, _, idx = regions[-1]
            idx.append(i)
            regions[-1] = (start, e.end, idx)
        else:
            regions.append((e.offset, e.end, [i]))
    return regions


def _windows(entries: list[_Entry], bucket: int) -> list[tuple[int, int, int]]:
    """Broadcast windows (lo, hi, region start) of at most `bucket` bytes, never crossing a dtype region.

    Windows end at tensor boundaries: each holds whole tensors (as many as fit, in payload order), or is a piece
    of one tensor larger than a bucket (cut into bucket-sized pieces, the last piece alone). Cached for the last
    manifest and bucket size.
    """
    cached = _WINDOWS.get("key")
    if cached is not None and cached[0] is entries and cached[1] == bucket:
        return _WINDOWS["windows"]
    windows: list[tuple[int, int, int]] = []
    for start, end, idx in _regions(entries):
        lo = start  # start of the open window
        for i in idx:
            e = entries[i]
            if e.end - lo <= bucket:
                continue  # fits in the open window
            if e.offset > lo:  # close the window before e
                windows.append((lo, e.offset, start))
                lo = e.offset
            if e.nbytes > bucket:  # cut e into pieces; its last piece is a window of its own
                windows += [(p, min(p + bucket, e.end), start) for p in range(e.offset, e.end, bucket)]
                lo = e.end
        if end > lo:
            windows.append((lo, end, start))
    _WINDOWS.update(key=(entries, bucket), windows=windows)
    return windows


_WINDOWS: dict[str, Any] = {}
"""The last `_windows` result and its (entries, bucket)."""


def _direct_regions(
    staging: list[tuple[torch.dtype, torch.Tensor, list[str]]], entries: list[_Entry], keep: list[bool]
) -> tuple[dict[int, tuple[torch.Tensor, torch.dtype]], list[str]]:
    """Regions this rank receives straight into its staging buffers, and the names they stage.

    `staging` is a policy's `staging_layout()` (or `kept_weight_staging()`). A region qualifies when the staging
    buffer of its dtype holds exactly the region's tensors, in the same order (so the bytes land where the slots
    are).
    """
    arenas = {dt: arena for dt, arena, _ in staging}
    if (
        _DIRECT.get("entries") is entries
        and _DIRECT["keep"] == keep
        and len(_DIRECT["arenas"]) == len(staging)
        and all(ref() is arena for ref, (_, arena, _) in zip(_DIRECT["arenas"], staging))
    ):
        return {start: (arenas[dt].view(torch.uint8), dt) for start, dt in _DIRECT["regions"]}, _DIRECT["names"]
    layout = {dt: (arena, names) for dt, arena, names in staging}
    direct: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
    names_out: list[str] = []
    for start, end, idx in _regions(entries):
        dt = entries[idx[0]].dtype
        arena, names = layout.get(dt, (None, None))
        if arena is None or not all(keep[i] for i in idx) or names != [entries[i].name for i in idx]:
            continue
        if arena.numel() * arena.element_size() != end - start:
            continue
        direct[start] = (arena.view(torch.uint8), dt)
        names_out += names
    _DIRECT.update(
        entries=entries,
        keep=list(keep),
        arenas=[weakref.ref(arena) for _, arena, _ in staging],
        regions=[(start, dt) for start, (_, dt) in direct.items()],
        names=names_out,
    )
    return direct, names_out


_DIRECT: dict[str, Any] = {}
"""The last `_direct_regions` result (regions and names), valid for the same decoded manifest, kept flags and
staging buffers (weak references: a receiver keeps its staging buffers between updates, see
`weight_sync._Plan.staging`, and this cache must not keep released ones alive)."""


def _encode_meta(entries: list[_Entry], names: bytes) -> torch.Tensor:
    """int64 [name lengths | dtype codes | ndims | payload offsets | byte sizes | shape dims | names, padded]."""
    cols = [
        [len(e.name.encode()) for e in entries],
        [_DTYPES.index(e.dtype) for e in entries],
        [len(e.shape) for e in entries],
        [e.offset for e in entries],
        [e.nbytes for e in entries],
        [d for e in entries for d in e.shape],
    ]
    padded = bytearray(names.ljust(-(-len(names) // 8) * 8, b"\0"))
    return torch.cat(
        [
            torch.tensor([v for col in cols for v in col], dtype=torch.int64),
            torch.frombuffer(padded, dtype=torch.int64) if padded else torch.zeros(0, dtype=torch.int64),
        ]
    )


_DECODED: dict[bytes, list[_Entry]] = {}
"""Receivers' decoded manifests by their bytes: a trainer sends the same manifest every iteration."""


def _decode_cached(meta: torch.Tensor, n: int, dims: int, name_bytes: int) -> list[_Entry]:
    """`_decode_meta`, memoised on the manifest's bytes (the entries are never modified on a receiver)."""
    key = meta.numpy().tobytes()
    entries = _DECODED.get(key)
    if entries is None:
        if len(_DECODED) >= 4:
            _DECODED.clear()
        entries = _DECODED[key] = _decode_meta(meta, n, dims, name_bytes)
    return entries


def _decode_meta(meta: torch.Tensor, n: int, dims: int, name_bytes: int) -> list[_Entry]:
    values = meta[: 5 * n + dims].tolist()
    names = meta[5 * n + dims :].numpy().tobytes()[:name_bytes]
    lengths, codes, ndims, offsets, sizes = (values[i * n : (i + 1) * n] for i in range(5))
    dim_values, pos, entries = values[5 * n :], 0, []
    name_pos = 0
    for i in range(n):
        name = names[name_pos : name_pos + lengths[i]].decode()
        name_pos += lengths[i]
        shape = tuple(dim_values[pos : pos + ndims[i]])
        pos += ndims[i]
        entries.append(_Entry(name, shape, _DTYPES[codes[i]], offsets[i], sizes[i]))
    return entries


def _typed(raw: torch.Tensor, e: _Entry) -> torch.Tensor:
    """A uint8 view of a tensor's bytes -> the tensor (no copy)."""
    return raw.view(e.dtype).view(e.shape)


class _Packer:
    """Rank src's bytes of each window, made from the source tensors.

    A window of whole tensors is one `_flatten_dense_tensors` call: their flat views are made and concatenated
    in C++, so a tensor costs a view, not Python calls (pi05's expert set is 222 tensors; per-tensor Python was
    ~0.5 ms of host time per window on the H200 host, about what a 256 MiB window takes on the wire). A window
    that is a piece of a tensor larger than a bucket is a byte slice of it (a copy only when the tensor is not
    contiguous or not on the communication device; a DTensor is materialised once for all its pieces). Plain
    tensors are used as they are: the manifest was built from, or checked against, these very tensors in this
    call. DTensors are materialised and checked as their window is packed.
    """

    def __init__(self, entries: list[_Entry], windows: list[tuple[int, int, int]], dev: torch.device) -> None:
        self.entries, self.windows, self.dev = entries, windows, dev
        self.values = [e.value for e in entries]
        self.plain = all(type(v) in _PLAIN_TENSOR_TYPES for v in self.values)
        offsets = [e.offset for e in entries]
        self.spans: list[tuple[bool, list[int]]] = []  # per window: (a piece of one tensor?, entry indices)
        for lo, hi, _ in windows:
            i = bisect.bisect_right(offsets, lo) - 1
            if i >= 0 and entries[i].nbytes and (entries[i].offset < lo or entries[i].end > hi):
                self.spans.append((True, [i]))
            else:
                first, last = bisect.bisect_left(offsets, lo), bisect.bisect_left(offsets, hi)
                self.spans.append((False, [k for k in range(first, last) if entries[k].nbytes]))
        self.cached: tuple[int, torch.Tensor] | None = None  # the tensor cut into pieces, as bytes

    def _tensor(self, i: int) -> torch.Tensor:
        e, t = self.entries[i], self.values[i]
        if type(t) in _PLAIN_TENSOR_TYPES:
            return t
        t = materialize(t, e.name, "broadcast_weights")
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise WeightSyncError(
                f"broadcast_weights: {e.name!r} materialised as {list(t.shape)} {t.dtype}, but its metadata "
                f"said {list(e.shape)} {e.dtype}; do not change source tensors during a sync."
            )
        return t

    @torch.no_grad()
    def window(self, j: int) -> torch.Tensor:
        """Payload bytes [lo, hi) of window j: a 1-D uint8 tensor on the communication device."""
        lo, hi, _ = self.windows[j]
        piece, idx = self.spans[j]
        if piece:
            i = idx[0]
            if self.cached is None or self.cached[0] != i:
                self.cached = (i, self._tensor(i).contiguous().reshape(-1).view(torch.uint8))
            data = self.cached[1][lo - self.entries[i].offset : hi - self.entries[i].offset]
        else:
            tensors = [self.values[i] for i in idx] if self.plain else [self._tensor(i) for i in idx]
            data = _flatten_dense_tensors(tensors).view(torch.uint8)
        return data if data.device == self.dev else data.to(self.dev)


def _vote_rows(version: int, rank: int, world: int, dev: torch.device) -> torch.Tensor:
    """A rank's three possible votes on `dev`, (ok, -version, 2 * failed rank + phase): ok, refused, failed.

    Made before the data lands: a copy from pageable host memory may wait for the stream it is queued on, and the
    vote must not wait on the host for anything but the all_reduce.
    """
    rows = [[1, -version, 2 * world], [0, -version, 2 * rank], [0, -version, 2 * rank + 1]]
    return torch.tensor(rows, dtype=torch.int64).to(dev)


def _vote(
    ok: bool, refused: bool, flag: torch.Tensor | None, rows: torch.Tensor, group: Any
) -> tuple[bool, int, int, bool]:
    """all_reduce(MIN) of this rank's row of `rows` (`_vote_rows`), `flag` and-ed in on the device.

    Returns (all ok, largest version, lowest failed rank, whether it refused the manifest). The flag (this rank's
    finiteness check) is never read on the host before the vote: the reduction waits for it on the device.
    """
    if not ok:
        t = rows[1 if refused else 2].clone()
    elif flag is None:
        t = rows[0].clone()
    else:
        t = torch.where(flag.to(rows.device), rows[0], rows[2])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    _phase("vote_queued")
    all_ok, neg_version, code = t.tolist()
    return bool(all_ok), -neg_version, code // 2, code % 2 == 0


def _abort(policy: Pi05Policy | None) -> None:
    if policy is not None and policy.weight_update_in_progress:
        policy.abort_weight_update()


def _failure(what: str, failed: int, rank: int, error: BaseException | None) -> WeightSyncError:
    mine = f" This rank's error: {type(error).__name__}: {error}" if error is not None else ""
    err = WeightSyncError(
        f"broadcast_weights: aborted on every rank; rank {failed} {what}. Every rank keeps its weights and "
        f"version.{mine}"
    )
    err.__cause__ = error
    return err
