"""One way to refuse bad input: the message names the argument, what was expected, what came, and the fix.

Every check raises before anything changes, so a refused call or config leaves no trace. The checks are
small on purpose: configs call them from ``__post_init__``, public methods at their first line.

Example:
    >>> print(bad_input("RolloutConfig.noise_level", ">= 0", -0.5, "pass the SDE noise level a, e.g. 0.5"))
    RolloutConfig.noise_level: expected >= 0, got -0.5. Fix: pass the SDE noise level a, e.g. 0.5.
    >>> check_int("SchedulerConfig.max_batch_size", 8, minimum=1)
    8
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch


def describe(value: Any) -> str:
    """How a received value reads in a message: repr for scalars/strings, type and shape for arrays."""
    if isinstance(value, torch.Tensor | np.ndarray):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {dtype}"
    if isinstance(value, bool | numbers.Number | str | type(None)):
        return repr(value)
    if isinstance(value, tuple | list | dict) and len(text := repr(value)) <= 80:
        return text
    return f"a {type(value).__name__}"


def bad_input(argument: str, expected: str, got: Any, fix: str | None = None, *, raw: bool = False) -> str:
    """The message of a refusal: ``"<argument>: expected <expected>, got <got>. Fix: <fix>."``.

    Args:
        argument: what was wrong, as the caller spells it (``"seeds"``, ``"--device"``, a file and key).
        expected: what is accepted.
        got: the received value (described with `describe` unless `raw`, which takes it as text).
        fix: how to correct it (omitted when the expectation says it all).
        raw: `got` is already a description.
    """
    message = f"{argument}: expected {expected}, got {got if raw else describe(got)}"
    if fix:
        message += f". Fix: {fix.rstrip('.')}"
    return message + "."


def check_choice(argument: str, value: Any, allowed: Iterable[Any], fix: str | None = None) -> Any:
    """`value` if it is one of `allowed`, else `ValueError`."""
    allowed = tuple(allowed)
    if not isinstance(value, str | int | float | type(None)) or value not in allowed:
        raise ValueError(bad_input(argument, f"one of {allowed}", value, fix))
    return value


def check_bool(argument: str, value: Any) -> bool:
    """`value` if it is a bool (numpy bools too), else `TypeError`."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(bad_input(argument, "True or False", value))
    return bool(value)


def check_int(
    argument: str, value: Any, minimum: int | None = None, maximum: int | None = None, fix: str | None = None
) -> int:
    """`value` as an int if it is an integer (not a bool or float) within [minimum, maximum]."""
    bounds = _bounds(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(bad_input(argument, f"an integer {bounds}".rstrip(), value, fix))
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(bad_input(argument, f"an integer {bounds}", value, fix))
    return value


def check_float(
    argument: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    exclusive_minimum: bool = False,
    fix: str | None = None,
) -> float:
    """`value` as a float if it is a finite real number (not a bool) within the bounds."""
    if exclusive_minimum:
        bounds = f"> {minimum}" if maximum is None else f"in ({minimum}, {maximum}]"
    else:
        bounds = _bounds(minimum, maximum)
    expected = f"a finite number {bounds}".rstrip()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(bad_input(argument, expected, value, fix))
    value = float(value)
    low = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
    if not math.isfinite(value) or low or (maximum is not None and value > maximum):
        raise ValueError(bad_input(argument, expected, value, fix))
    return value


def check_int_tuple(argument: str, values: Any, minimum: int = 1, fix: str | None = None) -> tuple[int, ...]:
    """A non-empty tuple of integers >= minimum (from any sequence)."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise TypeError(bad_input(argument, f"a non-empty sequence of integers >= {minimum}", values, fix))
    if len(values) == 0:
        raise ValueError(bad_input(argument, f"a non-empty sequence of integers >= {minimum}", values, fix))
    return tuple(check_int(f"{argument}[{i}]", v, minimum, fix=fix) for i, v in enumerate(values))


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f"in [{minimum}, {maximum}]"
    if minimum is not None:
        return f">= {minimum}"
    if maximum is not None:
        return f"<= {maximum}"
    return ""


_SEEDS_EXPECTED = "an int or {n} seeds (integers: a list, or an integer array or tensor of shape ({n},))"


def seed_tensor(seeds: Any, n: int, argument: str = "seeds") -> torch.Tensor:
    """(n,) int64 CPU seeds from an int (seed + i for row i) or n integers; refuses everything else.

    Floats (even integral ones such as 2.0), bools, generators and strings are refused rather than cast:
    a truncated seed would silently collide with another env's stream.

    Example:
        >>> seed_tensor(7, 3).tolist(), seed_tensor([4, 2], 2).tolist()
        ([7, 8, 9], [4, 2])
    """
    expected = _SEEDS_EXPECTED.format(n=n)
    fix = "pass integer seeds, one per observation row (or one int for the whole batch)"
    if isinstance(seeds, torch.Tensor | np.ndarray) and seeds.ndim == 0 and _integer_dtype(seeds):
        seeds = int(seeds)
    if isinstance(seeds, numbers.Integral) and not isinstance(seeds, bool | np.bool_):
        base = _int64(argument, int(seeds), expected, fix)
        _int64(argument, base + n - 1, expected, fix)
        return base + torch.arange(n, dtype=torch.int64)
    return integer_tensor(seeds, n, argument, expected, fix).to("cpu")


def integer_tensor(
    values: Any, n: int, argument: str, expected: str | None = None, fix: str | None = None
) -> torch.Tensor:
    """(n,) int64 tensor from n integers (a list, an integer array, or an integer tensor kept on its device).

    Example:
        >>> integer_tensor([3, 1], 2, "env_ids").tolist()
        [3, 1]
    """
    expected = expected or f"{n} integers (a list, or an integer array or tensor of shape ({n},))"
    if isinstance(values, torch.Tensor | np.ndarray):
        if not _integer_dtype(values):
            raise TypeError(bad_input(argument, expected, values, fix))
        if tuple(values.shape) != (n,):
            raise ValueError(bad_input(argument, expected, f"shape {tuple(values.shape)}", fix, raw=True))
        return torch.as_tensor(values).to(torch.int64)
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(bad_input(argument, expected, values, fix))
    for i, value in enumerate(values):
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
            raise TypeError(bad_input(f"{argument}[{i}]", "an int", value, fix))
        _int64(f"{argument}[{i}]", int(value), "an int64 value", fix)
    if len(values) != n:
        raise ValueError(bad_input(argument, expected, f"shape ({len(values)},)", fix, raw=True))
    return torch.tensor([int(v) for v in values], dtype=torch.int64)


def _integer_dtype(array: torch.Tensor | np.ndarray) -> bool:
    if isinstance(array, torch.Tensor):
        return not (array.is_floating_point() or array.is_complex() or array.dtype == torch.bool)
    return bool(np.issubdtype(array.dtype, np.integer))


def _int64(argument: str, value: int, expected: str, fix: str | None) -> int:
    if not -(2**63) <= value < 2**63:
        raise ValueError(bad_input(argument, f"{expected} within int64", value, fix))
    return value


def check_device(device: Any, argument: str = "device") -> torch.device:
    """`device` as a `torch.device` this machine has; CUDA without a usable GPU is refused with the fix.

    Example:
        >>> check_device("cpu")
        device(type='cpu')
    """
    cpu = f"{argument} cpu" if argument.startswith("--") else f"{argument}='cpu'"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(bad_input(argument, "a torch device such as 'cpu', 'cuda' or 'cuda:1'", device)) from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU-only build)"
            raise ValueError(bad_input(
                argument, "a device this machine has", device, f"pass {cpu}: CUDA is not available here (torch "
                f"{torch.__version__} with {build}, {torch.cuda.device_count()} GPUs visible); for a GPU run use a "
                "machine with an NVIDIA GPU and a CUDA build of torch"))  # fmt: skip
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(bad_input(argument, f"cuda:0..cuda:{count - 1} ({count} GPUs visible)", device))
    return dev
