from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from policies.pi05.normalize import (
    Normalizer,
    NormStats,
    load_norm_stats,
    save_norm_stats,
)

STATS = NormStats(
    mean=np.array([0.5, -1.0, 2.0, 0.0]),
    std=np.array([2.0, 0.5, 1.0, 0.0]),
    q01=np.array([-1.0, 0.0, 1.0, 3.0]),
    q99=np.array([1.0, 4.0, 1.5, 3.0]),  # last dim: q99 == q01
    min=np.array([-2.0, -1.0, 0.5, 3.0]),
    max=np.array([2.0, 5.0, 2.0, 3.0]),  # last dim: max == min
    q10=np.array([-0.5, 1.0, 1.1, 3.0]),
    q90=np.array([0.5, 3.0, 1.4, 3.0]),
)
PAIRS = {"quantile": ("q01", "q99"), "quantile10": ("q10", "q90"), "min_max": ("min", "max")}
X = torch.tensor([[0.3, 2.0, 1.2, 3.0], [-2.0, 5.0, 0.0, 4.0]], dtype=torch.float32)


def _reference(x, rule, mode, inverse):
    x = x.double().numpy()
    s = STATS
    if mode in PAIRS:
        lo, hi = (getattr(s, k) for k in PAIRS[mode])
        if rule == "lerobot":
            d = np.where(hi - lo == 0, 1e-8, hi - lo)
            return (x + 1.0) * d / 2.0 + lo if inverse else 2.0 * (x - lo) / d - 1.0
        eps = 1e-6 if rule == "openpi" else 1e-8
        return (x + 1) / 2 * (hi - lo + eps) + lo if inverse else (x - lo) / (hi - lo + eps) * 2 - 1
    eps = 1e-6 if rule == "openpi" else 1e-8
    if inverse:
        return x * s.std + s.mean if rule == "lerobot" else x * (s.std + eps) + s.mean
    return (x - s.mean) / (s.std + eps)


@pytest.mark.parametrize("rule", ["openpi", "lerobot", "phyai"])
@pytest.mark.parametrize("mode", ["quantile", "quantile10", "min_max", "mean_std"])
def test_formulas_and_round_trip(rule, mode):
    norm = Normalizer(STATS, mode, rule)
    y = norm.normalize(X)
    assert y.dtype == torch.float32
    np.testing.assert_allclose(y.numpy(), _reference(X, rule, mode, False), rtol=1e-6, atol=1e-6)
    z = norm.unnormalize(y)
    np.testing.assert_allclose(z.numpy(), _reference(y, rule, mode, True), rtol=1e-6, atol=1e-5)
    ok = slice(0, 3)  # the degenerate last dim (q99 == q01 / std == 0) does not round-trip for every rule
    np.testing.assert_allclose(z[:, ok].numpy(), X[:, ok].numpy(), rtol=1e-5, atol=1e-5)


def test_epsilon_rules_differ_where_expected():
    q = {r: Normalizer(STATS, "quantile", r).normalize(X) for r in ("openpi", "lerobot", "phyai")}
    assert torch.isfinite(q["lerobot"]).all()
    # lerobot adds epsilon only where q99 == q01: exact elsewhere
    q01 = torch.tensor(STATS.q01[:3], dtype=torch.float32)
    d = torch.tensor(STATS.q99[:3], dtype=torch.float32) - q01
    assert torch.equal(q["lerobot"][:, :3], 2.0 * (X[:, :3] - q01) / d - 1.0)
    assert not torch.equal(q["openpi"], q["phyai"])


def test_openpi_rule_computes_in_float64():
    norm = Normalizer(STATS, "quantile", "openpi")
    y64 = norm.normalize(X, out_dtype=None)
    assert y64.dtype == torch.float64
    np.testing.assert_array_equal(y64.numpy(), _reference(X, "openpi", "quantile", False))


def test_short_and_long_stats_follow_openpi():
    short = NormStats(q01=np.array([0.0, 0.0]), q99=np.array([2.0, 4.0]))
    norm = Normalizer(short, "quantile", "phyai")
    x = torch.tensor([[1.0, 2.0, 7.0, -3.0]])
    y = norm.normalize(x)
    assert torch.allclose(y[:, :2], torch.tensor([[0.0, 0.0]]), atol=1e-6)
    assert torch.equal(y[:, 2:], x[:, 2:])
    assert torch.equal(norm.unnormalize(y)[:, 2:], x[:, 2:])
    y1 = norm.normalize(x[:, :1])  # stats longer than the vector: cut
    assert y1.shape == (1, 1) and abs(y1.item()) < 1e-6


def test_identity_and_missing_stats():
    assert torch.equal(Normalizer(STATS, "identity").normalize(X), X)
    assert torch.equal(Normalizer(None, "quantile").unnormalize(X), X)
    with pytest.raises(ValueError, match=r"lack \['q01', 'q99'\]"):
        Normalizer(NormStats(mean=np.zeros(2), std=np.ones(2)), "quantile")
    with pytest.raises(ValueError, match="eps_rule: expected one of"):
        Normalizer(STATS, "quantile", "numpy")
    with pytest.raises(ValueError, match="of one length"):
        NormStats(mean=np.zeros(2), std=np.ones(3))


def test_openpi_files(tmp_path):
    payload = {
        "norm_stats": {"state": STATS.to_dict(), "actions": {"q01": [0.0], "q99": [1.0], "mean": [0], "std": [1]}}
    }
    (tmp_path / "assets" / "physical-intelligence" / "libero").mkdir(parents=True)
    (tmp_path / "assets" / "physical-intelligence" / "libero" / "norm_stats.json").write_text(json.dumps(payload))
    stats = load_norm_stats(tmp_path)
    assert stats["state"] == STATS and stats["actions"].width == 1
    (tmp_path / "assets" / "droid").mkdir()
    (tmp_path / "assets" / "droid" / "norm_stats.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="pass asset_id"):
        load_norm_stats(tmp_path)
    assert load_norm_stats(tmp_path, asset_id="droid")["state"] == STATS
    out = tmp_path / "saved"
    out.mkdir()
    save_norm_stats(out, stats)
    assert load_norm_stats(out) == stats


def test_lerobot_files(tmp_path):
    tensors = {f"observation.state.{k}": np.asarray(v, np.float32) for k, v in STATS.to_dict().items()}
    tensors.update({"action.q01": np.zeros(3, np.float32), "action.q99": np.ones(3, np.float32)})
    save_file(tensors, str(tmp_path / "policy_preprocessor_step_2_normalizer_processor.safetensors"))
    steps = [
        {"registry_name": "rename_observations_processor", "config": {}},
        {
            "registry_name": "normalizer_processor",
            "config": {
                "eps": 1e-8,
                "features": {"observation.state": {"type": "STATE", "shape": [4]}},
                "norm_map": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
            },
            "state_file": "policy_preprocessor_step_2_normalizer_processor.safetensors",
        },
    ]
    (tmp_path / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": steps}))
    stats = load_norm_stats(tmp_path)
    np.testing.assert_allclose(stats["state"].q99, STATS.q99)
    assert stats["actions"].width == 3 and stats["actions"].mean is None
    assert load_norm_stats(tmp_path / "nothing_here_does_not_exist") == {}


def test_stats_of_a_dataset_map_its_1st_to_99th_percentile_onto_minus_one_to_one():
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(1000, 2))
    stats = NormStats.of(x)
    np.testing.assert_allclose(stats.mean, x.mean(0))
    np.testing.assert_allclose(stats.q99, np.quantile(x, 0.99, axis=0))
    y = Normalizer(stats, "quantile", "phyai").normalize(torch.as_tensor(x, dtype=torch.float32))
    assert ((y >= -1) & (y <= 1)).float().mean() == pytest.approx(0.98, abs=0.005)
    with pytest.raises(ValueError, match=r"NormStats.of: values: expected a \(rows, dims\) array"):
        NormStats.of(np.zeros(5))
