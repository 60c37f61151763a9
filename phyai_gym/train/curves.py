"""Learning curves of a training loop: CSV rows flushed every iteration, an ``iter k/N`` + ETA line, a PNG.

`CurveLog` is what a loop needs: ``log(row)`` appends one row to the CSV at once (an interrupted run keeps every
finished iteration, whole rows only), ``progress(k)`` gives the ``iter k/N | elapsed, ETA`` prefix of the loop's own
line, and
``close()`` -- at the end, or from a ``finally`` on Ctrl-C -- writes the plot next to the CSV. The plot shows the
PPO columns it finds: success rate, episodic return, approx-KL, clip fraction, explained variance and the time
split (columns named ``time_*``). matplotlib is imported only to plot, with the file-only ``Agg`` backend.

A CSV that already exists (an earlier or crashed run) is never appended to or overwritten: when the first row
comes, it and its plot are renamed to the first free ``<stem>.<k>.csv`` / ``.png`` (``kept``), and the run
starts a fresh file, so a rerun of the same command neither loses nor duplicates an iteration. A resumed run
(``resume_after=k``) instead continues the CSV: it keeps the rows of iterations 1..k, drops any later ones (written
after the checkpoint it resumes from), and appends.

With ``tensorboard=DIR`` every numeric column of a row also goes to TensorBoard as a scalar at the row's
``global_step``, as cleanrl logs (``charts/``, ``losses/``, ``time/``). The ``tensorboard`` package is imported only
then.

Re-plot a CSV (e.g. one copied from a GPU run)::

    python -m phyai_gym.train.curves ppo_curve.csv [--out plot.png]
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PANELS: tuple[tuple[str, str], ...] = (
    ("success_rate", "success rate (rollout episodes)"),
    ("episodic_return", "episodic return"),
    ("approx_kl", "approx-KL (last minibatch)"),
    ("clipfrac", "clip fraction"),
    ("explained_variance", "explained variance"),
)
"""(CSV column, panel title) of the line panels; the sixth panel is the time split of the ``time_*`` columns."""


def _clock(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class CurveLog:
    """One CSV row per iteration (flushed at once), a progress prefix with an ETA, a plot on `close`.

    Args:
        csv_path: the CSV to write (None: rows are kept in memory only, nothing is written).
        total: the planned number of iterations N (for ``progress`` and the ETA).
        title: the plot's title.
        resume_after: continue the CSV after iteration k (its rows 1..k kept, later ones dropped); None: a new curve.
        tensorboard: a folder for TensorBoard event files (None: no TensorBoard).

    Attributes:
        rows: every logged row, in order.
        csv_path: the CSV (None when not written).
        plot_path: the PNG next to the CSV (same name, ``.png``; None when no CSV is written).
        kept: where an earlier CSV of the same name was moved (None: there was none).

    Example:
        >>> import os, tempfile
        >>> log = CurveLog(os.path.join(tempfile.mkdtemp(), "curve.csv"), total=2)
        >>> log.log({"iteration": 1, "success_rate": 0.5})
        >>> log.progress(1).startswith("iter 1/2 |")
        True
        >>> [p.suffix for p in log.close()] in ([".csv", ".png"], [".csv"])  # the PNG needs matplotlib
        True
    """

    def __init__(
        self,
        csv_path: str | Path | None,
        total: int,
        *,
        title: str = "",
        resume_after: int | None = None,
        tensorboard: str | Path | None = None,
    ) -> None:
        if total < 1:
            raise ValueError(f"CurveLog: total must be >= 1 (the planned iterations), got {total}.")
        self.csv_path = None if csv_path is None else Path(csv_path)
        self.plot_path = None if self.csv_path is None else self.csv_path.with_suffix(".png")
        self.total = total
        self.title = title
        self.rows: list[dict[str, Any]] = []
        self._start = time.perf_counter()
        self._log_times: list[float] = []
        self._handle: Any = None
        self._writer: csv.DictWriter | None = None
        self._closed = False
        self.kept: Path | None = None
        if resume_after is not None and self.csv_path is not None and self.csv_path.exists():
            self._continue(resume_after)
        purge = int(float(self.rows[-1].get("global_step", 0))) + 1 if self.rows else None  # drop later events
        self._tb = None if tensorboard is None else _summary_writer(tensorboard, purge)

    def _continue(self, iterations: int) -> None:
        """Reopen the CSV for appending, keeping only its rows of iterations 1..`iterations`."""
        assert self.csv_path is not None
        with open(self.csv_path, newline="") as handle:
            reader = csv.DictReader(handle)
            fields = list(reader.fieldnames or [])
            kept = [row for row in reader if int(row["iteration"]) <= iterations]
        tmp = self.csv_path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            writer.writerows(kept)
        tmp.replace(self.csv_path)
        self.rows = kept
        self._handle = open(self.csv_path, "a", newline="")  # noqa: SIM115  (open until close())
        self._writer = csv.DictWriter(self._handle, fieldnames=fields)

    def log(self, row: Mapping[str, Any]) -> None:
        """Appends `row` (same columns as the first row) to the CSV and flushes it."""
        self.rows.append(dict(row))
        self._log_times.append(time.perf_counter())
        if self._tb is not None:
            _log_scalars(self._tb, row)
        if self.csv_path is None:
            return
        if self._writer is None:
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            if self.csv_path.exists():
                self.kept = _keep_aside(self.csv_path)
            self._handle = open(self.csv_path, "x", newline="")  # noqa: SIM115  (open until close())
            self._writer = csv.DictWriter(self._handle, fieldnames=list(row))
            self._writer.writeheader()
        self._writer.writerow(row)  # buffered whole, then flushed: a kill leaves whole rows
        self._handle.flush()

    def progress(self, k: int) -> str:
        """``iter k/N | 1m05s elapsed, ETA 3m10s`` after iteration k.

        The ETA is the mean time between logged rows times the iterations left (after the first row: the time
        since construction, set-up included).
        """
        now = time.perf_counter()
        elapsed = now - self._start
        logged = len(self._log_times)
        if logged >= 2:
            per_iteration = (self._log_times[-1] - self._log_times[0]) / (logged - 1)
        else:
            per_iteration = elapsed / max(k, 1)
        eta = per_iteration * (self.total - k) if k > 0 else math.inf
        width = len(str(self.total))
        return f"iter {k:>{width}d}/{self.total} | {_clock(elapsed)} elapsed, ETA {_clock(eta)}"

    def close(self) -> list[Path]:
        """Closes the CSV and writes the plot (once; later calls only return the paths). Returns the files."""
        if not self._closed:
            self._closed = True
            if self._handle is not None:
                self._handle.close()
            if self._tb is not None:
                self._tb.close()
            if self.plot_path is not None and self.rows:
                if plot_curves(self.rows, self.plot_path, self.title) is None:
                    self.plot_path = None
        return [p for p in (self.csv_path, self.plot_path) if p is not None and p.exists()]

    def __enter__(self) -> CurveLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary_writer(folder: str | Path, purge_step: int | None = None) -> Any:
    """A TensorBoard `SummaryWriter` on `folder`, or an ImportError naming the package to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(
            f"--tensorboard needs the tensorboard package ({err}). Fix: pip install tensorboard, or drop --tensorboard "
            "(the CSV and its plot are written without it)."
        ) from err
    return SummaryWriter(str(folder), purge_step=purge_step)


TB_GROUPS = {"pg_loss": "losses", "v_loss": "losses", "approx_kl": "losses", "clipfrac": "losses",
             "explained_variance": "losses", "sps": "charts", "weight_version": "charts"}  # fmt: skip
"""TensorBoard tag group of a column (cleanrl's names); ``approx_kl*`` are losses, ``time_*`` time, the rest charts."""


def _log_scalars(writer: Any, row: Mapping[str, Any]) -> None:
    """Every numeric column of `row` as a scalar at its ``global_step`` (else its ``iteration``)."""
    step = int(row.get("global_step", row.get("iteration", 0)))
    for key, value in row.items():
        if key in ("iteration", "global_step") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        group = "time" if key.startswith("time_") else "losses" if key.startswith("approx_kl") else TB_GROUPS.get(
            key, "charts")  # fmt: skip
        writer.add_scalar(f"{group}/{key}", value, step)
    writer.flush()


def _keep_aside(path: Path) -> Path:
    """Renames `path` (and its ``.png``) to the first free ``<stem>.<k><suffix>``; returns the new CSV path."""
    k = 1
    while (kept := path.with_name(f"{path.stem}.{k}{path.suffix}")).exists() or kept.with_suffix(".png").exists():
        k += 1
    path.rename(kept)
    if path.with_suffix(".png").exists():
        path.with_suffix(".png").rename(kept.with_suffix(".png"))
    return kept


def _column(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    out = []
    for row in rows:
        try:
            out.append(float(row.get(key, "nan")))
        except (TypeError, ValueError):
            out.append(float("nan"))
    return out


def plot_curves(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """Writes the 2 x 3 panel plot of `rows` to `path`; returns it (None without matplotlib, with a message)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    x_key = "global_step" if rows and "global_step" in rows[0] else "iteration"
    x = _column(rows, x_key) if rows and x_key in rows[0] else list(range(1, len(rows) + 1))
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    panels = PANELS
    if rows and not any(key in rows[0] for key, _ in PANELS):  # not a PPO curve (e.g. SFT): its own columns
        skip = {"iteration", x_key}
        panels = tuple((k, k.replace("_", " ")) for k in rows[0] if k not in skip and not k.startswith("time_"))[:5]
    for ax, (key, label) in zip(axes.flat, panels):
        ax.set_title(label, fontsize=10)
        values = _column(rows, key) if rows and key in rows[0] else []
        if any(math.isfinite(v) for v in values):
            ax.plot(x, values, marker="." if len(rows) < 50 else None)
        else:  # e.g. no episode finished yet
            note = "not logged" if not values else "no value yet (all nan)"
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_xlabel(x_key.replace("_", " "), fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes.flat[5]
    ax.set_title("time split per iteration (s)", fontsize=10)
    bottom = [0.0] * len(rows)
    for key in [k for k in (rows[0] if rows else {}) if k.startswith("time_")]:
        values = [0.0 if math.isnan(v) else v for v in _column(rows, key)]
        ax.bar(range(1, len(rows) + 1), values, bottom=bottom, label=key[5:], width=0.85)
        bottom = [b + v for b, v in zip(bottom, values)]
    if any(bottom):
        ax.legend(fontsize=8)
    ax.set_xlabel("iteration", fontsize=8)
    fig.suptitle(title or f"{len(rows)} iterations", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m phyai_gym.train.curves CSV [--out PNG]``: the plot of a curve CSV."""
    parser = argparse.ArgumentParser(description="Plot a learning-curve CSV (one row per iteration).")
    parser.add_argument("csv", help="the curve CSV (e.g. written by examples/ppo_pi05.py)")
    parser.add_argument("--out", default=None, help="the PNG (default: next to the CSV, same name)")
    parser.add_argument("--title", default="", help="plot title (default: the number of iterations)")
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as handle:
        rows = list(csv.DictReader(handle))
    out = plot_curves(rows, args.out or Path(args.csv).with_suffix(".png"), args.title)
    if out is not None:
        print(f"plot: {out}")
    return 0 if out is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
