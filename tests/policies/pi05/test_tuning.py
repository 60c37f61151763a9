"""The tuned thresholds table: a default entry, every value justified by named benchmark rows, one lookup."""

import json

import torch

from policies.pi05 import attention, geglu_gemm, tuning


def test_every_entry_names_its_rows_and_the_default_serves_unknown_devices():
    table = json.loads(tuning.TABLE.read_text())
    names = {"gemm_max_scores", "flash_min_scores", "geglu_min_waves"}
    entries = {gpu: entry for gpu, entry in table.items() if isinstance(entry, dict)}
    assert "default" in entries and "NVIDIA H200" in entries
    for gpu, entry in entries.items():
        assert set(entry) == names, gpu
        for name, item in entry.items():
            assert isinstance(item["value"], int) and item["value"] >= 0, (gpu, name)
            assert isinstance(item["rows"], str) and item["rows"], (gpu, name)  # the rows that justify it
    assert tuning.thresholds(None) == tuning.thresholds("cpu") == tuning.thresholds(torch.device("cpu"))


def test_the_h200_values_are_the_defaults():
    """The measured GPU's entry and the default agree, so every device dispatches as the H200 was tuned."""
    table = json.loads(tuning.TABLE.read_text())
    values = {gpu: {name: item["value"] for name, item in table[gpu].items()} for gpu in ("default", "NVIDIA H200")}
    assert values["NVIDIA H200"] == values["default"]
    assert tuning.thresholds("cpu") == tuning.Thresholds(**values["default"])
    assert values["default"] == {"gemm_max_scores": 1 << 22, "flash_min_scores": 1 << 20, "geglu_min_waves": 4}


def test_the_dispatch_reads_the_table():
    cpu, limit = torch.device("cpu"), tuning.thresholds("cpu").gemm_max_scores
    assert attention.gemm_serves(1, 1, 1, 1, limit, device=cpu)
    assert not attention.gemm_serves(1, 1, 1, 1, limit + 1, device=cpu)
    assert geglu_gemm.GemmTiles().min_waves is None  # the kernel asks the table for the device's value
