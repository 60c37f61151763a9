"""Torch's CPU thread count for the command line and the examples.

Tiny CPU models are latency-bound: their matrices are too small for intra-op parallelism to pay, and on a
machine whose cores are busy (simulator subprocesses, other jobs) OpenMP threads wait on each other, so one
thread is both faster and steadier there. Full-size models on a CPU and anything on a GPU keep torch's default.
"""

from __future__ import annotations


def configure_threads(requested: int | None, *, device: str, small_model: bool) -> str:
    """Sets torch's intra-op CPU threads and returns one line saying what was chosen and why.

    Args:
        requested: the user's ``--threads`` (None: choose; 1 for a small model on the CPU, torch's default
            otherwise).
        device: the policy's torch device ("cpu", "cuda", "cuda:1", ...).
        small_model: the policy is a tiny PI0.5 or a baseline (latency-bound).

    Raises:
        ValueError: `requested` is below 1.

    Example:
        >>> configure_threads(None, device="cpu", small_model=True)
        'torch CPU threads: 1 (default for small models on the CPU: faster on busy cores; --threads N to change)'
    """
    import torch

    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads: expected >= 1 (or leave it out to choose), got {requested}.")
        torch.set_num_threads(requested)
        return f"torch CPU threads: {requested} (--threads)"
    if small_model and str(device).split(":")[0] == "cpu":
        torch.set_num_threads(1)
        return "torch CPU threads: 1 (default for small models on the CPU: faster on busy cores; --threads N to change)"
    return f"torch CPU threads: {torch.get_num_threads()} (torch's default; --threads N to change)"
