"""The dev setup (scripts/dev_setup.sh) installs the repository's git hooks, and .githooks/commit-msg
refuses a subject over 72 characters, counted in characters, comment lines and blank lines before it
skipped, while a body line may be longer."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=check)


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    shutil.copytree(ROOT / ".githooks", tmp_path / ".githooks")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "dev_setup.sh", tmp_path / "scripts")
    out = subprocess.run(["sh", "scripts/dev_setup.sh"], cwd=tmp_path, env=dict(os.environ, NO_INSTALL="1",
                         GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1"), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert _git(tmp_path, "config", "--get", "core.hooksPath").stdout.strip() == ".githooks"
    return tmp_path


def _commit(repo: Path, message: str) -> subprocess.CompletedProcess:
    (repo / "f").write_text(message)
    _git(repo, "add", "f")
    path = repo.parent / f"{repo.name}-msg"
    path.write_text(message)
    return _git(repo, "commit", "-q", "--cleanup=strip", "-F", str(path), check=False)


def test_the_hook_refuses_a_subject_over_72_characters(repo):
    ok = "x" * 72
    assert _commit(repo, ok + "\n\n" + "a body line may be longer than the subject may: " * 3 + "\n").returncode == 0
    out = _commit(repo, "y" * 73 + "\n")
    assert out.returncode != 0 and "73 characters" in out.stderr
    assert _commit(repo, "# a comment\n\n" + "z" * 73 + "\n").returncode != 0  # the subject is the first text line
    assert _commit(repo, "é" * 72 + "\n").returncode == 0  # characters, not bytes
    assert _git(repo, "log", "--format=%s").stdout.splitlines() == ["é" * 72, "x" * 72]
