"""Disaggregated PPO on CPU/gloo: 1 trainer + 2 rollout ranks commit one version everywhere, or abort everywhere.

Each test spawns three processes (the "spawn" context) with torchrun's environment variables and runs the example's
`train()` in each; every rank writes its result as JSON, the parent asserts on them.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(num_envs=4, num_steps=2, update_epochs=1, num_minibatches=2, denoise_steps=2, digest_weights=True,
             quiet=True, timeout_s=120.0)  # fmt: skip


def _example() -> dict[str, Any]:
    """The example's namespace (runpy registers the module while it runs, as dataclasses need)."""
    return runpy.run_path(str(ROOT / "examples" / "ppo_disaggregated.py"), run_name="ppo_disaggregated")


def _worker(rank: int, world: int, port: int, options: dict[str, Any], tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))  # fmt: skip
    try:
        example = _example()
        result = example["train"](example["Args"](**options))
    except BaseException:  # report instead of hanging the parent on a bare exit code
        result = {"crash": traceback.format_exc()}
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))


def run(tmp_path: Path, world: int = 3, **options: Any) -> list[dict[str, Any]]:
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, {**SMALL, **options}, str(tmp_path)), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return results


ABORTED = ("broadcast_weights: aborted on every rank; rank 1 failed while sending, receiving or validating. Every "
           "rank keeps its weights and version.")


def column(result: dict[str, Any], key: str) -> list[Any]:
    return [row[key] for row in result["rows"]]


@pytest.mark.parametrize("group_size", [1, 2], ids=["gae", "groups"])
def test_every_rank_commits_the_same_version_and_weights(tmp_path: Path, group_size: int) -> None:
    results = run(tmp_path, total_iterations=2, overlap=True, group_size=group_size)
    assert [res["role"] for res in results] == ["trainer", "rollout", "rollout"]
    for res in results:
        assert res["aborted"] is None and res["weight_version"] == 3  # v1 at the start, one commit per iteration
        assert column(res, "weight_version") == [2, 3] and column(res, "aborted") == [False] * 2
    digests = [column(res, "weight_digest") for res in results]
    assert digests[0] == digests[1] == digests[2]  # bit-identical trainable weights on every rank, every iteration
    assert len(set(digests[0])) == 2  # and every update changed them
    trainer = results[0]
    assert abs(trainer["rows"][0]["approx_kl_first"]) < 1e-6  # the sent batch re-evaluates to its own log-probs
    assert column(trainer, "policy_lag") == [0, 1]  # --overlap: batch k+1 was collected before commit k
    assert column(trainer, "samples") == [16, 16]  # 2 rollout ranks x 4 envs x 2 steps


def test_two_trainers_average_gradients_and_stay_identical(tmp_path: Path) -> None:
    results = run(tmp_path, world=4, trainer_ranks=2, total_iterations=1)
    assert [res["role"] for res in results] == ["trainer", "trainer", "rollout", "rollout"]
    digests = [column(res, "weight_digest") for res in results]
    assert all(res["weight_version"] == 2 for res in results) and all(d == digests[0] for d in digests)
    # before the broadcast, too: each trainer stepped its own batch with the averaged gradients
    assert column(results[0], "update_digest") == column(results[1], "update_digest") == digests[0]
    assert column(results[1], "samples") == [8]  # trainer 1 trains rollout rank 3's batch only


def test_a_nan_on_the_trainer_aborts_every_rank_and_the_run_stops(tmp_path: Path, capfd) -> None:
    results = run(tmp_path, total_iterations=3, overlap=False, inject_nan_iteration=2)
    for res in results:
        assert res["weight_version"] == 2  # iteration 1 committed v2; iteration 2's v3 committed nowhere
        assert column(res, "weight_version") == [2, 2] and column(res, "aborted") == [False, True]  # then it stops
        assert res["aborted"].startswith(ABORTED)
    for res in results[1:]:  # rollout ranks: the finiteness check failed there
        assert "non-finite values (NaN/Inf, after casting to the parameter dtype)" in res["aborted"]
    before, after = (column(results[1], "weight_digest")[i] for i in (0, 1))
    assert before == after == column(results[2], "weight_digest")[1] == column(results[0], "weight_digest")[0]
    assert column(results[0], "policy_lag") == [0, 0]  # --no-overlap: on-policy
    assert "rank 2 (rollout): weight sync aborted on every rank; stopping at version 2" in capfd.readouterr().out


def test_group_mode_starts_every_collection_from_fresh_grouped_states_and_centres_each_group() -> None:
    example = _example()
    args = example["Args"](num_envs=4, num_steps=2, group_size=2, seed=3, denoise_steps=2, quiet=True)
    policy, device, _ = example["_setup"](args, rank=1, trainer=False)
    envs = example["PolicyVectorEnv"](example["make_env"]("target", 4, num_targets=2, episode_length=1), policy)
    resets, real = [], envs.reset
    envs.reset = lambda **kwargs: resets.append(kwargs) or real(**kwargs)
    collector = example["Collector"](envs, args, device, seed=99, rank=1, ranks=2)  # the second of 2 rollout ranks
    _, first = collector.collect()
    collector.collect()
    envs.close()
    assert [r["seed"] for r in resets] == [[5, 5, 6, 6], [13, 13, 14, 14]]  # envs 4-7 of 8, then of the next 8
    assert [r["options"]["stream_seeds"] for r in resets] == [[7, 8, 9, 10], [15, 16, 17, 18]]
    advantages = first["advantages"].reshape(2, 4)  # (T, N): one-step episodes, each group split 1:1 at this seed
    assert advantages[0].abs().tolist() == pytest.approx([0.7071] * 4, abs=1e-3) and advantages[1].abs().sum() == 0
    assert advantages[0].reshape(2, 2).sum(dim=1).tolist() == pytest.approx([0.0, 0.0], abs=1e-6)  # centred per group
    with pytest.raises(ValueError, match=r"--group-size: expected G >= 1 dividing --num-envs 4, got 3"):
        example["Args"](num_envs=4, group_size=3)


def test_a_layout_that_does_not_split_and_a_device_index_are_refused() -> None:
    example = _example()
    with pytest.raises(ValueError) as err:
        example["Layout"].of(world_size=3, rank=0, trainer_ranks=2)
    assert str(err.value) == (
        "trainer_ranks: expected T >= 1 with the other 3 - T ranks a positive multiple of T, got T=2 of 3 ranks. "
        "Fix: torchrun --nproc_per_node T+R with R a multiple of T (e.g. --trainer-ranks 1 with 3 ranks)."
    )
    with pytest.raises(ValueError) as err:
        example["Args"](device="cuda:1")
    assert str(err.value) == (
        "device: expected 'cpu' (gloo) or 'cuda' (NCCL, one GPU per rank: cuda:LOCAL_RANK), got 'cuda:1'; pass "
        "--device cpu, or --device cuda on a machine with a GPU per rank."
    )
