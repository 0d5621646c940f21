"""Corpus loading, split determinism/disjointness, .bin files, BPE, and batch sampling."""
import numpy as np
import pytest

from dobb_bench.training import data as D


def _marked_folder(tmp_path, n=40):
    d = tmp_path / "marked"
    d.mkdir()
    for i in range(n):
        (d / f"f{i:03d}.txt").write_text(f"<<file {i:03d}>>\n" + "abc def\n" * 20)
    return d


def test_split_is_deterministic_and_disjoint(tmp_path):
    folder = _marked_folder(tmp_path)
    c1 = D.load_corpus(folder, cache_dir=tmp_path / "c1", val_fraction=0.25)
    c2 = D.load_corpus(folder, cache_dir=tmp_path / "c2", val_fraction=0.25)  # no cache shared
    assert np.array_equal(c1.train, c2.train) and np.array_equal(c1.val, c2.val)
    train, val = bytes(c1.train), bytes(c1.val)
    in_train = {i for i in range(40) if f"<<file {i:03d}>>".encode() in train}
    in_val = {i for i in range(40) if f"<<file {i:03d}>>".encode() in val}
    assert in_train | in_val == set(range(40)) and not in_train & in_val
    expected_val = {i for i in range(40) if D.unit_is_val(f"f{i:03d}.txt", 0.25)}
    assert in_val == expected_val and 2 <= len(in_val) <= 20
    assert c1.vocab_size == 256 and c1.bytes_per_token == 1.0


def test_cache_is_reused(tmp_path, text_dir):
    cache = tmp_path / "cache"
    first = D.load_corpus(text_dir, cache_dir=cache)
    assert len(list(cache.iterdir())) == 1
    second = D.load_corpus(text_dir, cache_dir=cache)
    assert isinstance(second.train, np.memmap)
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)


def test_single_file_is_split_by_chunks(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(bytes(range(32, 127)) * 20000)  # ~1.9 MB -> 29 chunks of 64 KiB
    c = D.load_corpus(f, cache_dir=tmp_path / "c", val_fraction=0.3)
    total = 95 * 20000
    assert len(c.train) + len(c.val) == total
    sizes = [min(D.CHUNK_BYTES, total - o) for o in range(0, total, D.CHUNK_BYTES)]
    expected = sum(n for i, n in enumerate(sizes) if D.unit_is_val(f"one.txt#{i}", 0.3))
    assert len(c.val) == expected > 0
    # too few units for a hash split: the tail of the text is the validation split
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 900 + b"y" * 100)
    c = D.load_corpus(small, cache_dir=tmp_path / "c", val_fraction=0.1)
    assert bytes(c.train) == b"x" * 900 and bytes(c.val) == b"y" * 100


def test_stdlib_units_exclude_site_packages():
    units = D._text_units(D._stdlib_root(), stdlib=True)
    keys = [k for k, _, _ in units]
    assert len(keys) > 500 and all(k.endswith(".py") for k in keys)
    assert not any(k.startswith("site-packages/") or "__pycache__" in k for k in keys)
    assert "argparse.py" in keys


def test_bin_folder_and_single_bin(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 1000, 5000, dtype=np.uint16)
    val = rng.integers(0, 1200, 800, dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    c = D.load_corpus(tmp_path)
    assert np.array_equal(c.train, train) and np.array_equal(c.val, val)
    assert c.vocab_size == int(max(train.max(), val.max())) + 1 and c.bytes_per_token is None
    assert np.array_equal(D.load_corpus(tmp_path / "val.bin").val, val)  # sibling pair is used
    lone = tmp_path / "lone"
    lone.mkdir()
    train.tofile(lone / "tokens.bin")
    c = D.load_corpus(lone / "tokens.bin", val_fraction=0.1)
    assert np.array_equal(np.concatenate([c.train, c.val]), train) and len(c.val) == 500
    assert D.load_corpus(tmp_path, vocab_size=50257).vocab_size == 50257
    with pytest.raises(ValueError, match="smaller than the largest token"):
        D.load_corpus(tmp_path, vocab_size=10)


def test_bad_inputs(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="odd byte count"):
        D.load_corpus(odd)
    with pytest.raises(ValueError, match="does not exist"):
        D.load_corpus(tmp_path / "missing")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        D.load_corpus(tmp_path / "empty.txt")
    (tmp_path / "void").mkdir()
    with pytest.raises(ValueError, match="no files"):
        D.load_corpus(tmp_path / "void")
    with pytest.raises(ValueError, match="tokenizer"):
        D.load_corpus(tmp_path, tokenizer="sentencepiece")


def test_bpe_tokenizer_roundtrip(tmp_path, text_dir):
    from tokenizers import Tokenizer

    c = D.load_corpus(text_dir, cache_dir=tmp_path, tokenizer="bpe", vocab_size=400)
    assert c.vocab_size <= 400 and int(c.train.max()) < c.vocab_size
    assert 1.2 < c.bytes_per_token < 6  # BPE merges bytes
    tok = Tokenizer.from_file(str(next(tmp_path.iterdir()) / "tokenizer.json"))
    text = tok.decode(list(map(int, c.val[:300])))
    assert len(text) > 300 and text in "".join(p.read_text() for p in sorted(text_dir.iterdir()))


def test_sampler_is_a_function_of_seed_and_step(corpus):
    a = D.BatchSampler(corpus.train, 16, 8, seed=3)
    b = D.BatchSampler(corpus.train, 16, 8, seed=3)
    assert np.array_equal(a.offsets(5), b.offsets(5))
    assert not np.array_equal(a.offsets(5), a.offsets(6))
    assert not np.array_equal(a.offsets(5), D.BatchSampler(corpus.train, 16, 8, seed=4).offsets(5))
    x, y = a.micro_batch(5, 0, 1)
    parts = [a.micro_batch(5, k, 4) for k in range(4)]
    assert x.shape == (8, 16) and np.array_equal(np.concatenate([p[0] for p in parts]), x)
    assert np.array_equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    off = a.offsets(5)[0]
    assert np.array_equal(x[0].numpy(), corpus.train[off:off + 16])


def test_eval_offsets_fixed(corpus):
    o1 = D.eval_offsets(corpus.val, 32, 10, seed=0)
    assert np.array_equal(o1, D.eval_offsets(corpus.val, 32, 10, seed=0))
    assert o1.max() + 33 <= len(corpus.val)
    with pytest.raises(ValueError, match="val split"):
        D.eval_offsets(corpus.val[:10], 32, 4, seed=0)
