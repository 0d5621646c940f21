"""dobb_bench.provenance: a record names the revision (git's own, dirty on tracked edits
only), the machine and the command."""
import os
import subprocess

import torch

from dobb_bench import provenance as provenance_module
from dobb_bench.provenance import git_state, provenance


def test_provenance_names_revision_machine_and_command():
    p = provenance(["/x/dobb_bench/cli.py", "compare", "--steps", "5"])
    assert p["command"] == "dobb-bench compare --steps 5"
    assert p["torch"] == torch.__version__ and p["machine"]["cpu_count"] == os.cpu_count()
    assert git_state() == {"git_rev": p["git_rev"], "git_dirty": p["git_dirty"]}


def test_git_state_follows_tracked_edits_only(tmp_path, monkeypatch):
    """In a scratch repository: the revision is git's own, a tracked edit makes the tree dirty, an
    untracked file (a run output) does not."""
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    monkeypatch.setattr(provenance_module, "_SRC", tmp_path)
    state = git_state.__wrapped__  # uncached (the cached one holds the session's checkout)
    rev = git("rev-parse", "HEAD").strip()
    assert state() == {"git_rev": rev, "git_dirty": False}
    (tmp_path / "run.jsonl").write_text("{}\n")
    assert state() == {"git_rev": rev, "git_dirty": False}
    (tmp_path / "code.py").write_text("x = 2\n")
    assert state() == {"git_rev": rev, "git_dirty": True}
