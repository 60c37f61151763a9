"""The per-task success plot of an evaluation: one bar per task and overall, with Wilson 95 % intervals.

matplotlib is imported only here, with the file-only ``Agg`` backend; without it the plot is skipped with a
message saying how to get it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_success(tasks: Sequence[Any], overall: Any, path: str | Path) -> Path | None:
    """Writes a horizontal bar chart of success rates with Wilson intervals; returns its path (None: skipped).

    Args:
        tasks: per-task results with ``task``, ``episodes``, ``success_rate``, ``ci_low``, ``ci_high``
            (`phyai_gym.evaluation.TaskResult`).
        overall: the same for all episodes together.
        path: the PNG to write.

    Example:
        >>> from phyai_gym.evaluation import summarize
        >>> import tempfile, os
        >>> rows = [{"task": "a", "success": True, "return": 1.0, "length": 3}]
        >>> per_task, overall = summarize(rows, ["a"])
        >>> out = plot_success(per_task, overall, os.path.join(tempfile.mkdtemp(), "success.png"))
        >>> out is None or out.name == "success.png"
        True
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    results = [*tasks, overall]
    names = [r.task if len(r.task) <= 40 else r.task[:37] + "..." for r in results]
    rates = [0.0 if r.episodes == 0 else r.success_rate for r in results]
    low = [rate - r.ci_low for rate, r in zip(rates, results)]
    high = [r.ci_high - rate for rate, r in zip(rates, results)]
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.35 * len(results)))
    y = list(range(len(results)))[::-1]
    colours = ["tab:blue"] * len(tasks) + ["tab:orange"]
    ax.barh(y, rates, xerr=[low, high], color=colours, capsize=3)
    ax.set_yticks(y, [f"{name} (n={r.episodes})" for name, r in zip(names, results)], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_xlabel("success rate (bars: Wilson 95 % interval)")
    ax.set_title(f"success over {overall.episodes} episodes: {overall.success_rate:.3f}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
