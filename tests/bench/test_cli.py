"""The CLI as a careless user meets it (issue 20, deliverable 4): every mistake is one line with
exit code 2 (Ctrl-C: one line, exit 130), from every entry point, and no finished result is lost.

The behaviour under test is what a shell sees: the exit code, stderr and the files left in
``--out``. The entry points themselves (``python -m dobb_bench.cli``, the ``dobb-bench`` script,
``torchrun``), signals and killed processes are tested in subprocesses (``cli``); the other error
paths call ``main`` in this process (``run``), which is what both entry points run after start-up,
since a subprocess costs seconds of ``import torch`` each. Runs use a 1-layer width-32 model and a
few steps.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SMALL = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--steps", "3",
         "--batch-size", "4", "--eval-every", "3", "--eval-seqs", "4", "--no-progress"]
SCRIPT = Path(sys.executable).with_name("dobb-bench")


def cli(args, *, entry="module", timeout=180, env=None) -> subprocess.CompletedProcess:
    """Runs the CLI as a user would; ``entry``: ``module`` (python -m, torchrun's entry) or ``script``."""
    cmd = [sys.executable, "-m", "dobb_bench.cli"] if entry == "module" else [str(SCRIPT)]
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    e.pop("RANK", None), e.pop("WORLD_SIZE", None)
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=e)


def run(args) -> subprocess.CompletedProcess:
    """``dobb_bench.cli.main`` in this process, seen as a shell sees a run: exit code and stderr."""
    import contextlib
    import io

    from dobb_bench.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def one_line_error(proc, *phrases, code=2) -> str:
    """The run failed with ``code`` and exactly one stderr line, holding every phrase, no traceback."""
    err = proc.stderr.strip()
    assert proc.returncode == code, (proc.returncode, err[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    for p in phrases:
        assert p in err, (p, err)
    return err


@pytest.fixture
def data(text_dir, cache_dir):
    return ["--data", text_dir, "--cache-dir", cache_dir]


# ----- one error path ------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["module", "script"])
def test_user_error_is_one_line_exit_2_from_every_entry_point(entry, data):
    if entry == "script" and not SCRIPT.exists():
        pytest.skip("the dobb-bench script is not installed next to this interpreter")
    proc = cli(["train", "--optimizer", "nosuchopt", *data, *SMALL], entry=entry)
    one_line_error(proc, "dobb-bench train: error:", "nosuchopt")


@pytest.mark.slow  # a torchrun launch, like the other multi-process bench tests
def test_torchrun_without_dist_is_refused_once(tmp_path, data):
    """Two processes with --dist none would each train the whole model as "rank 0" into the same
    files; refused, and only rank 0 says so (one line from us, not one per rank)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "dobb_bench.cli", "train", "--optimizer", "adamw", *map(str, data), *SMALL,
           "--out", str(tmp_path / "o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode != 0
    ours = [x for x in proc.stderr.splitlines() if x.startswith("dobb-bench train:")]
    assert ours == ["dobb-bench train: error: torchrun started 2 processes but --dist is none: add "
                    "--dist ddp or --dist fsdp, or run without torchrun"], proc.stderr[-3000:]
    assert "dobb_bench/" not in proc.stderr  # no traceback through our code (torchrun prints its own)
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


# ----- sizes and optimizer hyperparameters -----------------------------------------------------------
@pytest.mark.parametrize("flag", ["--layers", "--context", "--width", "--heads"])
def test_non_positive_model_sizes_are_refused(flag, tmp_path, data):
    """``--layers 0`` used to fall through to the preset's value (0 is falsy) and train 2 layers."""
    args = ["train", "--optimizer", "adamw", *data, *SMALL, "--out", tmp_path / "o"]
    args[args.index(flag) + 1] = "0"
    one_line_error(run(args), f"{flag} must be a positive integer, got 0")
    assert not (tmp_path / "o").exists()


def test_negative_eval_seed_is_refused(tmp_path, data):
    args = ["train", "--optimizer", "adamw", *data, *SMALL, "--eval-seed", "-1", "--out", tmp_path / "o"]
    one_line_error(run(args), "--eval-seed must be >= 0, got -1")
    assert not (tmp_path / "o").exists()


def test_blocks_are_validated_on_the_real_model(tmp_path, data):
    """blocks=64 is valid at width 128 (64 blocks of 2) and was refused by a width-32 probe; at
    width 32 it is still refused, naming the matrix and its axis."""
    common = ["train", "--optimizer", "dobb", "--hp", "blocks=64", *data, *SMALL, "--steps", "1",
              "--eval-every", "1"]
    wide = common[:]
    wide[wide.index("--width") + 1] = "128"
    proc = run(wide + ["--out", tmp_path / "wide"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads((tmp_path / "wide" / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["type"] == "final" and final["hparams"] == {"blocks": "64"} and final["model"]["width"] == 128
    one_line_error(run(common + ["--out", tmp_path / "narrow"]), "blocks=64 is larger than the axis length 32")


# ----- finished results are never replaced by another configuration ------------------------------------
def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix in (".md", ".jsonl")}


def test_finished_compare_is_not_replaced_by_other_settings(tmp_path, data):
    from dobb_bench.cli import main

    out = tmp_path / "cmp"
    base = ["compare", "--optimizers", "adamw,adamw:betas=(0.9,0.9)@Other", *map(str, data), "--no-isolate",
            "--out", str(out), *SMALL]
    assert main(base) == 0
    before = _snapshot(out)
    assert "results.md" in before and "runs/Other/metrics.jsonl" in before
    steps4 = [x if x != "3" else "4" for x in base]  # --steps 4 --eval-every 4: one setting changed
    err = one_line_error(run(steps4), "holds a finished run with other settings", "train.steps: 3 there, 4 now",
                         "--out <new folder>", "--no-resume")
    assert str(out / "runs") in err
    # a command that drops a finished row would rewrite results.md without it
    one_line_error(run(base[:2] + ["adamw"] + base[3:]), "holds finished results for Other (lr 0.00354)")
    # train into the compare folder would replace its results.md
    one_line_error(run(["train", "--optimizer", "adamw", *data, *SMALL, "--out", out]),
                   "is a compare/sweep output folder", "use another --out")
    assert _snapshot(out) == before
    # the way out the message names: --no-resume retrains and replaces, on request
    proc = run(steps4 + ["--no-resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    finals = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [f["steps"] for f in finals if f["type"] == "final"] == [4, 4]


def test_finished_train_run_is_not_replaced_by_other_settings(tmp_path, data):
    from dobb_bench.cli import main

    out = tmp_path / "tr"
    base = ["train", "--optimizer", "adamw", *map(str, data), "--out", str(out), *SMALL]
    assert main(base) == 0
    assert main(base) == 0  # the same command again: the finished run is kept, not refused
    before = _snapshot(out)
    # --eval-seqs is outside the checkpoint's fingerprint: the finished run used to be re-finalised
    # with the new evaluation set and its record replaced
    seqs = base[:]
    seqs[seqs.index("--eval-seqs") + 1] = "8"
    one_line_error(run(seqs), "holds a finished run with other settings", "train.eval_seqs: 4 there, 8 now")
    one_line_error(run(["compare", "--optimizers", "adamw", "--no-isolate", *data, *SMALL, "--out", out]),
                   "holds a train run", "use another --out")
    assert _snapshot(out) == before


def test_out_that_cannot_be_a_folder_is_one_line(tmp_path, data):
    (tmp_path / "file").write_text("x")
    common = ["train", "--optimizer", "adamw", *data, *SMALL]
    one_line_error(run(common + ["--out", tmp_path / "file" / "sub"]), "is a file, not a folder",
                   str(tmp_path / "file" / "sub"), "choose another --out")
    # /sys refuses new folders even to root (the tests may run as root, for whom chmod is no barrier)
    one_line_error(run(common + ["--out", "/sys/dobb-bench-test"]), "/sys/dobb-bench-test", "choose another --out")


# ----- checkpoints that cannot be read ----------------------------------------------------------------
@pytest.mark.parametrize("damage", ["empty", "truncated", "random"])
def test_unreadable_checkpoint_is_one_line_naming_the_file(damage, tmp_path, data):
    """A damaged checkpoint.pt is not "could run code" (that is for a planted pickle: test_bench_train)."""
    from dobb_bench.cli import main

    out = tmp_path / "tr"
    args = ["train", "--optimizer", "adamw", *map(str, data), "--out", str(out), *SMALL]
    assert main(args + ["--stop-after", "1"]) == 0
    ckpt = out / "checkpoint.pt"
    whole = ckpt.read_bytes()
    ckpt.write_bytes({"empty": b"", "truncated": whole[: len(whole) // 2], "random": os.urandom(len(whole))}[damage])
    err = one_line_error(run(args), f"cannot resume from {ckpt}", "delete it to start the run over", "--no-resume")
    assert "could run code" not in err
    proc = run(args + ["--no-resume"])  # the way out the message names
    assert proc.returncode == 0, proc.stderr[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dcp_folder_without_complete_is_reported_not_restarted(tmp_path, data):
    """FSDP checkpoints are DCP folders; one without COMPLETE used to be skipped in silence and the
    run restarted at step 0. One process in a gloo group of one (what torchrun would set up)."""
    out = tmp_path / "fsdp"
    args = ["train", "--optimizer", "adamw", "--dist", "fsdp", *data, *SMALL, "--steps", "4", "--eval-every", "2",
            "--checkpoint-every", "2", "--out", out]

    def launch(extra=()):
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port())}
        cmd = [sys.executable, "-m", "dobb_bench.cli", *map(str, args), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **env})

    proc = launch(["--stop-after", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "checkpoint_dcp" / "COMPLETE").unlink()
    one_line_error(launch(), f"cannot resume from {out / 'checkpoint_dcp'}: it has no COMPLETE marker",
                   "--no-resume")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 2  # nothing was retrained over the run's progress


# ----- Ctrl-C and a killed parent ---------------------------------------------------------------------
LONG = [*SMALL, "--steps", "100000", "--eval-every", "20"]  # runs until stopped (tiny steps, ms each)


def _start(args, tmp_path):
    """The CLI in its own session (so a signal to its process group is what a terminal's Ctrl-C does)."""
    cmd = [sys.executable, "-m", "dobb_bench.cli", *map(str, args)]
    # SIGINT back to its default as in a terminal's foreground job: a suite started in the background
    # of a non-interactive shell (`pytest &`) runs with SIGINT ignored, which children inherit, and
    # a CLI that ignores Ctrl-C then trains on, rightly, until the test times out
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(path: Path, proc, timeout=240):
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.2)


def _training_children(parent: int) -> list[int]:
    """Pids of ``parent``'s multiprocessing-spawned children (not its resource tracker)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _checkpoint_step(path: Path) -> int:
    import torch

    return torch.load(path, weights_only=True)["step"]


def test_ctrl_c_stops_train_with_one_line_and_a_resumable_checkpoint(tmp_path, data):
    out = tmp_path / "tr"
    proc = _start(["train", "--optimizer", "adamw", *data, *LONG, "--out", out], tmp_path)
    _wait_for(out / "metrics.jsonl", proc)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    one_line_error(subprocess.CompletedProcess([], proc.returncode, "", err), "interrupted (SIGINT) after step",
                   f"with a checkpoint in {out}", "rerun the same command to resume", code=130)
    step = int(err.split("after step ")[1].split(",")[0])
    assert step >= 1 and _checkpoint_step(out / "checkpoint.pt") == step  # checkpointing was off (--checkpoint-every 0)
    evals = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert evals[0]["step"] == 0 and all(e["type"] == "eval" for e in evals)  # partial results kept


def test_ctrl_c_stops_compare_and_its_child_with_one_line(tmp_path, data):
    out = tmp_path / "cmp"
    proc = _start(["compare", "--optimizers", "adamw", "--isolate", "--jobs", "1", *data, *LONG, "--out", out],
                  tmp_path)
    _wait_for(out / "runs" / "AdamW" / "metrics.jsonl", proc)
    kids = _training_children(proc.pid)
    assert len(kids) == 1
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: parent and child alike
    _, err = proc.communicate(timeout=120)
    one_line_error(subprocess.CompletedProcess([], proc.returncode, "", err), "interrupted: 0 of 1 runs finished",
                   "stopped with a checkpoint", "rerun the same command to resume", code=130)
    assert not _alive(kids[0])
    assert _checkpoint_step(out / "runs" / "AdamW" / "checkpoint.pt") >= 1


def test_ctrl_c_stops_an_in_process_compare_with_one_line(tmp_path, data):
    out = tmp_path / "cmp"
    proc = _start(["compare", "--optimizers", "adamw", "--no-isolate", *data, *LONG, "--out", out], tmp_path)
    _wait_for(out / "runs" / "AdamW" / "metrics.jsonl", proc)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    one_line_error(subprocess.CompletedProcess([], proc.returncode, "", err), "interrupted: run 'AdamW' stopped after step",
                   f"with a checkpoint in {out / 'runs' / 'AdamW'}", "rerun the same command to resume", code=130)
    step = int(err.split("after step ")[1].split(" ")[0])
    assert step >= 1 and _checkpoint_step(out / "runs" / "AdamW" / "checkpoint.pt") == step


def test_sigkilled_compare_parent_takes_its_child_down(tmp_path, data):
    out = tmp_path / "cmp"
    proc = _start(["compare", "--optimizers", "adamw", "--isolate", "--jobs", "1", *data, *LONG, "--out", out],
                  tmp_path)
    metrics = out / "runs" / "AdamW" / "metrics.jsonl"
    _wait_for(metrics, proc)
    kids = _training_children(proc.pid)
    assert len(kids) == 1
    try:
        proc.kill()  # SIGKILL: the parent gets no chance to clean up
        proc.communicate(timeout=60)
        t0 = time.monotonic()
        while _alive(kids[0]) and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        assert not _alive(kids[0]), "the training child outlived its SIGKILLed parent"
        size = metrics.stat().st_size
        time.sleep(2.0)
        assert metrics.stat().st_size == size  # nothing writes into --out any more
    finally:
        for pid in kids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ----- report: all or nothing, into the docs folder it is given ---------------------------------------------
def _rec(run, loss, seed, **kw):
    return {"run": run, "optimizer": run.lower(), "hparams": {}, "lr": 1e-3, "seed": seed, "steps": 10,
            "final_val_loss": loss, "diverged": False, "model": {"width": 128, "layers": 2},
            "train": {"batch_size": 4, "micro_batches": 1}, "corpus": {"name": "c"},
            "provenance": {"git_rev": "abc1234", "git_dirty": False, "machine": {}}, **kw}


def test_report_checks_every_record_before_writing_and_writes_only_its_docs_folder(tmp_path, monkeypatch):
    """a.md sorts before z.md: a bad record behind z.md's table used to surface (as a traceback) only
    after a.md had been rewritten; and report had no way to leave the checkout's docs/ alone."""
    from dobb_bench.reports import records as R

    monkeypatch.setattr(R, "DOCS", R.DOCS)  # report --docs moves them; restored after the test
    monkeypatch.setattr(R, "RECORDS", R.RECORDS)
    docs = tmp_path / "docs"
    (docs / "results" / "records").mkdir(parents=True)
    stale = {"a.md": "# A\n<!-- table:main-job -->\nstale\n<!-- /table -->\n",
             "z.md": "# Z\n<!-- table:muon-fp32 -->\nstale\n<!-- /table -->\n"}
    for name, text in stale.items():
        (docs / name).write_text(text)

    def records(study, recs):
        (docs / "results" / "records" / f"{study}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    records("main-job", [_rec("AdamW", 2.0, 0), _rec("Muon", 1.5, 0)])
    bad = _rec("Muon", 1.6, 1)
    del bad["lr"]
    records("muon-fp32", [_rec("Muon", 1.5, 0), bad])
    one_line_error(run(["report", "--docs", docs]), f"{docs / 'results' / 'records' / 'muon-fp32.jsonl'}:2",
                   "has no 'lr'", "fix or remove that line")
    assert {n: (docs / n).read_text() for n in stale} == stale  # nothing written
    records("muon-fp32", [_rec("Muon", 1.5, 0), _rec("Muon", 1.6, 1)])
    proc = run(["report", "--docs", docs])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in stale:
        text = (docs / name).read_text()
        assert "stale" not in text and "| optimizer" in text, text
    assert "| Muon | 0.001 | — | 0,1 | 1.550 ± 0.071 |" in (docs / "z.md").read_text()  # mean, std of 1.5, 1.6
    one_line_error(run(["report", "--docs", tmp_path / "nope"]), "--docs", "no such folder")
