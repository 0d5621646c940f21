"""Corpora, tokenization, caching and deterministic batch sampling for the benchmark.

Why: benchmarks must run with no network and give the same numbers on every run. The default
corpus is the running interpreter's standard library (``.py`` files under
``sysconfig.get_paths()["stdlib"]``, ``site-packages`` excluded) -- about 30 MB that every Python
install has. The train/val split is decided per *unit* (a file, or a 64 KiB chunk of a single
input file) by a hash of its relative path, so it is the same on every machine and disjoint by
construction. Token arrays are cached as ``.npy`` files and memory-mapped on later runs.

Other inputs (``--data PATH``):
- a text file, or a folder of text files (binary files, i.e. containing NUL bytes, are skipped);
- nanoGPT-style ``train.bin`` / ``val.bin`` (uint16 tokens): a folder holding both, or one
  ``.bin`` file (its sibling ``val.bin``/``train.bin`` is used when present; otherwise the last
  ``val_fraction`` of its tokens is the validation split).

Tokenizers: ``byte`` (vocab 256, default) or ``bpe`` (a byte-level BPE trained locally on the
training split with the ``tokenizers`` package; nothing is downloaded).

Sampling: the batch of optimizer step ``s`` is a pure function of ``(seed, s)``, so the data
position is the step counter (checkpointed for free) and the global batch is the same whatever
the number of processes or micro-batches.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CACHE_VERSION = 1
CHUNK_BYTES = 64 * 1024
DEFAULT_CACHE = Path(os.environ.get("DOBB_BENCH_CACHE", Path.home() / ".cache" / "dobb_bench"))


@dataclass
class Corpus:
    """Tokenized train/val splits. ``bytes_per_token`` converts nats/token into bits/byte."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    name: str
    bytes_per_token: float | None = None  # None when the byte count is unknown (.bin input)


def unit_is_val(key: str, val_fraction: float) -> bool:
    """Deterministic split decision for one unit, from a hash of its relative path."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return (h / 2**64) < val_fraction


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _text_units(path: Path, stdlib: bool) -> list[tuple[str, Path | None, bytes | None]]:
    """``(key, file, data)`` units; ``data`` is set only for chunks of a single file."""
    if path.is_file():
        data = path.read_bytes()
        if not data:
            raise ValueError(f"data file {path} is empty")
        return [(f"{path.name}#{i}", None, data[o:o + CHUNK_BYTES])
                for i, o in enumerate(range(0, len(data), CHUNK_BYTES))]
    files = []
    for root, dirs, names in os.walk(path):
        rel_root = Path(root).relative_to(path)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__"
                         and not (stdlib and d == "site-packages" and rel_root == Path(".")))
        for name in sorted(names):
            if name.startswith(".") or (stdlib and not name.endswith(".py")):
                continue
            f = Path(root) / name
            if f.is_file():
                files.append(((rel_root / name).as_posix(), f, None))
    return files


def _read_unit(unit) -> bytes:
    key, f, data = unit
    if data is not None:
        return data
    data = f.read_bytes()
    return b"" if b"\0" in data else data  # skip binary files


def _fingerprint(units, extra: dict) -> str:
    h = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    for key, f, data in units:
        st = f.stat() if f is not None else None
        h.update(f"{key}|{st.st_size if st else len(data)}|{st.st_mtime_ns if st else 0}\n".encode())
    return h.hexdigest()[:16]


def _train_bpe(texts: list[bytes], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((t.decode("utf-8", "replace") for t in texts), trainer=trainer)
    return tok


def _encode(texts: list[bytes], tokenizer, dtype) -> np.ndarray:
    if tokenizer is None:
        return np.frombuffer(b"".join(texts), dtype=np.uint8).copy()
    parts = [np.zeros(0, dtype=dtype)]
    for i in range(0, len(texts), 64):  # bounded batches: Encoding objects are large
        batch = [t.decode("utf-8", "replace") for t in texts[i:i + 64]]
        parts += [np.asarray(enc.ids, dtype=dtype) for enc in tokenizer.encode_batch(batch)]
    return np.concatenate(parts)


def _load_text(path: Path, stdlib: bool, cache_dir: Path, tokenizer: str, vocab_size: int | None,
               val_fraction: float) -> Corpus:
    units = _text_units(path, stdlib)
    if not units:
        raise ValueError(f"data path {path} holds no files")
    if tokenizer == "bpe":
        vocab_size = vocab_size or 4096
        if not 257 <= vocab_size <= 65535:
            raise ValueError(f"--vocab-size must be in 257..65535 for bpe, got {vocab_size}")
    extra = dict(v=CACHE_VERSION, path=str(path.resolve()), tok=tokenizer, vocab=vocab_size,
                 val=val_fraction)
    key = _fingerprint(units, extra)
    cdir = cache_dir / f"{'stdlib' if stdlib else path.name}-{tokenizer}-{key}"
    meta_file = cdir / "meta.json"
    if meta_file.exists():
        meta = json.loads(meta_file.read_text())
        return Corpus(np.load(cdir / "train.npy", mmap_mode="r"), np.load(cdir / "val.npy", mmap_mode="r"),
                      meta["vocab_size"], meta["name"], meta["bytes_per_token"])
    train_texts, val_texts = [], []
    for unit in units:
        data = _read_unit(unit)
        if data:
            (val_texts if unit_is_val(unit[0], val_fraction) else train_texts).append(data)
    if not train_texts and not val_texts:
        raise ValueError(f"data path {path} holds no text (empty or binary files only)")
    if not val_texts or not train_texts:  # too few units for a hash split: split by position
        blob = b"".join(train_texts + val_texts)
        cut = max(1, int(len(blob) * (1 - val_fraction)))
        train_texts, val_texts = [blob[:cut]], [blob[cut:]]
    tok = _train_bpe(train_texts, vocab_size) if tokenizer == "bpe" else None
    dtype = np.uint16 if tok is not None else np.uint8
    train, val = _encode(train_texts, tok, dtype), _encode(val_texts, tok, dtype)
    vocab = tok.get_vocab_size() if tok is not None else 256
    bpt = sum(map(len, val_texts)) / max(1, len(val))
    name = "stdlib" if stdlib else str(path)
    tmp = cache_dir / f".{cdir.name}.tmp{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "train.npy", train)
    np.save(tmp / "val.npy", val)
    if tok is not None:
        tok.save(str(tmp / "tokenizer.json"))
    (tmp / "meta.json").write_text(json.dumps(dict(vocab_size=vocab, name=name, bytes_per_token=bpt)))
    try:
        os.replace(tmp, cdir)  # atomic: concurrent runs either see a full cache or none
    except OSError:  # another process finished first
        pass
    return Corpus(train, val, vocab, name, bpt)


def _read_bin(path: Path) -> np.ndarray:
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"token file {path} is empty")
    if size % 2:
        raise ValueError(f"token file {path} has an odd byte count ({size}); "
                         "nanoGPT .bin files hold uint16 tokens")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _load_bin(path: Path, vocab_size: int | None, val_fraction: float) -> Corpus:
    folder = path if path.is_dir() else path.parent
    train_f, val_f = folder / "train.bin", folder / "val.bin"
    if path.is_dir() or (train_f.exists() and val_f.exists() and path in (train_f, val_f)):
        if not (train_f.exists() and val_f.exists()):
            raise ValueError(f"folder {folder} must hold both train.bin and val.bin")
        train, val = _read_bin(train_f), _read_bin(val_f)
    else:
        tokens = _read_bin(path)
        cut = int(len(tokens) * (1 - val_fraction))
        train, val = tokens[:cut], tokens[cut:]
    top = int(max(train.max(initial=0), val.max(initial=0))) + 1
    if vocab_size is not None and vocab_size < top:
        raise ValueError(f"--vocab-size {vocab_size} is smaller than the largest token id + 1 ({top})")
    return Corpus(train, val, vocab_size or top, str(path), None)


def load_corpus(data: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None,
                tokenizer: str = "byte", vocab_size: int | None = None,
                val_fraction: float = 0.02) -> Corpus:
    """Loads (and caches) a corpus. ``data=None`` is the interpreter's stdlib sources."""
    if tokenizer not in ("byte", "bpe"):
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose byte or bpe")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cache = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    if data is None:
        return _load_text(_stdlib_root(), True, cache, tokenizer, vocab_size, val_fraction)
    path = Path(data).expanduser()
    if not path.exists():
        raise ValueError(f"data path {path} does not exist")
    is_bin = path.suffix == ".bin" or (path.is_dir() and (path / "train.bin").exists())
    if is_bin:
        return _load_bin(path, vocab_size, val_fraction)
    if tokenizer == "byte" and vocab_size not in (None, 256):
        raise ValueError(f"--vocab-size {vocab_size} needs --tokenizer bpe (byte vocab is 256)")
    return _load_text(path, False, cache, tokenizer, vocab_size, val_fraction)


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return chunk[:, :-1], chunk[:, 1:]


def check_split(tokens: np.ndarray, seq_len: int, split: str) -> None:
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{split} split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}")


class BatchSampler:
    """Random windows of ``seq_len + 1`` tokens; the batch of step ``s`` depends only on (seed, s)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        check_split(tokens, seq_len, "train")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed

    def offsets(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0x5EED, step])
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def micro_batch(self, step: int, part: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Part ``part`` of ``parts`` equal slices of step ``step``'s global batch (inputs, targets)."""
        per = self.batch_size // parts
        return _windows(self.tokens, self.offsets(step)[part * per:(part + 1) * per], self.seq_len)


def eval_offsets(val: np.ndarray, seq_len: int, count: int, seed: int) -> np.ndarray:
    """A fixed set of held-out windows, chosen once from the seed (sorted for locality)."""
    check_split(val, seq_len, "val")
    rng = np.random.default_rng([seed, 0xE7A1])
    return np.sort(rng.integers(0, len(val) - seq_len, size=count))


def eval_batches(val: np.ndarray, offsets: np.ndarray, seq_len: int, batch_size: int):
    for i in range(0, len(offsets), batch_size):
        yield _windows(val, offsets[i:i + batch_size], seq_len)
