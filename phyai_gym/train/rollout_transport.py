"""Rollout batches between processes: `send_rollout` / `recv_rollout` over `torch.distributed`, tensors only.

A disaggregated PPO run (`examples/ppo_disaggregated.py`) collects samples on rollout ranks and trains on
trainer ranks; this module carries one `RolloutBatch` (plus named extra tensors such as advantages and returns)
from one rank to another with point-to-point `send`/`recv`. Nothing is pickled, so it runs on gloo and NCCL:

1. Header int64[4]: magic, protocol, manifest length (int64 words), number of tensors.
2. Manifest int64[2 + ...]: the shape dims and name bytes, then the weight broadcast's manifest of every tensor
   (`policies.pi05.broadcast.encode_manifest`: names, dtypes, shapes). A batch field that is None is not listed.
3. Every non-empty tensor as its raw bytes (a uint8 view), in manifest order: the receiver gets it bit for bit.
   Besides the batch's tensors and the extras they are the batch header (`RolloutConfig` as UTF-8 JSON in a
   uint8 tensor) and the camera slots.

Every `send_rollout` must be matched by one `recv_rollout` on the peer, in program order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any

import torch
import torch.distributed as dist

from policies.base import RolloutConfig
from policies.pi05.batch import RolloutBatch, StoredPrefix
from policies.pi05.broadcast import WIRE_DTYPES, decode_manifest, encode_manifest
from policies.pi05.inputs import ModelInputs

_MAGIC, _PROTOCOL = 0x524F_4C4C, 2  # "ROLL", this layout
_BATCH_FIELDS = ("inputs.images", "inputs.image_mask", "inputs.tokens", "inputs.lengths", "inputs.state", "chains",
                 "denoise_inds", "log_prob", "values", "prefix.kv", "prefix.key_mask", "prefix.pooled")  # fmt: skip
"""The batch's tensors, in wire order; extras follow as ``extra.<name>``."""


class TransportError(RuntimeError):
    """A rollout message could not be sent or received (a peer speaking another protocol, a failed collective)."""


def send_rollout(
    batch: RolloutBatch,
    dst: int,
    *,
    extras: Mapping[str, torch.Tensor] | None = None,
    group: Any = None,
    device: str | torch.device | None = None,
) -> int:
    """Send `batch` and `extras` to global rank `dst`; returns the payload bytes.

    Args:
        batch: the samples (e.g. ``RolloutBatch.cat`` of a rollout's calls), kept prefix K/V included.
        dst: the receiving global rank (not this one).
        extras: named tensors that travel with the batch (rewards, advantages, returns, episode statistics...).
        group: process group (default: the world).
        device: communication buffers' device (default: CPU under gloo, the current GPU under NCCL).

    Example:
        >>> send_rollout(batch, dst=0, extras={"advantages": adv, "returns": ret})  # doctest: +SKIP
        >>> batch, extras = recv_rollout(src=1)                                     # on rank 0  # doctest: +SKIP
    """
    if not isinstance(batch, RolloutBatch):
        raise TypeError(f"send_rollout: batch: expected a RolloutBatch, got {type(batch).__name__}; pass "
                        "RolloutBatch.cat([RolloutBatch.from_output(out) for out in outputs]).")  # fmt: skip
    _check_peer("send_rollout", "dst", dst)
    entries = _flatten(batch, extras)
    specs = [(name, tuple(t.shape), t.dtype) for name, t in entries]
    wire, name_bytes = encode_manifest(specs)
    dims = sum(len(shape) for _, shape, _ in specs)
    manifest = torch.cat([torch.tensor([dims, name_bytes], dtype=torch.int64), wire])
    dev = _comm_device(group, device)
    header = torch.tensor([_MAGIC, _PROTOCOL, manifest.numel(), len(entries)], dtype=torch.int64)
    payload = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in entries]
    payload = [b.to(dev) for b in payload if b.numel()]
    try:
        dist.send(header.to(dev), dst, group=group)
        dist.send(manifest.to(dev), dst, group=group)
        works = [dist.isend(b, dst, group=group) for b in payload]
        for work in works:
            work.wait()
    except Exception as err:
        raise TransportError(f"send_rollout: sending to rank {dst} failed ({type(err).__name__}: {err}); the "
                             "receiver died or the process group timed out.") from err  # fmt: skip
    return sum(b.numel() for b in payload)


def recv_rollout(
    src: int, *, group: Any = None, device: str | torch.device = "cpu", comm_device: str | torch.device | None = None
) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    """Receive what `send_rollout` on global rank `src` sent: (batch, extras), the tensors on `device`.

    Args:
        src: the sending global rank (not this one).
        group: process group (default: the world).
        device: where the received tensors go (the trainer's device).
        comm_device: communication buffers' device (default: CPU under gloo, the current GPU under NCCL).

    Raises:
        TransportError: the peer speaks another protocol, or a receive failed (the sender died, a timeout).
    """
    _check_peer("recv_rollout", "src", src)
    dev = _comm_device(group, comm_device)
    try:
        header = torch.zeros(4, dtype=torch.int64, device=dev)
        dist.recv(header, src, group=group)
        magic, protocol, words, count = header.tolist()
        if (magic, protocol) != (_MAGIC, _PROTOCOL):
            raise TransportError(f"recv_rollout: rank {src} sent magic {magic:#x} protocol {protocol}, expected "
                                 f"{_MAGIC:#x} protocol {_PROTOCOL}; run the same phyai-gym version on every rank and "
                                 "match every send_rollout with one recv_rollout.")  # fmt: skip
        manifest = torch.zeros(words, dtype=torch.int64, device=dev)
        dist.recv(manifest, src, group=group)
        dims, name_bytes = manifest[:2].tolist()
        specs = decode_manifest(manifest[2:].cpu(), count, dims, name_bytes)
        buffers = {name: torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=dev)
                   for name, shape, dtype in specs}  # fmt: skip
        works = [dist.irecv(b, src, group=group) for b in buffers.values() if b.numel()]
        for work in works:
            work.wait()
    except TransportError:
        raise
    except Exception as err:
        raise TransportError(f"recv_rollout: receiving from rank {src} failed ({type(err).__name__}: {err}); the "
                             "sender died or the process group timed out.") from err  # fmt: skip
    tensors = {name: buffers[name].view(dtype).reshape(shape) for name, shape, dtype in specs}
    header_config = _header(tensors.pop("header"), src)
    slots = tuple(tensors.pop("inputs.slots").tolist())
    return _unflatten({name: t.to(device) for name, t in tensors.items()}, header_config, slots)


def _check_peer(where: str, argument: str, rank: Any) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dist.get_world_size():
        raise ValueError(f"{where}: {argument}: expected a global rank in 0..{dist.get_world_size() - 1}, got "
                         f"{rank!r}; pass the peer's rank.")  # fmt: skip
    if rank == dist.get_rank():
        raise ValueError(f"{where}: {argument}: expected another rank than this one ({rank}); point-to-point needs "
                         "two processes.")  # fmt: skip


def _flatten(batch: RolloutBatch, extras: Mapping[str, torch.Tensor] | None) -> list[tuple[str, torch.Tensor]]:
    """The message's tensors: the header, the camera slots, the batch's tensors that are not None, the extras."""
    x, p = batch.inputs, batch.prefix
    kept = (None, None, None) if p is None else (p.kv, p.key_mask, p.pooled)
    values = [x.images, x.image_mask, x.tokens, x.lengths, x.state, batch.chains, batch.denoise_inds, batch.log_prob,
              batch.values, *kept]  # fmt: skip
    header = torch.frombuffer(bytearray(json.dumps(asdict(batch.header)).encode()), dtype=torch.uint8)
    entries = [("header", header), ("inputs.slots", torch.tensor(x.slots, dtype=torch.int64))]
    entries += [(name, t) for name, t in zip(_BATCH_FIELDS, values) if t is not None]
    for name, tensor in (extras or {}).items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"send_rollout: extras: expected non-empty string keys, got {name!r}.")
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in WIRE_DTYPES:
            what = f"{type(tensor).__name__} {getattr(tensor, 'dtype', '')}".strip()
            raise TypeError(f"send_rollout: extras[{name!r}]: expected a tensor of one of {list(WIRE_DTYPES)}, got "
                            f"{what}; convert it, e.g. torch.as_tensor(value, dtype=torch.float32).")  # fmt: skip
        entries.append((f"extra.{name}", tensor))
    return entries


def _unflatten(
    t: dict[str, torch.Tensor], header: RolloutConfig, slots: tuple[int, ...]
) -> tuple[RolloutBatch, dict[str, torch.Tensor]]:
    t = {**dict.fromkeys(_BATCH_FIELDS), **t}  # the fields not sent were None
    inputs = ModelInputs(t["inputs.images"], t["inputs.image_mask"], slots, t["inputs.tokens"], t["inputs.lengths"],
                         t["inputs.state"])  # fmt: skip
    prefix = None if t["prefix.kv"] is None else StoredPrefix(t["prefix.kv"], t["prefix.key_mask"], t["prefix.pooled"])
    batch = RolloutBatch(inputs, t["chains"], t["denoise_inds"], t["log_prob"], t["values"], header, prefix)
    extras = {name.removeprefix("extra."): v for name, v in t.items() if name.startswith("extra.")}
    return batch, extras


def _header(data: torch.Tensor, src: int) -> RolloutConfig:
    """The sender's `RolloutConfig` from its JSON bytes, refused when its fields are not this version's."""
    kwargs = json.loads(data.cpu().numpy().tobytes().decode())
    ours = {f.name for f in fields(RolloutConfig)}
    if set(kwargs) != ours:
        raise TransportError(f"recv_rollout: rank {src}'s RolloutConfig has fields {sorted(kwargs)}, this rank's "
                             f"{sorted(ours)}; run the same phyai-gym version on every rank.")  # fmt: skip
    return RolloutConfig(**kwargs)


def _comm_device(group: Any, device: Any) -> torch.device:
    if device is not None:
        return torch.device(device)
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
