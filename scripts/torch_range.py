"""Run the core test subset on another torch and write a record of the result.

The library calls a few private torch APIs (``AdamW._init_group``, ``torch._C._current_graph_task_id``,
``_StridedShard``, ``torch.optim._muon``), so the torch range declared in ``pyproject.toml`` is what
this script has passed on. CI runs the whole suite on the pinned torch; this covers the bounds, whose
CPU wheels on the registry are multi-GB CUDA builds (too slow to install in CI).

    python3 -m venv /tmp/venv-2.7.0 && /tmp/venv-2.7.0/bin/pip install torch==2.7.0 pytest \\
        pytest-timeout hypothesis numpy
    python scripts/torch_range.py /tmp/venv-2.7.0/bin/python docs/results/checks/torch-range/

The record (``torch-<version>.json``) names the torch, the revision (clean or not), the machine,
the command, the test files and the pass/fail/skip counts from pytest's JUnit XML.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The core subset: the kernels, the optimizer class and its state, capture hooks (a private
# autograd call), the AdamW path (torch's private _init_group), the registry and factory, Muon
# (torch.optim._muon where present), sharding (DTensor placements, _StridedShard), FSDP2, TP and
# distributed checkpoints on gloo.
CORE = ["tests/test_functional.py", "tests/core/test_optimizer.py", "tests/test_base.py", "tests/test_capture.py",
        "tests/test_sharding.py", "tests/test_registry.py", "tests/test_factory.py",
        "tests/baselines/muon_family/test_muon.py", "tests/distributed/test_fsdp.py",
        "tests/distributed/test_tensor_parallel.py", "tests/distributed/test_checkpoint.py"]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("python", help="the interpreter of a venv with the torch to test (and pytest)")
    p.add_argument("out", help="folder for torch-<version>.json")
    args = p.parse_args()
    version = subprocess.run([args.python, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "900",
               f"--junitxml={xml}", *CORE]
        t0 = time.perf_counter()
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
        skipped = sorted({(c.find("skipped").get("message") or "")[:160] for c in suite.iter("testcase")
                          if c.find("skipped") is not None})
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    record = {
        "torch": version, "git_rev": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "command": " ".join(["python", "scripts/torch_range.py", *sys.argv[1:]]),
        "pytest": " ".join(cmd[1:-len(CORE)]), "files": CORE, **counts,
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed_tests": failed, "skip_reasons": skipped, "returncode": run.returncode, "wall_s": round(wall, 1),
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "native_bf16": "avx512_bf16" in flags or "amx_bf16" in flags,
                    "python": platform.python_version()},
        "tail": run.stdout[-1500:],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"torch-{version.split('+')[0]}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"torch {version}: {record['passed']} passed, {counts['failures'] + counts['errors']} failed, "
          f"{counts['skipped']} skipped in {wall:.0f} s -> {out}")
    return 0 if run.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
