"""Shared fixtures for the benchmark-harness tests: a small text corpus and tiny configs.

The corpus is a handful of stdlib modules copied into a temp folder, so tests never read the
whole stdlib (seconds) and never touch ~/.cache.
"""
from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from dobb_bench.training.data import load_corpus
from dobb_bench.training.model import ModelConfig
from dobb_bench.training.train import TrainConfig

FILES = ("argparse.py", "ast.py", "typing.py", "inspect.py", "dataclasses.py", "functools.py",
         "pathlib.py", "shutil.py", "tarfile.py", "zipfile.py", "textwrap.py", "string.py")


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    d = tmp_path_factory.mktemp("corpus")
    for name in FILES:
        shutil.copy(root / name, d / name)
    return d


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def corpus(text_dir, cache_dir):
    return load_corpus(text_dir, cache_dir=cache_dir, val_fraction=0.2)


@pytest.fixture
def tiny_model_cfg() -> ModelConfig:
    return ModelConfig(layers=2, width=32, heads=2, seq_len=32)


@pytest.fixture
def tiny_train_cfg() -> TrainConfig:
    return TrainConfig(steps=6, batch_size=4, eval_every=3, eval_seqs=8, warmup=2)


def _adamw(model, lr=3e-3):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))


@pytest.fixture
def adamw_factory():
    """torch's AdamW: a reference optimizer independent of the library under test."""
    return _adamw
