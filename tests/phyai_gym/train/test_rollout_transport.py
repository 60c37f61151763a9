"""send_rollout / recv_rollout over gloo: what arrives equals what was sent, bit for bit.

Two spawned ranks build the same batches from the same seeds; rank 1 sends, rank 0 receives and compares the
bytes of every tensor (NaN payloads included) and the header. Results come back as one JSON file per rank.
"""

from __future__ import annotations

import datetime
import json
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from phyai_gym.make import make_env, make_policy
from phyai_gym.train.rollout_transport import TransportError, recv_rollout, send_rollout
from policies.base import RolloutConfig
from policies.pi05.batch import RolloutBatch, StoredPrefix


def acted_batch() -> RolloutBatch:
    """Two act() calls of a tiny policy that keeps its prefix K/V, concatenated (as a rollout stores them)."""
    rollout = RolloutConfig(method="sde", num_steps=2, joint=True, noise_level=0.7, action_chunk=1, keep_prefix=True)
    policy = make_policy(action_dim=1, seed=3, rollout=rollout, max_batch_size=3, prompt_format="state")
    env = make_env("target", 3)
    obs, _ = env.reset(seed=0)
    outputs = [policy.act(obs), policy.act(obs)]
    return RolloutBatch.cat([RolloutBatch.from_output(out) for out in outputs])


def odd_batch(base: RolloutBatch) -> RolloutBatch:
    """bf16 prefix K/V with a NaN payload, a state tensor, no pooled prefix; a non-default header."""
    kv = base.prefix.kv.to(torch.bfloat16)
    kv.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0])
    inputs = replace(base.inputs, state=torch.arange(12, dtype=torch.float32).reshape(6, 2))
    header = replace(base.header, method="noise", noise_level=0.1 + 0.2, weight_version=7, value_source="prefix")
    return replace(base, inputs=inputs, header=header, prefix=StoredPrefix(kv, base.prefix.key_mask, None))


def extras() -> dict[str, torch.Tensor]:
    return {"advantages": torch.linspace(-1, 1, 6), "returns": torch.full((6,), float("nan")),
            "episode_success": torch.zeros(0, dtype=torch.bool), "iteration": torch.tensor(3)}  # fmt: skip


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))


def batch_equal(a: RolloutBatch, b: RolloutBatch) -> dict[str, bool]:
    x, y = a.inputs, b.inputs
    out = {name: same_bytes(getattr(x, name), getattr(y, name)) for name in ("images", "image_mask", "tokens",
                                                                          "lengths", "state")}  # fmt: skip
    out.update({name: same_bytes(getattr(a, name), getattr(b, name)) for name in ("chains", "denoise_inds",
                                                                                "log_prob", "values")})  # fmt: skip
    out["slots"], out["header"] = x.slots == y.slots, a.header == b.header
    out["prefix_none"] = (a.prefix is None) == (b.prefix is None)
    if a.prefix is not None and b.prefix is not None:
        for name in ("kv", "key_mask", "pooled"):
            out[f"prefix.{name}"] = same_bytes(getattr(a.prefix, name), getattr(b.prefix, name))
    return out


def scenario(rank: int) -> dict[str, Any]:
    acted = acted_batch()
    batches = [acted, odd_batch(acted), replace(acted, prefix=None)]
    if rank == 1:
        sent = [send_rollout(batch, 0, extras=extras() if i == 1 else None) for i, batch in enumerate(batches)]
        dist.send(torch.tensor([0x5049_3035, 6, 0, 0]), 0)  # a weight-broadcast header where a batch is expected
        return {"bytes": sent}
    out: dict[str, Any] = {"kept_prefix": acted.prefix is not None and acted.prefix.pooled is not None}
    for i, batch in enumerate(batches):
        got, got_extras = recv_rollout(1)
        out[f"batch{i}"] = batch_equal(batch, got)
        out[f"extras{i}"] = {k: same_bytes(v, got_extras.get(k)) for k, v in (extras() if i == 1 else {}).items()}
        out[f"extra_names{i}"] = sorted(got_extras)
    errors = {}
    for key, call in {
        "protocol": lambda: recv_rollout(1),
        "self": lambda: send_rollout(acted, 0),
        "range": lambda: recv_rollout(5),
        "batch": lambda: send_rollout({"chains": acted.chains}, 1),  # type: ignore[arg-type]
        "extra": lambda: send_rollout(acted, 1, extras={"returns": [1.0, 2.0]}),  # type: ignore[dict-item]
    }.items():
        try:
            call()
            errors[key] = "no error"
        except (ValueError, TypeError, TransportError) as err:
            errors[key] = f"{type(err).__name__}: {err}"
    out["errors"] = errors
    return out


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        result = scenario(rank)
    except BaseException:  # report instead of hanging the parent on a bare exit code
        result = {"crash": traceback.format_exc()}
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_round_trip_is_bit_identical_and_bad_input_is_refused(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    got = results[0]
    assert got["kept_prefix"]
    for i in range(3):
        assert got[f"batch{i}"] and all(got[f"batch{i}"].values()), (i, got[f"batch{i}"])
    assert "prefix.kv" in got["batch1"] and "prefix.kv" not in got["batch2"]
    assert got["extras1"] == dict.fromkeys(["advantages", "returns", "episode_success", "iteration"], True)
    assert got["extra_names0"] == got["extra_names2"] == []
    assert results[1]["bytes"][0] > results[1]["bytes"][2] > 0  # the kept prefix K/V travelled
    errors = got["errors"]
    assert errors["protocol"] == ("TransportError: recv_rollout: rank 1 sent magic 0x50493035 protocol 6, expected "
                                  "0x524f4c4c protocol 2; run the same phyai-gym version on every rank and match every "
                                  "send_rollout with one recv_rollout.")  # fmt: skip
    assert errors["self"] == ("ValueError: send_rollout: dst: expected another rank than this one (0); "
                              "point-to-point needs two processes.")  # fmt: skip
    assert errors["range"] == ("ValueError: recv_rollout: src: expected a global rank in 0..1, got 5; "
                               "pass the peer's rank.")
    assert errors["batch"].startswith("TypeError: send_rollout: batch: expected a RolloutBatch, got dict; pass")
    assert errors["extra"].startswith("TypeError: send_rollout: extras['returns']: expected a tensor of one of [")
    assert errors["extra"].endswith("got list; convert it, e.g. torch.as_tensor(value, dtype=torch.float32).")
