"""Shared fixtures of the PI0.5 tests: a stand-in PaliGemma tokenizer built once per session (no network), an SDPA
call counter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policies.pi05.tokenizer import PromptTokenizer, build_standin_tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def standin_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a 257,152-piece stand-in PaliGemma tokenizer (tokenizer.model + tokenizer_config.json)."""
    return build_standin_tokenizer(tmp_path_factory.mktemp("paligemma_standin"))


@pytest.fixture(scope="session")
def standin_tok(standin_tokenizer: Path) -> PromptTokenizer:
    """The stand-in loaded with sentencepiece."""
    return load_tokenizer(standin_tokenizer)


@pytest.fixture
def count_sdpa(monkeypatch: pytest.MonkeyPatch) -> list[torch.Size]:
    """Shapes of the queries of every call that reached the SDPA path of `policies.pi05.attention`."""
    from policies.pi05 import attention

    calls: list[torch.Size] = []
    real = attention._sdpa

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(attention, "_sdpa", spy)
    return calls
