"""Shared fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.testing import write_random_hf_dir

# The tiny model's matmuls are too small to gain from intra-op threads, and on
# a shared CI box OpenMP spin-waits make them tens of times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_hf_dir(tmp_path_factory.mktemp("llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_hf_dir(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=2)
