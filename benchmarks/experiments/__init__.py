"""Experiments: one-off measurements that decided a design question; not part of the GPU suite (see README.md)."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
"""Where the experiments append their rows: ``benchmarks/experiments/results/<bench>.jsonl``."""
