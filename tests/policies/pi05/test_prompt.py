from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from policies.pi05.prompt import (
    PromptBuilder,
    capped_buckets,
    clean_task,
    discretize_state,
    discretize_state_np,
    host_tokenize,
    prompt_text,
)


def test_known_prompt_strings():
    assert clean_task("  pick_up the\nbowl ") == "pick up the bowl"
    assert prompt_text("pick_up bowl", "state", [0, -1, 255]) == "Task: pick up bowl, State: 0 -1 255;\nAction: "
    assert prompt_text("pick_up bowl", "lerobot_no_state") == "Task: pick up bowl;\nAction: "
    assert prompt_text(" pick_up bowl\n", "text") == "pick up bowl\n"


def test_known_ids(standin_tok):
    tok = standin_tok
    enc = tok.encode
    assert host_tokenize(tok, "open it", "state", [12, -1]) == [2, *enc("Task: open it, State: 12 -1;\nAction: ")]
    assert host_tokenize(tok, "open it", "lerobot_no_state") == [2, *enc("Task: open it;\nAction: ")]
    assert host_tokenize(tok, "open_it", "text") == [2, *enc("open it"), *enc("\n")]
    # digits are single tokens: " 12" is space + "1" + "2"
    assert enc(" 12")[1:] == enc("1") + enc("2")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (-1.0, 0),
        (1.0, 255),
        (-1.5, -1),
        (1.5, 255),
        (-1.0000001, -1),
        (0.9921875, 255),
        (0.9921874, 254),
        (0.0, 128),
        (-0.9921875, 1),
        (0.5, 192),
        (-1e-9, 127),
    ],
)
def test_discretisation_edges(value, expected):
    t = torch.tensor([[value]], dtype=torch.float64)
    assert discretize_state(t).item() == expected
    assert discretize_state(t.float()).item() == discretize_state_np(np.float32([[value]]))[0, 0]
    assert discretize_state_np(np.array([[value]]))[0, 0] == expected
    if -1.0 <= value < 1.0:
        assert expected == math.floor((value + 1.0) * 128)


def test_discretisation_matches_numpy_on_random_values():
    x = np.random.default_rng(0).uniform(-1.3, 1.3, size=(64, 9)).astype(np.float32)
    assert np.array_equal(discretize_state(torch.from_numpy(x)).numpy(), discretize_state_np(x))


def test_device_state_tokens_equal_host(standin_tok):
    builder = PromptBuilder(standin_tok, "state", max_token_len=200)
    assert builder.device_state_tokens
    rng = np.random.default_rng(1)
    tasks = ["pick up the bowl", "open_the drawer\n", "pick up the bowl", "x", "Ünïcödé 42 task"]
    for dims in (1, 8, 14):
        state = torch.tensor(rng.uniform(-1.3, 1.3, (5, dims)), dtype=torch.float32)
        tokens, lengths = builder(tasks, state)
        assert tokens.dtype == torch.int32 and lengths.dtype == torch.int32
        assert tokens.shape[1] in builder.buckets
        bins = discretize_state_np(state.numpy())
        for i, task in enumerate(tasks):
            ref = host_tokenize(standin_tok, task, "state", bins[i])
            assert lengths[i].item() == len(ref)
            assert tokens[i, : len(ref)].tolist() == ref
            assert (tokens[i, len(ref) :] == 0).all()
    assert builder.num_cached_tasks == 4


@pytest.mark.parametrize("fmt", ["text", "lerobot_no_state"])
def test_task_only_formats(standin_tok, fmt):
    builder = PromptBuilder(standin_tok, fmt, max_token_len=48)
    tasks = ["close the microwave", "put_it\nthere"]
    tokens, lengths = builder(tasks, None)
    assert tokens.shape == (2, 16)
    for i, task in enumerate(tasks):
        ref = host_tokenize(standin_tok, task, fmt)
        assert tokens[i, : lengths[i]].tolist() == ref and (tokens[i, lengths[i] :] == 0).all()


def test_bucket_is_an_upper_bound_choice(standin_tok):
    builder = PromptBuilder(standin_tok, "state", max_token_len=200, buckets=(16, 48, 112, 200))
    assert builder.buckets == (16, 48, 112, 200)
    tokens, lengths = builder(["go"], torch.zeros(1, 2))
    upper = len(builder._task_head("go")) + 2 * builder.max_bin_len + len(builder._tail)
    assert tokens.shape[1] == builder.bucket_for(upper) >= lengths[0].item()
    assert capped_buckets((16, 48, 112, 200), 48) == (16, 48)
    assert capped_buckets((16, 300), 100) == (16, 100)


def test_truncation_warns_once(standin_tok):
    builder = PromptBuilder(standin_tok, "state", max_token_len=20, buckets=(8,))
    state = torch.full((2, 12), 0.5)
    with pytest.warns(UserWarning, match="truncated to max_token_len=20"):
        tokens, lengths = builder(["a long task description here", "b"], state)
    assert tokens.shape == (2, 20) and lengths.tolist() == [20, 20]
    ref = host_tokenize(standin_tok, "a long task description here", "state", [192] * 12)[:20]
    assert tokens[0].tolist() == ref
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        builder(["a long task description here"], state[:1])


class _MergingTokenizer:
    """Wraps a tokenizer so that a bin's ids depend on what follows it (forces the host fallback)."""

    def __init__(self, inner):
        self._inner = inner
        for name in ("name", "vocab_size", "bos_id", "eos_id", "pad_id", "is_standin"):
            setattr(self, name, getattr(inner, name))

    def encode(self, text):
        return self._inner.encode(text) + ([7] if text.endswith("5") else [])

    def decode(self, ids):
        return self._inner.decode(ids)


def test_host_fallback_when_bins_are_not_context_free(standin_tok):
    tok = _MergingTokenizer(standin_tok)
    with pytest.warns(UserWarning, match="host"):
        builder = PromptBuilder(tok, "state", max_token_len=200)
    assert not builder.device_state_tokens
    state = torch.tensor([[0.34, -1.0, 0.99]])
    tokens, lengths = builder(["stack"], state)
    ref = host_tokenize(tok, "stack", "state", discretize_state_np(state.numpy())[0])
    assert tokens[0, : lengths[0]].tolist() == ref


def test_state_format_requires_state(standin_tok):
    builder = PromptBuilder(standin_tok, "state", max_token_len=48)
    with pytest.raises(ValueError, match="needs a"):
        builder(["x"], None)
    assert builder.num_cached_tasks == 0
