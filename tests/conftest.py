"""Suite-wide settings.

Tiny CPU models are latency-bound: with two intra-op threads on a 2-core machine that also runs simulator
subprocesses, OpenMP threads contend and a 20 ms policy call can take seconds. One thread is both faster and
deterministic here, so the whole suite runs single-threaded in torch.
"""

import torch

torch.set_num_threads(1)


# A plain `pytest -q` shows only a count of skips; this says why, grouped (`pytest -rs` lists every one).
SKIP_GROUPS = (
    (("test_interpreter_run",), "ran under Triton's CPU interpreter in a subprocess (test_interpreter_run)"),
    (("cuda", "gpu"), "need a CUDA GPU (run on one by `python -m benchmarks.gpu_suite --out DIR`)"),
    (("triton",), "need triton, which CPU torch does not install (`pip install triton`: its CPU interpreter)"),
    (("libero", "mani_skill", "maniskill", "sapien", "vulkan", "robosuite", "install_sims"),
     "need a real simulator (`bash .ci/install_sims.sh`)"),
)  # fmt: skip


def _skip_group(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    lowered = reason.lower()
    for words, group in SKIP_GROUPS:
        if any(word in lowered for word in words):
            return group
    return reason if len(reason) <= 100 else reason[:97] + "..."


def pytest_terminal_summary(terminalreporter):
    from collections import Counter

    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.when in ("setup", "call")]
    if not skipped:
        return
    terminalreporter.write_line(f"{len(skipped)} skipped (`pytest -rs` lists each):")
    for group, count in Counter(_skip_group(r) for r in skipped).most_common():
        terminalreporter.write_line(f"  {count:4d} {group}")
