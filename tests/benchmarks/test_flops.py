"""Pins benchmarks/flops.py to the figures of DESIGN C8."""

import importlib.util
from pathlib import Path

import pytest

from policies.pi05.config import Pi05Config

_spec = importlib.util.spec_from_file_location("flops", Path(__file__).parents[2] / "benchmarks" / "flops.py")
flops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(flops)


@pytest.mark.parametrize(
    ("case", "tflop"), [("3cam_200tok_K10_H50", 4.80), ("libero_rl_2cam_48tok_K5_H10", 2.62)]
)
def test_reference_cases(case, tflop):
    total = flops.pi05_flops(Pi05Config.pi05_base(), **flops.REFERENCE_CASES[case])["total"]
    assert round(total / 1e12, 2) == tflop


def test_prefix_value_adds_about_4_5_percent():
    cfg = Pi05Config.pi05_base()
    case = flops.REFERENCE_CASES["3cam_200tok_K10_H50"]
    base = flops.pi05_flops(cfg, **case)["total"]
    with_value = flops.pi05_flops(cfg, **{**case, "value_source": "prefix"})["total"]
    assert 0.04 < with_value / base - 1 < 0.05


def test_unused_camera_slots_cost_nothing():
    cfg = Pi05Config.pi05_base()
    two = flops.pi05_flops(cfg, num_cameras=2, prompt_len=48, num_steps=5, horizon=10)
    three = flops.pi05_flops(cfg, num_cameras=3, prompt_len=48, num_steps=5, horizon=10)
    assert two["vision"] == pytest.approx(three["vision"] * 2 / 3)
