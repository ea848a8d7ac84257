"""Fixtures of the rl_core tests."""

import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    """The tiny model's tokenizer (Qwen2's chat template, tool messages included)."""
    return AutoTokenizer.from_pretrained(tiny_model_path)
