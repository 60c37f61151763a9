"""Weight sync (DESIGN C6): in-place, all-or-nothing weight updates of a running `Pi05Policy`.

A transaction on a `WeightSync`: `begin(expected)` allocates one flat staging buffer per dtype; `stage(pairs)`
validates names, shapes and duplicates and copies into the buffers on a stream of their own; `check()` checks
completeness and gives a device flag (every staged value finite); `commit(version)` copies into the parameters
and refreshes the weight-derived tables; `abort()` drops the buffers. Until the commit nothing is written, so an
abort or any failure leaves the weights bit-identical. The commit is queued on the compute stream (the current
stream of the committing thread, the one `act()` replays on) behind every earlier read, and the next read waits
on its event; captured CUDA graphs stay valid. The host waits for the staging stream only, never for the compute
stream. Every step holds the lock `act()` holds; sources are read outside it, so `act()` keeps serving.
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
"""Source bytes staged per group: bounds what a generator's materialised tensors hold at once."""
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
"""Name segments that FSDP1, activation checkpointing and torch.compile insert into module names."""


class WeightSyncError(ValueError):
    """A refused weight update (the tensor, what was expected, what came, the fix); the weights are unchanged."""


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
        skipped: source names not written: known dead keys, and (`sync_weights`) parameters outside the set.
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

    def __init__(self, params: dict[str, Any], expected: list[str], mode: str, stream: Any, device: Any) -> None:
        self.params, self.expected, self.mode, self.stream = params, expected, mode, stream
        self.expected_set, self.started, self.skipped = frozenset(expected), time.perf_counter(), []
        self.received: dict[str, tuple[str, int]] = {}  # our name -> (source name, source bytes)
        self.flag: torch.Tensor | None = None  # finiteness of what is staged now (None: not computed yet)
        layout: dict[torch.dtype, list[str]] = {}  # per dtype the slot names, in buffer order
        for name in expected:
            layout.setdefault(params[name].dtype, []).append(name)
        self.arenas: dict[torch.dtype, torch.Tensor] = {}  # one flat staging buffer per dtype ...
        self.slots: dict[str, torch.Tensor] = {}  # ... and a view of it per expected name
        with torch.cuda.stream(stream):
            for dtype, names in layout.items():
                sizes = [params[n].numel() for n in names]
                arena = self.arenas[dtype] = torch.empty(sum(sizes), dtype=dtype, device=device)
                self.slots.update((n, part.view(params[n].shape)) for n, part in zip(names, arena.split(sizes)))


class WeightSync:
    """Transactional in-place weight updates of `model`, whose weight-derived tables `refresh` recomputes.

    `expected` is "trainable" (the parameters with `requires_grad`), "all", or a list of names (ours or
    LeRobot / openpi names); DTensors are materialised with `.full_tensor()`; values are cast to each parameter's
    dtype. Unknown names, names outside the set, duplicates, wrong shapes, missing names and non-finite values
    raise `WeightSyncError`, which ends the update and leaves the weights bit-identical. Sources must stay
    unchanged until the commit returns. `Pi05Policy` composes one (`policy.weight_sync`) and delegates to it.

    Args:
        model: the module whose parameters are updated in place.
        refresh: recomputes the weight-derived tables in place (called inside the commit with the names of the
            committed parameters).
        lock: the lock every reader of the weights holds (the policy's `act()` lock).

    Example:
        >>> sync = WeightSync(torch.nn.Linear(2, 2), refresh=lambda names: None)
        >>> sync.sync({"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, expected="all").version
        1
    """

    def __init__(self, model: torch.nn.Module, refresh: Callable[[list[str]], None], lock: Any = None) -> None:
        self.model, self.refresh = model, refresh
        self.lock = lock if lock is not None else threading.RLock()
        self.device = next(model.parameters()).device
        self.version, self.closed = 0, False
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

    def begin(self, expected: str | Sequence[str] = "trainable") -> None:
        """Open an update that must deliver `expected`: "trainable", "all" or a list of names."""
        with self.lock:
            if self.closed:
                raise WeightSyncStateError("begin_weight_update: the policy is closed; create a new policy.")
            if self._txn is not None:
                raise WeightSyncStateError(
                    f"begin_weight_update: an update (expected={self._txn.mode!r}, {len(self._txn.received)} "
                    "tensors staged) is already in progress; finish_weight_update() or abort_weight_update() it first."
                )
            params = dict(self.model.named_parameters())
            names, mode = _resolve_expected(expected, params)
            if self.device.type == "cuda" and self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._txn = _Transaction(params, names, mode, self._stream, self.device)

    def stage(self, named_tensors: WeightSource, *, skip_outside: bool = False, where: str = "update_weights") -> int:
        """Validate and stage (name, tensor) pairs or a mapping, any number of calls; returns how many were staged.

        Known dead keys are skipped; `skip_outside` also skips (and reports) parameters outside the expected set.
        """
        with self.lock:
            txn = self._require(where)
        staged, group, group_bytes = 0, [], 0
        try:
            for name, value in source_pairs(named_tensors, where):
                ours = name if name in txn.params else to_internal_name(name)
                if skip_outside and ours in txn.params and ours not in txn.expected_set:
                    txn.skipped.append(name)
                    continue
                group.append((name, ours, materialize(value, name, where)))
                group_bytes += group[-1][2].numel() * group[-1][2].element_size()
                if group_bytes >= _GROUP_BYTES:
                    staged, group, group_bytes = staged + self._stage(txn, group, where), [], 0
            return staged + self._stage(txn, group, where)
        except BaseException as err:
            if isinstance(err, WeightSyncStateError):
                raise
            self._end(txn, f"failed: {err}" if isinstance(err, WeightSyncError) else type(err).__name__)
            if isinstance(err, WeightSyncError) or not isinstance(err, Exception):
                raise
            raise WeightSyncError(
                f"{where}: reading or staging the source raised {type(err).__name__}: {err}. The update was "
                "aborted and the weights are unchanged; fix the source and begin a new update."
            ) from err

    def _stage(self, txn: _Transaction, group: list[tuple[str, str | None, torch.Tensor]], where: str) -> int:
        """Validate a group under the lock, then queue its copies on the staging stream."""
        with self.lock:
            if self._txn is not txn:
                raise WeightSyncStateError(f"{where}: the update ended while staging ({self._last_end}); begin anew.")
            dsts, srcs = [], []
            for name, ours, tensor in group:
                if _check_entry(txn, txn.received, name, ours, tensor.shape, tensor.dtype, where) is None:
                    txn.skipped.append(name)
                    continue
                txn.received[ours] = (name, tensor.numel() * tensor.element_size())  # type: ignore[index]
                dsts.append(txn.slots[ours])  # type: ignore[index]
                srcs.append(tensor)
            txn.flag = None
            if txn.stream is not None:  # sources produced on their devices' current streams come first
                for device in {s.device for s in srcs if s.is_cuda}:
                    txn.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(txn.stream), torch.no_grad():
                copy_all(dsts, srcs, non_blocking=txn.stream is not None)
            for src in (s for s in srcs if s.is_cuda and txn.stream is not None):
                src.record_stream(txn.stream)  # the caller may drop them: keep their memory until the copies ran
            return len(dsts)

    def check(self, where: str = "check") -> torch.Tensor:
        """Raise (ending the update) unless every expected name arrived; a 0-d bool device flag: all finite.

        One min/max reduction per staging buffer on the staging stream; the current stream is ordered after it,
        so a collective on the current stream reads the flag without a host sync.
        """
        with self.lock:
            txn = self._require(where)
            missing = [n for n in txn.expected if n not in txn.received]
            if missing:
                self._end(txn, "failed: missing tensors")
                more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
                raise WeightSyncError(
                    f"{where}: {len(missing)} of the {len(txn.expected)} expected parameters (expected={txn.mode!r}) "
                    f"were not sent: {missing[:10]}{more}. Send them, or begin with expected=[...] listing them."
                )
            if txn.flag is None:
                with torch.cuda.stream(txn.stream), torch.no_grad():
                    arenas = [a for a in txn.arenas.values() if a.numel() and a.is_floating_point()]
                    flags = [torch.stack(torch.aminmax(a)) for a in arenas]
                    txn.flag = torch.cat([torch.ones(1, device=self.device), *flags]).isfinite().all()
                if txn.stream is not None:  # read on the current stream from now on
                    torch.cuda.current_stream(self.device).wait_stream(txn.stream)
                    txn.flag.record_stream(torch.cuda.current_stream(self.device))
            return txn.flag

    def commit(self, version: int | None = None, *, checked: bool = False, where: str = "finish_weight_update") -> (
        WeightUpdateReport
    ):  # fmt: skip
        """`check`, then queue the copies into the parameters and the table refresh on the compute stream.

        `version` (> the current one) sets the new version (default current + 1). ``checked=True``: the caller
        read the flag of `check` as True (the broadcast's vote), so the host does not read it again.
        """
        with self.lock:
            txn = self._require(where)
            flag = self.check(where)
            try:
                with torch.cuda.stream(txn.stream):  # the host waits for the staging stream only
                    if not checked and not bool(flag):
                        raise WeightSyncError(
                            f"{where}: non-finite values (NaN/Inf, after casting to the parameter dtype) in "
                            f"{self.nonfinite()[:10]}; expected finite weights. The trainer diverged or a cast "
                            "overflowed; the weights are unchanged."
                        )
                new = self.version + 1 if version is None else int(version)
                if new <= self.version:
                    raise WeightSyncError(
                        f"{where}: version must increase: expected > {self.version}, received {new}; pass a larger "
                        "version or None."
                    )
            except WeightSyncError as err:
                self._end(txn, f"failed: {err}")
                raise
            self._write(txn)
            self.version = new
            self._end(txn, f"committed version {new}")
            names, params = list(txn.received), txn.params
            return WeightUpdateReport(
                new, names, len(names), sum(params[n].numel() * params[n].element_size() for n in names),
                sum(b for _, b in txn.received.values()), txn.skipped, time.perf_counter() - txn.started, txn.mode,
            )  # fmt: skip

    def _write(self, txn: _Transaction) -> None:
        """The in-place copies and the table refresh on the compute stream; poison on a failure midway."""
        names = list(txn.received)
        compute = torch.cuda.current_stream(self.device) if txn.stream is not None else None
        try:
            if compute is not None:
                compute.wait_stream(txn.stream)
                for event in self._readers.values():
                    compute.wait_event(event)  # readers on other streams finish with the old weights first
            with torch.no_grad():
                copy_all([txn.params[n] for n in names], [txn.slots[n] for n in names], non_blocking=False)
                self.refresh(names)
            if compute is not None:
                self._commit_event = torch.cuda.Event()
                self._commit_event.record(compute)
                for arena in txn.arenas.values():
                    arena.record_stream(compute)  # freed once the commit copies ran
        except BaseException as err:
            self._poisoned = f"a commit failed after writing began ({type(err).__name__}: {err})"
            self._end(txn, "commit failed")
            raise WeightSyncError(f"finish_weight_update: the commit failed midway ({type(err).__name__}: {err}); the "
                                  "weights are inconsistent: it refuses to serve until a complete update.") from err
        if self._poisoned is not None and set(names) == set(txn.params):
            self._poisoned = None

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
                return [n for n in txn.received if slots[n].is_floating_point() and not slots[n].isfinite().all()]

    def sync(self, source: WeightSource, expected: str | Sequence[str] = "trainable") -> WeightUpdateReport:
        """One-call update from an `nn.Module`, a state dict or pairs; parameters outside `expected` are skipped."""
        self.begin(expected)  # every failure below ends the update
        self.stage(source, skip_outside=True, where="sync_weights")
        return self.commit(where="sync_weights")

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Wrap every read of the weights (act, value, evaluate); holds the lock.

        The read follows the last commit and the next commit follows the read, on the device (no host sync).
        """
        with self.lock:
            if self._poisoned is not None:
                raise WeightSyncStateError(f"the policy's weights are inconsistent ({self._poisoned}); it refuses to "
                                           "serve until a complete update (begin_weight_update('all')) commits.")
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

    def _require(self, where: str) -> _Transaction:
        if self._txn is not None:
            return self._txn
        if self.closed:
            raise WeightSyncStateError(f"{where}: the policy is closed; no weight update can run.")
        last = f" (the last one {self._last_end})" if self._last_end else ""
        raise WeightSyncStateError(f"{where}: no weight update in progress{last}; call begin_weight_update() first.")

    def _end(self, txn: _Transaction, reason: str) -> None:
        if self._txn is txn:
            self._txn, self._last_end = None, reason if len(reason) < 300 else reason[:297] + "..."
        txn.slots, txn.arenas = {}, {}


def _check_entry(txn: _Transaction, seen: Mapping, name: str, ours: str | None, shape: Any, dtype: Any, where: str) -> (
    str | None
):  # fmt: skip
    """Our name for a source entry, None for a dead key; raises WeightSyncError for anything invalid."""
    if ours is None:
        return None
    param = txn.params.get(ours)
    if param is None:
        raise WeightSyncError(
            f"{where}: {name!r} names no parameter of this model (mapped to {ours!r}); expected our names (e.g. "
            f"{txn.expected[0]!r}) or LeRobot / openpi names. Remove peft/LoRA or wrapper prefixes on the sender."
        )
    if ours not in txn.expected_set:
        raise WeightSyncError(f"{where}: {name!r} is a parameter but not part of this update (expected={txn.mode!r}); "
                              "begin_weight_update(expected='all') or a list that includes it, or do not send it.")
    if ours in seen:
        raise WeightSyncError(
            f"{where}: {ours!r} was already sent in this update (as {seen[ours][0]!r}, now as {name!r}); send every "
            "parameter once per update."
        )
    if tuple(shape) != tuple(param.shape):
        raise WeightSyncError(f"{where}: {name!r}: expected shape {list(param.shape)}, received {list(shape)}; the "
                              "sender's model geometry differs from this policy's config.")

    if param.is_floating_point() and not dtype.is_floating_point:
        raise WeightSyncError(f"{where}: {name!r}: expected a floating-point tensor ({param.dtype}), got {dtype}.")
    return ours


def _resolve_expected(expected: str | Sequence[str], params: dict[str, Any]) -> tuple[list[str], str]:
    """Our names of the expected set, in model order, and the mode label."""
    if expected == "all":
        return list(params), "all"
    if expected == "trainable":
        names = [n for n, p in params.items() if p.requires_grad]
        if not names:
            raise WeightSyncError("begin_weight_update: expected='trainable' but no parameter requires grad; call "
                                  "policy.set_trainable('expert' or 'all') or pass expected='all'.")
        return names, "trainable"
    if isinstance(expected, str):
        raise WeightSyncError(f"begin_weight_update: expected must be 'all', 'trainable' or a list, got {expected!r}.")
    chosen: dict[str, str] = {}
    for name in expected:
        ours = to_internal_name(name) if isinstance(name, str) else None
        if ours is None or ours not in params:
            raise WeightSyncError(f"begin_weight_update: expected names a non-parameter {name!r}; list parameter "
                                  "names (ours or LeRobot / openpi).")
        if ours in chosen:
            raise WeightSyncError(f"begin_weight_update: expected lists {ours!r} twice ({chosen[ours]!r}, {name!r}).")
        chosen[ours] = name
    if not chosen:
        raise WeightSyncError("begin_weight_update: expected is an empty list; name at least one parameter.")
    return [n for n in params if n in chosen], "list"


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool) -> None:
    """dst.copy_(src) for every pair: one `_foreach_copy_` per (device, dtype) combination of the pairs."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dsts, srcs):
        group = groups.setdefault((d.device, d.dtype, s.device, s.dtype), ([], []))
        group[0].append(d)
        group[1].append(s)
    for gd, gs in groups.values():
        torch._foreach_copy_(gd, gs, non_blocking=non_blocking)


def materialize(value: Any, name: str, where: str) -> torch.Tensor:
    """A plain tensor; DTensors (FSDP2 trainers) are materialised with `.full_tensor()` (a mesh collective)."""
    value = value.full_tensor() if hasattr(value, "full_tensor") and not isinstance(value, torch.Tensor) else value
    if not isinstance(value, torch.Tensor):
        raise WeightSyncError(
            f"{where}: the value for {name!r} is a {type(value).__name__}, expected a torch.Tensor (or a DTensor); "
            "pass (name, tensor) pairs."
        )
    return value


def source_pairs(source: WeightSource, where: str, trainable_only: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, value) pairs of a module (wrapper prefixes removed), a mapping, or an iterable of pairs.

    LeRobot's tied `lm_head` copy of the token embedding is left out when both are there (they are one tensor);
    `trainable_only` keeps a module's `requires_grad` parameters. Values are not materialised yet.
    """
    if isinstance(source, torch.nn.Module):
        for name, param in source.named_parameters():
            if param.requires_grad or not trainable_only:
                for segment in _WRAPPER_SEGMENTS:
                    name = name.replace(segment, "")
                yield name.removeprefix("module."), param
        return
    if isinstance(source, (str, bytes, torch.Tensor)) or not isinstance(source, (Mapping, Iterable)):
        raise WeightSyncError(f"{where}: expected a mapping name -> tensor or an iterable of (name, tensor) pairs, got "
                              f"{type(source).__name__}.")
    tied = isinstance(source, Mapping) and sum(to_internal_name(k) == "llm.embed_tokens.weight" for k in source) > 1
    for item in source.items() if isinstance(source, Mapping) else source:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise WeightSyncError(
                f"{where}: expected (name, tensor) pairs, got an item of type {type(item).__name__}; pass a "
                "mapping or e.g. model.named_parameters()."
            )
        if not (tied and item[0].removeprefix("model.") == TIED_EMBEDDING):
            yield item[0], item[1]
