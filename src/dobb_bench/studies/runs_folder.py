"""What a study has run: one ``--out`` folder per run, ``{root}/{kind}-{slug}-j{j}-s{seed}``.

A finished run is one whose folder holds its final loss (compare's ``results.jsonl``, or the final
record of a script runner's ``runs/*/metrics.jsonl``) or one the re-evaluation records hold (the
folder of an earlier session may be gone); ``dobb_bench.studies.define`` reads it for the rule.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Iterable


def slug(label: str) -> str:
    """A row label as its run folders name it (the running grid's folders: never change it). A slash
    goes too: it would nest the folder, and the re-evaluation names a run by its folder's last part,
    which two kinds' folders of one row would share."""
    return label.replace(" ", "").replace("=", "").replace("-", "").replace("/", "")


def _nested_slug(label: str) -> str:
    """What ``slug`` made of a label with a slash before it dropped the slash (Dion2's ``1/4``): the
    committed re-evaluations of those runs name their folder's path under the runs folder."""
    return label.replace(" ", "").replace("=", "").replace("-", "")


def _last(path: str) -> dict:
    """The last record of a JSON-lines file ({} when empty)."""
    lines = [x for x in open(path).read().splitlines() if x.strip()]
    return json.loads(lines[-1]) if lines else {}


class RunsFolder:
    """The runs of one or more studies under ``root``: each run its own ``--out``; the common-window
    losses from the re-evaluation records ``reeval`` (lines with ``run_dir``, ``common_val_loss``
    and ``common_groups``). Read at every call: other workers write while the rule reads."""

    def __init__(self, root: str, reeval: Iterable[str] = ()):
        self.root = str(root)
        self.reeval = list(reeval)
        self._cache: dict = {}

    @classmethod
    def of(cls, runs: str, repo: str) -> "RunsFolder":
        """``runs`` with its re-evaluation records: ``repo``'s committed one and the folder's scratch
        (where ``Driver.reeval`` writes)."""
        return cls(runs, [f"{repo}/docs/results/checks/reeval-windows/reeval.jsonl", f"{runs}/reeval-scratch.jsonl"])

    def out_dir(self, kind: str, label: str, j: int, seed: int) -> str:
        return f"{self.root}/{kind}-{slug(label)}-j{j}-s{seed}"

    def loss(self, kind: str, label: str, j: int, seed: int) -> float | None:
        """The logged final loss of a finished run (inf when it diverged), None when not finished:
        compare's ``results.jsonl``, else the final record of its ``runs/*/metrics.jsonl``. A run
        whose folder is gone (an earlier session's) counts as finished when a re-evaluation record
        holds it: the grid resumes from what is committed."""
        d = self.out_dir(kind, label, j, seed)
        for f in glob.glob(d + "/results.jsonl"):
            for line in open(f):
                r = json.loads(line)
                if "final_val_loss" in r:
                    return float("inf") if r.get("diverged") else r["final_val_loss"]
        if not os.path.exists(d + "/results.jsonl"):
            # a script runner's run (``define.RUNNERS``) writes no results.jsonl: its final record
            for f in sorted(glob.glob(d + "/runs/*/metrics.jsonl")):
                r = _last(f)
                if r.get("type") == "final":
                    v = r.get("final_val_loss")
                    return float("inf") if r.get("diverged") or v is None or v != v else v
        r = self._reeval(kind, label, j, seed)
        return None if r is None else r.get("logged_val_loss")

    def _reeval(self, kind, label, j, seed) -> dict | None:
        """The first re-evaluation record of the run (files in order, lines in order)."""
        names = [os.path.basename(self.out_dir(kind, label, j, seed))]
        if "/" in label:
            names.append(f"{kind}-{_nested_slug(label)}-j{j}-s{seed}")
        for f in self.reeval:
            for name in names:
                r = self._index(f).get(name)
                if r is not None:
                    return r
        return None

    def _index(self, path: str) -> dict:
        """``{run_dir: first record}`` of one re-evaluation file, re-read when the file changes."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return {}
        key = (st.st_mtime_ns, st.st_size)
        got = self._cache.get(path)
        if got is None or got[0] != key:
            index: dict = {}
            with open(path) as fh:
                for line in fh:
                    if line.strip():
                        r = json.loads(line)
                        # the studies pin fp32 products (``Setting.args``): a run made with bf16
                        # products is another row, not a finished run of this one
                        if "bfloat16" not in json.dumps(r.get("hparams", {})):
                            index.setdefault(r.get("run_dir"), r)
            got = self._cache[path] = (key, index)
        return got[1]

    def common(self, kind: str, label: str, j: int, seed: int) -> float | None:
        """A finished run's loss on the common windows, if re-evaluated."""
        r = self._reeval(kind, label, j, seed)
        return None if r is None else r["common_val_loss"]

    def groups(self, kind: str, label: str, j: int, seed: int) -> list[float] | None:
        """A re-evaluated run's loss per window group (the pairing of a gap's standard error)."""
        r = self._reeval(kind, label, j, seed)
        return None if r is None else r.get("common_groups")
