"""Shared fixtures of the spectral room's tests."""
import pytest


@pytest.fixture
def tiny_data(tmp_path, monkeypatch):
    import dobb_bench.training.data as data

    monkeypatch.setattr(data, "DEFAULT_CACHE", tmp_path / "cache")
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(600)))
    return str(text)
