"""The shared refusal phrasing: argument, expected, got, fix -- and checks that refuse instead of casting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from policies.checks import bad_input, check_float, check_int, describe, integer_tensor, seed_tensor


def test_message_reads_argument_expected_got_fix() -> None:
    assert bad_input("seeds", "an int", 1.5, "pass integers") == "seeds: expected an int, got 1.5. Fix: pass integers."
    assert bad_input("x", "a list", "3 items", raw=True) == "x: expected a list, got 3 items."
    assert describe(torch.zeros(2, 3)) == "Tensor of shape (2, 3) and dtype float32"
    assert describe(torch.Generator()) == "a Generator"


@pytest.mark.parametrize(("value", "exc"), [(True, TypeError), (2.0, TypeError), ("3", TypeError), (0, ValueError)])
def test_check_int_refuses_what_int_would_cast(value, exc) -> None:
    with pytest.raises(exc, match=r"^n: expected an integer >= 1, got "):
        check_int("n", value, 1)
    assert check_int("n", np.int64(3), 1) == 3


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_check_float_refuses_non_finite_and_out_of_range(value) -> None:
    with pytest.raises(ValueError, match=r"^a: expected a finite number >= 0.0"):
        check_float("a", value, 0.0)


def test_seed_tensor_accepts_integers_only() -> None:
    assert seed_tensor(5, 3).tolist() == [5, 6, 7]
    assert seed_tensor(np.int32(5), 2).tolist() == [5, 6]
    assert seed_tensor(torch.tensor(4), 2).tolist() == [4, 5]
    assert seed_tensor(np.array([3, 1], np.uint8), 2).dtype == torch.int64
    for bad in (1.5, [1, 2.0], np.array([1.0, 2.0]), torch.Generator(), None, True):
        with pytest.raises(TypeError, match="seeds"):
            seed_tensor(bad, 2)
    with pytest.raises(ValueError, match=r"seeds: expected an int or 2 seeds .* got shape \(3,\)"):
        seed_tensor([1, 2, 3], 2)
    with pytest.raises(ValueError, match="within int64"):
        seed_tensor(2**63 - 1, 2)  # the second row's seed would overflow


def test_integer_tensor_keeps_the_device_and_refuses_floats() -> None:
    ids = torch.tensor([2, 0])
    assert integer_tensor(ids, 2, "env_ids").device == ids.device
    with pytest.raises(TypeError, match=r"env_ids: expected 2 integers"):
        integer_tensor(torch.tensor([0.0, 1.0]), 2, "env_ids")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_check_device_on_a_gpu_machine() -> None:
    """With CUDA, 'cuda' passes and an index past the visible GPUs is refused naming the range."""
    from policies.checks import check_device

    assert check_device("cuda").type == "cuda"
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"device: expected cuda:0..cuda:{count - 1} \({count} GPUs visible\)"):
        check_device(f"cuda:{count}")


def test_check_device_without_cuda_names_the_fix() -> None:
    from policies.checks import check_device

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    expected = r"--device: expected a device this machine has, got 'cuda'\. Fix: pass --device cpu"
    with pytest.raises(ValueError, match=expected):
        check_device("cuda", "--device")
