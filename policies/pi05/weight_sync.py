"""Weight sync (DESIGN C6): in-place, all-or-nothing weight updates of a running `Pi05Policy`.

One update is a transaction on a `WeightSync` object::

    begin(expected)      fix the names this update must deliver; one flat staging buffer per dtype
    stage(pairs) ...     validate names, shapes, duplicates; copy into the staging buffers on their own stream
    check()              every expected name arrived; a device flag: every staged value is finite
    commit(version)      copy into the parameters, refresh the weight-derived tables
    abort()              drop the staging buffers

Nothing is written into a parameter before the checks passed, so an abort or any failure leaves the weights
bit-identical and the policy serving them. The commit is queued on the compute stream (the current stream of the
thread that commits, the one `act()` replays on) behind every earlier read of the weights, copies into the
existing parameter storage and refreshes the tables in place; the next read waits on its event. Captured CUDA
graphs read parameters and tables by address, so they stay valid and nothing is recaptured. The host waits for
the staging stream only (the finiteness flag), never for the compute stream. On CPU it is plain copies.

Locking: every step that touches the transaction holds the lock the policy's `act()` holds, so a read and a
commit never interleave on the host; a source is read outside it, so `act()` keeps serving the old weights while
a trainer streams tensors.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoint import TIED_EMBEDDING, to_internal_name

WeightSource = Mapping[str, Any] | Iterable[tuple[str, Any]] | torch.nn.Module
"""A mapping name -> tensor, an iterable of (name, tensor) pairs, or an `nn.Module` (its named_parameters)."""

_GROUP_BYTES = 256 << 20
"""Source bytes staged per group: bounds what a generator's materialised tensors may hold at once."""
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
"""Name segments that FSDP1, activation checkpointing and torch.compile insert into module names."""


class WeightSyncError(ValueError):
    """A weight update was refused; the message names the tensor, what was expected, what came, and the fix.

    Whenever it is raised the update has ended and the weights are unchanged.
    """


class WeightSyncStateError(WeightSyncError, RuntimeError):
    """A weight-sync call out of order: finish/update/abort without begin, begin twice, use after close."""


@dataclass(repr=False)
class WeightUpdateReport:
    """What one committed weight update did; `repr` is one line of counts, `names` lists the tensors.

    Attributes:
        version: the policy's weight version after the commit (what `PolicyOutput.header` reports from now on).
        names: our parameter names written, in arrival order.
        num_tensors: len(names).
        num_bytes: bytes written into parameters (in the parameters' dtypes).
        source_bytes: bytes read from the sources (in the sources' dtypes).
        skipped: source names not written: known dead keys, and (`sync_weights` only) parameters outside
            the expected set.
        duration_s: host seconds from `begin` to the queued commit.
        expected: the expected set: "all", "trainable" or "list".

    Example:
        >>> WeightUpdateReport(3, ["a.weight", "a.bias"], 2, 48, 96, ["b"], 0.01, "trainable")
        WeightUpdateReport(version=3, expected='trainable', tensors=2, bytes=48, source_bytes=96, skipped=1, 10.0 ms)
    """

    version: int
    names: list[str]
    num_tensors: int
    num_bytes: int
    source_bytes: int
    skipped: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    expected: str = "trainable"

    def __repr__(self) -> str:
        return (
            f"WeightUpdateReport(version={self.version}, expected={self.expected!r}, tensors={self.num_tensors}, "
            f"bytes={self.num_bytes}, source_bytes={self.source_bytes}, skipped={len(self.skipped)}, "
            f"{self.duration_s * 1e3:.1f} ms)"
        )


class _Transaction:
    """One open update: the expected names, the staging buffers and their slots, what has arrived."""

    def __init__(
        self, params: dict[str, torch.nn.Parameter], expected: list[str], mode: str, stream: Any, device: Any
    ) -> None:
        self.params, self.expected, self.mode, self.stream = params, expected, mode, stream
        self.expected_set = frozenset(expected)
        self.started = time.perf_counter()
        self.received: dict[str, tuple[str, int]] = {}  # our name -> (source name, source bytes)
        self.skipped: list[str] = []
        self.flag: torch.Tensor | None = None  # finiteness of what is staged now (None: not computed)
        self.layout: dict[torch.dtype, list[str]] = {}  # per dtype the slot names, in buffer order
        for name in expected:
            self.layout.setdefault(params[name].dtype, []).append(name)
        self.arenas: dict[torch.dtype, torch.Tensor] = {}
        self.slots: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(stream):
            for dtype, names in self.layout.items():
                sizes = [params[n].numel() for n in names]
                arena = self.arenas[dtype] = torch.empty(sum(sizes), dtype=dtype, device=device)
                self.slots.update((n, part.view(params[n].shape)) for n, part in zip(names, arena.split(sizes)))


class WeightSync:
    """Transactional in-place weight updates of one model whose weight-derived tables `refresh` recomputes.

    `expected` fixes what an update must deliver: "trainable" (default: the parameters with `requires_grad`,
    RLinf's sync set), "all", or a list of names. Names may be ours or LeRobot / openpi names
    (`checkpoint.to_internal_name`); DTensors are materialised with `.full_tensor()`; values are cast to each
    parameter's dtype. `stage` refuses unknown names, names outside the expected set, a name sent twice and
    wrong shapes; `check` refuses missing names and `commit` non-finite values. Every refusal raises
    `WeightSyncError`, ends the update and leaves the weights bit-identical. Source tensors must stay unchanged
    until the commit returns. `Pi05Policy` composes one (`policy.weight_sync`) and delegates its C6 methods.

    Args:
        model: the module whose parameters are updated in place.
        refresh: recomputes every weight-derived table in place (called inside the commit).
        lock: the lock every reader of the weights holds (the policy's `act()` lock).

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> sync = WeightSync(model, refresh=lambda: None)
        >>> sync.sync({"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, expected="all").num_tensors
        2
        >>> bool((model.weight == 1).all()), sync.version
        (True, 1)
    """

    def __init__(self, model: torch.nn.Module, refresh: Callable[[], None], lock: Any = None) -> None:
        self.model, self.refresh = model, refresh
        self.lock = lock if lock is not None else threading.RLock()
        self.device = next(model.parameters()).device
        self.version = 0
        self.closed = False
        self._txn: _Transaction | None = None
        self._last_end: str | None = None  # how the last update ended (for the next out-of-order call's message)
        self._poisoned: str | None = None  # a commit failed midway: refuse to serve until a complete update
        self._commit_event: Any = None  # on the compute stream, after the last commit
        self._readers: dict[int, Any] = {}  # per stream that read the weights: an event after its last read
        self._stream: Any = None  # the staging stream (CUDA)

    @property
    def in_progress(self) -> bool:
        """True between `begin` and the end of that update."""
        return self._txn is not None

    # --------------------------------------------------------------------------------------- transaction
    def begin(self, expected: str | Sequence[str] = "trainable", order: Sequence[str] | None = None) -> None:
        """Open an update that must deliver `expected`; `order` (our names) lays out the staging buffers."""
        self._open(expected, order)

    def _open(self, expected: str | Sequence[str], order: Sequence[str] | None) -> _Transaction:
        with self.lock:
            if self.closed:
                raise WeightSyncStateError("begin_weight_update: the policy is closed; create a new policy.")
            if self._txn is not None:
                txn = self._txn
                raise WeightSyncStateError(
                    f"begin_weight_update: an update (expected={txn.mode!r}, {len(txn.received)} tensors staged, "
                    f"begun {time.perf_counter() - txn.started:.1f} s ago) is already in progress; "
                    "finish_weight_update() or abort_weight_update() it first."
                )
            params = dict(self.model.named_parameters())
            names, mode = _resolve_expected(expected, params)
            if order is not None:  # a sender's order: its regions then match the staging buffers
                rank = {n: i for i, n in enumerate(order)}
                names.sort(key=lambda n: rank.get(n, len(rank)))
            if self.device.type == "cuda" and self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._txn = _Transaction(params, names, mode, self._stream, self.device)
            return self._txn

    def stage(
        self, named_tensors: WeightSource, *, skip_outside: bool = False, where: str = "update_weights"
    ) -> int:
        """Validate and stage (name, tensor) pairs (a mapping or an iterable); returns how many were staged.

        May be called any number of times in any order. Known dead keys are skipped; `skip_outside` also skips
        (and reports) parameters outside the expected set. The source is read outside the lock.
        """
        with self.lock:
            txn = self._require(where)
        pairs = _iter_pairs(named_tensors, where)
        staged, group, group_bytes = 0, [], 0
        try:
            for name, value in pairs:
                ours = name if name in txn.params else to_internal_name(name)
                if skip_outside and ours in txn.params and ours not in txn.expected_set:
                    txn.skipped.append(name)
                    continue
                tensor = materialize(value, name, where)
                group.append((name, ours, tensor))
                group_bytes += tensor.numel() * tensor.element_size()
                if group_bytes >= _GROUP_BYTES:
                    staged += self._stage(txn, group, where)
                    group, group_bytes = [], 0
            return staged + self._stage(txn, group, where)
        except WeightSyncStateError:
            raise
        except WeightSyncError as err:
            self._end(txn, f"failed: {err}")
            raise
        except Exception as err:
            self._end(txn, f"the source raised {type(err).__name__}")
            raise WeightSyncError(
                f"{where}: reading or staging the source raised {type(err).__name__}: {err}. The update was "
                "aborted and the weights are unchanged; fix the source and begin a new update."
            ) from err
        except BaseException:
            self._end(txn, "interrupted")
            raise

    def _stage(self, txn: _Transaction, group: list[tuple[str, str | None, torch.Tensor]], where: str) -> int:
        """Validate a group under the lock, then queue its copies on the staging stream."""
        with self.lock:
            if self._txn is not txn:
                raise WeightSyncStateError(
                    f"{where}: the update ended while this call was staging ({self._last_end}); begin a new update."
                )
            dsts, srcs = [], []
            for name, ours, tensor in group:
                ours = _check_entry(txn, txn.received, name, ours, tensor.shape, tensor.dtype, where)
                if ours is None:
                    txn.skipped.append(name)
                    continue
                txn.received[ours] = (name, tensor.numel() * tensor.element_size())
                dsts.append(txn.slots[ours])
                srcs.append(tensor)
            txn.flag = None
            if txn.stream is not None:  # sources produced on their devices' current streams come first
                for device in {s.device for s in srcs if s.is_cuda}:
                    txn.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(txn.stream), torch.no_grad():
                copy_all(dsts, srcs, non_blocking=txn.stream is not None)
            if txn.stream is not None:  # the caller may drop them: keep their memory until the copies ran
                for src in srcs:
                    if src.is_cuda:
                        src.record_stream(txn.stream)
            return len(dsts)

    def check_manifest(self, entries: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> list[bool]:
        """Check (name, shape, dtype) entries against the open update before any data arrives.

        Returns per entry whether it will be staged (False: a dead key or a parameter outside the expected set).
        Unknown names, duplicates, wrong shapes or dtypes and expected names the entries lack raise
        `WeightSyncError` and end the update.
        """
        where = "check_weight_manifest"
        with self.lock:
            txn = self._require(where)
            try:
                keep, seen = [], dict(txn.received)
                for name, shape, dtype in entries:
                    ours = name if name in txn.params else to_internal_name(name)
                    if ours in txn.params and ours not in txn.expected_set:
                        keep.append(False)
                        continue
                    ours = _check_entry(txn, seen, name, ours, shape, dtype, where)
                    keep.append(ours is not None)
                    if ours is not None:
                        seen[ours] = (name, 0)
                _raise_missing(txn, [n for n in txn.expected if n not in seen], where)
                return keep
            except WeightSyncError as err:
                self._end(txn, f"failed: {err}")
                raise

    def region(self, dtype: torch.dtype, names: Sequence[str]) -> torch.Tensor | None:
        """The staging buffer of `dtype` as bytes when it holds exactly `names` in this order, else None.

        Bytes written there (on the current stream) count once `mark_received(names)` is called.
        """
        with self.lock:
            txn = self._require("region")
            if txn.layout.get(dtype) != list(names) or any(n in txn.received for n in names):
                return None
            return txn.arenas[dtype].view(torch.uint8)

    def mark_received(self, names: Sequence[str]) -> None:
        """Record `names` as staged after their bytes were written into a `region` buffer on the current stream."""
        with self.lock:
            txn = self._require("mark_received")
            for name in names:
                txn.received[name] = (name, txn.slots[name].numel() * txn.slots[name].element_size())
            txn.flag = None
            if txn.stream is not None:
                txn.stream.wait_stream(torch.cuda.current_stream(self.device))

    def check(self, where: str = "check") -> torch.Tensor:
        """Every expected name arrived (else raise, ending the update); a 0-d bool device tensor: all finite.

        The flag is one min/max reduction per staging buffer, queued on the staging stream; the current stream
        is ordered after it, so a collective on the current stream may read it without a host sync.
        """
        with self.lock:
            txn = self._require(where)
            try:
                _raise_missing(txn, [n for n in txn.expected if n not in txn.received], where)
            except WeightSyncError as err:
                self._end(txn, f"failed: {err}")
                raise
            if txn.flag is None:
                with torch.cuda.stream(txn.stream), torch.no_grad():
                    flags = [torch.isfinite(torch.stack(torch.aminmax(a))).all() for a in _floating(txn)]
                    txn.flag = torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=self.device)
                if txn.stream is not None:
                    torch.cuda.current_stream(self.device).wait_stream(txn.stream)
            return txn.flag

    def commit(
        self, version: int | None = None, *, checked: bool = False, where: str = "finish_weight_update"
    ) -> WeightUpdateReport:
        """`check`, then copy into the parameters and refresh the tables on the compute stream; the report.

        `version` (> the current one) sets the new version (default current + 1). ``checked=True``: the caller
        read the flag of `check` as True (the broadcast's vote), so the host does not read it again.
        """
        with self.lock:
            txn = self._require(where)
            flag = self.check(where)
            try:
                if not checked:
                    with torch.cuda.stream(txn.stream):  # the host waits for the staging stream only
                        finite = bool(flag)
                    if not finite:
                        raise WeightSyncError(
                            f"{where}: non-finite values (NaN/Inf, after casting to the parameter dtype) in "
                            f"{self.nonfinite()[:10]}; expected finite weights. The trainer diverged or a cast "
                            "overflowed; the weights are unchanged."
                        )
                new_version = self.version + 1 if version is None else int(version)
                if new_version <= self.version:
                    raise WeightSyncError(
                        f"{where}: version must increase: expected > {self.version}, received {new_version}; "
                        "pass a larger version or None."
                    )
            except WeightSyncError as err:
                self._end(txn, f"failed: {err}")
                raise
            self._write(txn)
            self.version = new_version
            self._end(txn, f"committed version {new_version}")
            names = list(txn.received)
            return WeightUpdateReport(
                version=new_version,
                names=names,
                num_tensors=len(names),
                num_bytes=sum(txn.params[n].numel() * txn.params[n].element_size() for n in names),
                source_bytes=sum(b for _, b in txn.received.values()),
                skipped=list(txn.skipped),
                duration_s=time.perf_counter() - txn.started,
                expected=txn.mode,
            )

    def _write(self, txn: _Transaction) -> None:
        """The in-place copies and the table refresh, queued on the compute stream; poison on a failure midway."""
        names = list(txn.received)
        compute = torch.cuda.current_stream(self.device) if txn.stream is not None else None
        try:
            if compute is not None:
                compute.wait_stream(txn.stream)
                for event in self._readers.values():
                    compute.wait_event(event)  # readers on other streams finish with the old weights first
            with torch.no_grad():
                copy_all([txn.params[n] for n in names], [txn.slots[n] for n in names], non_blocking=False)
                self.refresh()
            if compute is not None:
                self._commit_event = torch.cuda.Event()
                self._commit_event.record(compute)
                for arena in txn.arenas.values():
                    arena.record_stream(compute)  # freed once the commit copies ran
        except BaseException as err:
            self._poisoned = f"a commit failed after writing began ({type(err).__name__}: {err})"
            self._end(txn, "commit failed")
            raise WeightSyncError(
                f"finish_weight_update: the commit failed midway ({type(err).__name__}: {err}); the weights are "
                "inconsistent and the policy refuses to serve until a complete update commits."
            ) from err
        if self._poisoned is not None and set(names) == set(txn.params):
            self._poisoned = None

    def finish(self, version: int | None = None) -> WeightUpdateReport:
        """Validate (complete, finite, version increasing), then commit in place; returns the report."""
        return self.commit(version)

    def abort(self) -> None:
        """Drop the open update; the weights stay as they are (nothing was written yet)."""
        with self.lock:
            self._end(self._require("abort_weight_update"), "aborted by abort_weight_update()")

    def nonfinite(self) -> list[str]:
        """Names of the open update whose staged values are not all finite (a scan per tensor)."""
        with self.lock:
            txn = self._require("nonfinite")
            with torch.cuda.stream(txn.stream), torch.no_grad():
                slots = txn.slots
                return [n for n in txn.received if slots[n].is_floating_point() and not torch.isfinite(slots[n]).all()]

    def sync(self, source: WeightSource, expected: str | Sequence[str] = "trainable") -> WeightUpdateReport:
        """One-call update from an `nn.Module` (its named_parameters), a state dict, or (name, tensor) pairs.

        Source parameters outside the expected set (e.g. the frozen VLM of a full trainer model) are skipped
        and reported; unknown names are refused.
        """
        txn = self._open(expected, None)
        try:
            self.stage(source_pairs(source, "sync_weights"), skip_outside=True, where="sync_weights")
            return self.commit()
        except BaseException:
            with self.lock:
                if self._txn is txn:
                    self._end(txn, "sync_weights failed")
            raise

    # ------------------------------------------------------------------------------------ for the policy
    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Wrap every read of the weights (act, value, evaluate): holds the lock, orders the read after the last
        commit and lets the next commit wait for it, without host sync.
        """
        with self.lock:
            if self._poisoned is not None:
                raise WeightSyncStateError(
                    f"the policy's weights are inconsistent ({self._poisoned}); it refuses to serve until a "
                    "complete update (begin_weight_update(expected='all')) commits."
                )
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            if stream is not None and self._commit_event is not None:
                stream.wait_event(self._commit_event)
            try:
                yield
            finally:
                if stream is not None:
                    self._readers.setdefault(stream.cuda_stream, torch.cuda.Event()).record(stream)

    def close(self) -> None:
        """Abort an update in flight (its later calls raise) and refuse new ones."""
        with self.lock:
            if self._txn is not None:
                self._end(self._txn, "aborted by close()")
            self.closed = True

    # -------------------------------------------------------------------------------------- internals
    def _require(self, where: str) -> _Transaction:
        if self._txn is not None:
            return self._txn
        if self.closed:
            raise WeightSyncStateError(f"{where}: the policy is closed; no weight update can run.")
        last = f" (the last one {self._last_end})" if self._last_end else ""
        raise WeightSyncStateError(f"{where}: no weight update in progress{last}; call begin_weight_update() first.")

    def _end(self, txn: _Transaction, reason: str) -> None:
        if self._txn is txn:
            self._txn = None
            self._last_end = reason if len(reason) < 300 else reason[:297] + "..."
        txn.slots, txn.arenas = {}, {}


def _check_entry(
    txn: _Transaction, seen: Mapping[str, tuple[str, int]], name: str, ours: str | None, shape: Any, dtype: Any,
    where: str,
) -> str | None:  # fmt: skip
    """Our name for a source entry, None for a dead key; raises WeightSyncError for anything invalid."""
    if ours is None:
        return None
    param = txn.params.get(ours)
    if param is None:
        raise WeightSyncError(
            f"{where}: {name!r} names no parameter of this model (mapped to {ours!r}); expected our names "
            f"(e.g. {txn.expected[0]!r}) or LeRobot / openpi names. Remove peft/LoRA or wrapper prefixes on the sender."
        )
    if ours not in txn.expected_set:
        raise WeightSyncError(
            f"{where}: {name!r} is a parameter but not part of this update (expected={txn.mode!r}); "
            "begin_weight_update(expected='all') or a list that includes it, or do not send it."
        )
    if ours in seen:
        raise WeightSyncError(
            f"{where}: {ours!r} was already sent in this update (as {seen[ours][0]!r}, now as {name!r}); "
            "send every parameter once per update."
        )
    if tuple(shape) != tuple(param.shape):
        raise WeightSyncError(
            f"{where}: {name!r}: expected shape {list(param.shape)}, received {list(shape)}; the sender's "
            "model geometry differs from this policy's config."
        )
    if param.is_floating_point() and not dtype.is_floating_point:
        raise WeightSyncError(
            f"{where}: {name!r}: expected a floating-point tensor (cast to {param.dtype}), received {dtype}."
        )
    return ours


def _resolve_expected(expected: str | Sequence[str], params: dict[str, torch.nn.Parameter]) -> tuple[list[str], str]:
    """Our names of the expected set, in model order, and the mode label."""
    if isinstance(expected, str):
        if expected == "all":
            return list(params), "all"
        if expected == "trainable":
            names = [n for n, p in params.items() if p.requires_grad]
            if not names:
                raise WeightSyncError(
                    "begin_weight_update: expected='trainable' but no parameter requires grad; call "
                    "policy.set_trainable('expert' or 'all') or pass expected='all'."
                )
            return names, "trainable"
        raise WeightSyncError(
            f"begin_weight_update: expected must be 'all', 'trainable' or a list of names, got {expected!r}."
        )
    chosen: dict[str, str] = {}
    for name in expected:
        ours = to_internal_name(name) if isinstance(name, str) else None
        if ours is None or ours not in params:
            raise WeightSyncError(
                f"begin_weight_update: expected names a non-parameter {name!r}; list parameter names "
                "(ours or LeRobot / openpi)."
            )
        if ours in chosen:
            raise WeightSyncError(
                f"begin_weight_update: expected lists {ours!r} twice (as {chosen[ours]!r} and {name!r}); list it once."
            )
        chosen[ours] = name
    if not chosen:
        raise WeightSyncError("begin_weight_update: expected is an empty list; name at least one parameter.")
    return [n for n in params if n in chosen], "list"


def _raise_missing(txn: _Transaction, missing: list[str], where: str) -> None:
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise WeightSyncError(
            f"{where}: {len(missing)} of the {len(txn.expected)} expected parameters (expected={txn.mode!r}) were "
            f"not sent: {missing[:10]}{more}. Send them, or begin with expected=[...] listing what you send."
        )


def _floating(txn: _Transaction) -> list[torch.Tensor]:
    return [a for a in txn.arenas.values() if a.numel() and a.is_floating_point()]


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    """dst.copy_(src) for every pair: one `_foreach_copy_` per (device, dtype) combination of the pairs."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dsts, srcs):
        gd, gs = groups.setdefault((d.device, d.dtype, s.device, s.dtype), ([], []))
        gd.append(d)
        gs.append(s)
    for gd, gs in groups.values():
        torch._foreach_copy_(gd, gs, non_blocking=non_blocking)


def materialize(value: Any, name: str, where: str) -> torch.Tensor:
    """A plain tensor; DTensors (FSDP2 trainers) are materialised with `.full_tensor()` (a mesh collective)."""
    if not isinstance(value, torch.Tensor) and hasattr(value, "full_tensor"):
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor):
        raise WeightSyncError(
            f"{where}: the value for {name!r} is a {type(value).__name__}, expected a torch.Tensor (or a DTensor); "
            "pass (name, tensor) pairs."
        )
    return value


def _iter_pairs(source: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(name, value) pairs of a mapping or an iterable of pairs; values are not materialised yet."""
    if isinstance(source, (str, bytes, torch.Tensor)) or not isinstance(source, (Mapping, Iterable)):
        raise WeightSyncError(
            f"{where}: expected a mapping name -> tensor or an iterable of (name, tensor) pairs, "
            f"got {type(source).__name__}."
        )
    for item in source.items() if isinstance(source, Mapping) else source:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise WeightSyncError(
                f"{where}: expected (name, tensor) pairs, got an item of type {type(item).__name__}; pass a "
                "mapping or e.g. model.named_parameters()."
            )
        yield item[0], item[1]


def source_pairs(source: WeightSource, where: str, trainable_only: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, value) pairs of any weight source, module-wrapper prefixes removed from module names.

    A mapping that holds both the token embedding and LeRobot's tied `lm_head` copy of it loses the tied copy
    (they are one tensor). `trainable_only` keeps an `nn.Module`'s `requires_grad` parameters.
    """
    if isinstance(source, torch.nn.Module):
        for name, param in source.named_parameters():
            if trainable_only and not param.requires_grad:
                continue
            for segment in _WRAPPER_SEGMENTS:
                name = name.replace(segment, "")
            yield name.removeprefix("module."), param
        return
    tied = isinstance(source, Mapping) and sum(to_internal_name(k) == "llm.embed_tokens.weight" for k in source) > 1
    for name, value in _iter_pairs(source, where):
        if not (tied and name.removeprefix("model.") == TIED_EMBEDDING):
            yield name, value
