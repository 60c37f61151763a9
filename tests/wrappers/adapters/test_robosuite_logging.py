from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from wrappers.adapters.robosuite_logging import ROBOSUITE_LOGGER, quiet_robosuite_macros

ROOT = Path(__file__).resolve().parents[3]


def _passes(message: str) -> bool:
    return bool(logging.getLogger(ROBOSUITE_LOGGER).filter(logging.makeLogRecord({"msg": message})))


def test_only_the_macro_warnings_are_dropped():
    quiet_robosuite_macros()
    quiet_robosuite_macros()  # idempotent: one filter
    assert not _passes("No private macro file found!")
    assert not _passes("To setup, run: python /x/robosuite/scripts/setup_macros.py")
    assert _passes("Could not load the mujoco renderer")


@pytest.mark.slow
def test_importing_libero_prints_no_macro_warning():
    if importlib.util.find_spec("robosuite") is None:
        pytest.skip("robosuite (LIBERO) is not installed: bash .ci/install_sims.sh libero")
    code = 'from wrappers.adapters.libero import libero_tasks; libero_tasks("libero_spatial"); import robosuite'
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "macro" not in proc.stdout + proc.stderr
