"""Fixtures of the reliability tests: the stand-in tokenizer and one tiny PI0.5 policy shared by the cases."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from reliability_support import Probe, make_tiny_policy

from policies.pi05.policy import Pi05Policy
from policies.pi05.tokenizer import build_standin_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in PaliGemma tokenizer folder (built locally, no network)."""
    return build_standin_tokenizer(tmp_path_factory.mktemp("reliability_tokenizer"))


@pytest.fixture(scope="session")
def policy(tokenizer_dir: Path) -> Pi05Policy:
    """One policy shared by the bad-input cases (each case proves it left the policy unchanged)."""
    return make_tiny_policy(tokenizer_dir)


@pytest.fixture
def probe(policy: Pi05Policy) -> Probe:
    return Probe(policy)


@pytest.fixture
def ctx(policy: Pi05Policy, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> SimpleNamespace:
    """What a bad-input case needs: the shared policy, the tokenizer folder, a scratch folder, captured output."""
    return SimpleNamespace(policy=policy, tokenizer_dir=tokenizer_dir, tmp=tmp_path, capsys=capsys)
