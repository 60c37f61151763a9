"""Shared fixtures of the PI0.5 tests: a stand-in PaliGemma tokenizer built once per session (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies.pi05.tokenizer import PromptTokenizer, build_standin_tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def standin_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a 257,152-piece stand-in PaliGemma tokenizer (tokenizer.model + tokenizer_config.json)."""
    return build_standin_tokenizer(tmp_path_factory.mktemp("paligemma_standin"))


@pytest.fixture(scope="session")
def standin_tok(standin_tokenizer: Path) -> PromptTokenizer:
    """The stand-in loaded with sentencepiece."""
    return load_tokenizer(standin_tokenizer)
