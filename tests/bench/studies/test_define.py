"""dobb_bench.studies.define: the bracket-and-seed rule on fake runs folders, the driver end to end
with a fake compare, the commands and folder names scripts/long_horizon.py has always used, the
paired t-test shared by the tables, and `dobb-bench study`."""
import json
import runpy
import sys
import types
from pathlib import Path

import pytest

from dobb_bench.cli import main as cli_main
from dobb_bench.studies import define as D
from dobb_bench.studies import long_horizon as L
from dobb_bench.studies import long_horizon_runs as H
from dobb_bench.studies import shard_local as S

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "long_horizon.py"
PATTERN = (-0.02, 0.02, -0.01, 0.01)  # window groups: the same pattern for every run is no window noise


def _finish(runs, kind, label, j, seed, loss, pattern=PATTERN):
    """A finished run in a fake runs folder, re-evaluated on four window groups."""
    d = Path(runs.out_dir(kind, label, j, seed))
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.jsonl").write_text(json.dumps({"final_val_loss": loss + 0.001}) + "\n")
    scratch = Path(runs.root) / "reeval-scratch.jsonl"
    with scratch.open("a") as f:
        f.write(json.dumps({"run_dir": d.name, "common_val_loss": loss,
                            "common_groups": [loss + e for e in pattern]}) + "\n")


def _folder(tmp_path):
    return D.RunsFolder.of(str(tmp_path / "runs"), str(tmp_path / "repo"))


def _study(rows, **kw):
    return D.Study("t", H.TWENTY_TOKENS, tuple(rows), **kw)


def _next(study, runs):
    d = D.Driver(runs, "wt", H.SETTINGS)
    t = D.rule(study)(d)
    return None if t is None else (t[1].label, t[2], t[3])


def test_commands_and_folders_are_those_of_the_running_grid(tmp_path):
    """Byte for byte the --out folders scripts/long_horizon.py has always written (a running grid
    is re-pointed at this code: a changed name would rerun finished runs) and the command lines,
    which pin fp32 products as the study's first runs had them."""
    d = D.Driver(D.RunsFolder("/work/runs/fr"), "wt", H.SETTINGS)
    row = next(r for r in H.FR if r.label == "Two-sided B=4 Bo=4")
    assert " ".join(d.command(("lh", row, -3, 0))) == (
        "dobb-bench compare --jobs 1 --layers 2 --context 64 --no-progress --checkpoint-every 500 --steps 8300 "
        "--eval-every 250 --product-dtype float32 --seed 0 --lr 0.001767766952966369 --out /work/runs/fr/lh-TwosidedB4Bo4-j-3-s0 "
        "--optimizers dobb:side=both:blocks=4:out_blocks=4@Two-sided B=4 Bo=4")
    row = next(r for r in H.W256 if r.label == "Row-block Muon R=4")
    assert " ".join(d.command(("w256", row, 3, 1))) == (
        "dobb-bench compare --jobs 1 --layers 2 --context 64 --no-progress --checkpoint-every 500 --width 256 "
        "--steps 3200 --eval-every 200 --product-dtype float32 --seed 1 --lr 0.014142135623730952 --out /work/runs/fr/w256-RowblockMuonR4-j3-s1 "
        "--optimizers block-muon:axis=0:blocks=4@Row-block Muon R=4")
    assert [r.label for r in H.W256] == ["AdamW", "Muon", "Row-block Muon R=4", "Dobb B=1", "Two-sided B=1 Bo=4"]
    fr = H.STUDIES["frontier-20"]
    lrs = {r.label: fr.first_lrs(r) for r in fr.rows}
    assert lrs["Dobb B=4"] == lrs["Two-sided B=4 Bo=4"] == [-3, -4, -2]  # 800-step best less 2
    assert lrs["MuonBP R=4 P=10"] == [4, 3, 5] and lrs["SPlus Bo=4 authors"] == [6, 5, 7] and lrs["Dobb-Muon B=4 Bo=4"] == [0, -1, 1]


def test_rule_centre_neighbours_out_then_seeds(tmp_path):
    runs = _folder(tmp_path)
    a, b = D.Row("A", "adamw", 0), D.Row("B", "muon", 4)
    st = _study([a, b], shift=1)
    assert _next(st, runs) == ("A", -1, 0)
    _finish(runs, "lh", "A", -1, 0, 1.30)
    assert _next(st, runs) == ("B", 3, 0)  # every row's centre before any neighbour
    _finish(runs, "lh", "B", 3, 0, 1.40)
    assert _next(st, runs) == ("A", -2, 0)  # the lower neighbours, then the upper
    _finish(runs, "lh", "A", -2, 0, 1.29)
    _finish(runs, "lh", "B", 2, 0, 1.41)
    assert _next(st, runs) == ("A", 0, 0)
    _finish(runs, "lh", "A", 0, 0, 1.31)
    _finish(runs, "lh", "B", 4, 0, 1.42)
    assert _next(st, runs) == ("A", -3, 0)  # A's best at its lower edge: one step out; B is bracketed
    _finish(runs, "lh", "A", -3, 0, 1.32)
    assert _next(st, runs) == ("A", -2, 1)  # A bracketed at -2 now: seed 1 at each row's best
    _finish(runs, "lh", "A", -2, 1, 1.29)
    assert _next(st, runs) == ("B", 3, 1)
    _finish(runs, "lh", "B", 3, 1, 1.40)
    assert _next(st, runs) == ("A", -2, 2)
    _finish(runs, "lh", "A", -2, 2, 1.29)
    assert _next(st, runs) == ("B", 3, 2)
    _finish(runs, "lh", "B", 3, 2, 1.40)
    assert _next(st, runs) is None
    assert [s["chosen"] for s in D.plan_status(st, runs)] == [-2, 3]


def test_a_neighbour_within_the_window_noise_gets_seed_1_and_the_mean_chooses(tmp_path):
    runs = _folder(tmp_path)
    a = D.Row("A", "adamw", 0)
    st = _study([a])
    noisy = (-0.03, 0.03, 0.02, -0.02)  # against PATTERN: group gaps -.01 +.01 +.03 -.03, SE 0.0129
    _finish(runs, "lh", "A", 0, 0, 1.300)
    _finish(runs, "lh", "A", -1, 0, 1.310, noisy)  # worse by 0.010 < 2 SE: close
    _finish(runs, "lh", "A", 1, 0, 1.330, noisy)  # worse by 0.030 > 2 SE: not close
    assert D.close_neighbours(runs, "lh", a, 0) == [-1]
    assert D.chosen_j(runs, "lh", a) is None  # waits for the seed-1 runs
    assert _next(st, runs) == ("A", 0, 1)
    _finish(runs, "lh", "A", 0, 1, 1.320)
    assert _next(st, runs) == ("A", -1, 1) and D.chosen_j(runs, "lh", a) is None
    _finish(runs, "lh", "A", -1, 1, 1.300)  # mean 1.305 < 1.310: the neighbour is chosen
    assert D.chosen_j(runs, "lh", a) == -1
    assert _next(st, runs) == ("A", -1, 2)
    _finish(runs, "lh", "A", -1, 2, 1.300)
    assert _next(st, runs) is None
    # one lr short of its common-window record: judged on the logged losses, no neighbour called close
    Path(runs.out_dir("lh", "A", 2, 0)).mkdir(parents=True)
    (Path(runs.out_dir("lh", "A", 2, 0)) / "results.jsonl").write_text(json.dumps({"final_val_loss": 2.0}) + "\n")
    assert D.best_j(runs, "lh", a) == ([-1, 0, 1, 2], 0)


def test_the_paired_t_test_is_one_function(monkeypatch):
    """shard_local's paired gaps and long_horizon's mean over seeds both call define.beyond_noise."""
    assert S.paired_gap([1.026, 1.033, 1.015], [1.0, 1.0, 1.0])[2] is True
    assert S.paired_gap([1.005, 1.049, 1.047], [1.0, 1.0, 1.0])[2] is False  # t = 2.4 < 4.303
    muon = {"run": "Muon", "lr": 0.01, "common_groups": [1.0, 1.0]}
    best = {"run": "X", "lr": 0.01, "common_groups": [1.05, 1.05]}
    later = {(1, 2, "X", 0.01): {s: {"common_groups": [1.0 + g] * 2} for s, g in ((1, 0.01), (2, 0.09))},
             (1, 2, "Muon", 0.01): {s: {"common_groups": [1.0] * 2} for s in (1, 2)}}
    assert L._later_seeds(later, 1, 2, best, muon)[0].endswith("within seed noise")
    monkeypatch.setattr(D, "T95", {})  # 1.96 for every n: both verdicts move together
    assert S.paired_gap([1.005, 1.049, 1.047], [1.0, 1.0, 1.0])[2] is True
    assert L._later_seeds(later, 1, 2, best, muon)[0].endswith("beyond seed noise")


def _fake_compare(monkeypatch, opt):
    """Driver.run and .reeval without compare: a run's loss is a parabola in j around ``opt[label]``."""
    done, specs = [], []

    def run(self, task):
        kind, row, j, seed = task
        done.append((row.label, j, seed))
        specs.append(self.command(task)[-1])  # the --optimizers spec@label
        d = Path(self.runs.out_dir(kind, row.label, j, seed))
        d.mkdir(parents=True, exist_ok=True)
        (d / "results.jsonl").write_text(json.dumps({"final_val_loss": 1.3 + 0.01 * (j - opt.get(row.label, j)) ** 2}) + "\n")

    def reeval(self, d):
        # the folder names as the driver writes them ("Dion2 1/4 ..." nests one folder deeper)
        where = {self.runs.out_dir("lh", r.label, j, s): (r.label, j) for r in H.FR + H.LH for j in range(-9, 12)
                 for s in (0, 1, 2)}
        label, j = where[d]
        loss = 1.3 + 0.01 * (j - opt.get(label, j)) ** 2
        with open(Path(self.runs.root) / "reeval-scratch.jsonl", "a") as f:
            f.write(json.dumps({"run_dir": Path(d).name, "common_val_loss": loss,
                                "common_groups": [loss + e for e in PATTERN]}) + "\n")

    real = D.time.sleep
    monkeypatch.setattr(D, "time", types.SimpleNamespace(sleep=lambda s: real(0.01)))  # a worker waiting on the other
    monkeypatch.setattr(D.Driver, "run", run)
    monkeypatch.setattr(D.Driver, "reeval", reeval)
    return done, specs


def test_the_script_drives_the_frontier_rule_to_the_end(tmp_path, monkeypatch, capsys):
    """scripts/long_horizon.py WORKTREE RUNS frontier, with a fake compare: every row bracketed on two
    workers, then seeds 1 and 2 at its best; a rerun starts nothing."""
    st = H.STUDIES["frontier-20"]
    opt = {r.label: st.centre(r) - 2 + i % 2 for i, r in enumerate(H.FR)}  # some two steps out, some one
    done, specs = _fake_compare(monkeypatch, opt)
    runs = tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", ["long_horizon.py", str(tmp_path / "wt"), str(runs), "frontier"])
    monkeypatch.setenv("RECORDS_REPO", str(tmp_path))  # not this checkout's committed runs
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert e.value.code == 0 and "DRIVER_DONE" in capsys.readouterr().out
    assert len(done) == len(set(done))
    # FR's centres, then the third seeds of the earlier two-seed rows (fp32 products), then the rest
    centres = {(r.label, st.centre(r), 0) for r in H.FR}
    n_fr = len(H.FR)
    assert set(done[:n_fr]) == centres
    # then Dobb-Muon's group through the rule, the third seeds, and the later groups after both
    third = {(label, j, 2) for label, j in H.LH_SEED2}
    assert third <= set(done)
    later = [i for i, (label, j, sd) in enumerate(done) if i >= n_fr and (label, j, sd) not in third
             and label != "Dobb-Muon B=4 Bo=4"]
    first_dm = min(i for i, t in enumerate(done) if i >= n_fr and t[0] == "Dobb-Muon B=4 Bo=4")
    assert first_dm == n_fr and max(done.index(t) for t in third) < min(later)
    for r in H.FR:
        mine = {(j, s) for label, j, s in done if label == r.label}
        o, c = opt[r.label], st.centre(r)
        assert mine == {(j, 0) for j in range(o - 1, c + 2)} | {(o, 1), (o, 2)}
    n = len(done)
    with pytest.raises(SystemExit):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert len(done) == n
    assert "block-muon:axis=0:blocks=4:ns_dtype=float32@Row-block Muon R=4" in specs and "adamw@AdamW" in specs
    # the same folder as a study: status and its CLI
    folder = D.RunsFolder.of(str(runs), str(tmp_path))
    assert [s["chosen"] for s in D.plan_status(st, folder)] == [opt[r.label] for r in H.FR]
    assert cli_main(["study", "frontier-20", "status", "--runs", str(runs), "--repo", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"Dobb B=4: best j{opt['Dobb B=4']}, bracketed; chosen j{opt['Dobb B=4']}, seeds [0, 1, 2]" in out


def test_collect_adds_each_finished_run_of_the_study(tmp_path, monkeypatch):
    runs = _folder(tmp_path)
    st = H.STUDIES["frontier-20"]
    for label, j in (("Dobb B=4", -3), ("DASH 32", -1), ("Muon", 2)):  # Muon: not a row of this study
        d = Path(runs.out_dir("lh", label, j, 0))
        (d / "runs" / "x").mkdir(parents=True)
        (d / "runs" / "x" / "metrics.jsonl").write_text("")
        (d / "results.jsonl").write_text('{"final_val_loss": 1.0}\n')
    Path(runs.out_dir("lh", "DASH 32", -2, 0)).mkdir(parents=True)  # not finished
    calls = []
    from dobb_bench.reports import records
    monkeypatch.setattr(records, "collect", lambda d, study, rd=None, runs=None: calls.append((Path(d).name, study, runs)) or [1])
    assert D.collect(st, runs) == [1, 1]
    assert calls == [("lh-DobbB4-j-3-s0", "long-horizon", ["Dobb B=4"]), ("lh-DASH32-j-1-s0", "long-horizon", ["DASH 32"])]


def test_lrs_as_values_and_off_grid():
    assert D.grid_index(0.01) == 2 and D.grid_index(0.0035355) == -1
    with pytest.raises(ValueError, match="not on the grid"):
        D.grid_index(0.006)
    st = _study([D.Row("A", "adamw", 0)], lrs=(0.01, 0.005))
    assert st.first_lrs(st.rows[0]) == [2, 0]


def test_the_reeval_step_is_the_one_the_grid_has_always_run(tmp_path, monkeypatch):
    """Every finished run re-evaluated by scripts/reeval_windows.py of the re-evaluation worktree,
    into the runs folder's scratch record, with the script's default windows unless a study asks
    for others; a run without results is not re-evaluated."""
    calls = []
    monkeypatch.setattr(D.subprocess, "run", lambda args, **kw: calls.append((args, kw)))
    runs = D.RunsFolder(str(tmp_path / "runs"))
    d = runs.out_dir("lh", "Dobb B=4", -3, 0)
    D.Driver(runs, "/wt", H.SETTINGS, "/re").reeval(d)
    assert calls == []
    Path(d).mkdir(parents=True)
    (Path(d) / "results.jsonl").write_text("{}\n")
    D.Driver(runs, "/wt", H.SETTINGS, "/re").reeval(d)
    (args, kw), = calls
    assert args == [sys.executable, "scripts/reeval_windows.py", d, "--out", f"{tmp_path}/runs/reeval-scratch.jsonl"]
    assert kw["cwd"] == "/re" and kw["env"]["PYTHONPATH"] == "/re/src" and kw["env"]["OMP_NUM_THREADS"] == "1"
    D.Driver(runs, "/wt", H.SETTINGS, "/re", windows=(512, 7)).reeval(d)
    assert calls[1][0][-4:] == ["--windows", "512", "--window-seed", "7"]


def test_a_restarted_driver_adopts_the_runs_left_running(tmp_path, monkeypatch):
    """A run an earlier driver left running is waited for and re-evaluated, never started again, and
    the worker that waits on it keeps the other from finishing while its result may ask for more."""
    done, _ = _fake_compare(monkeypatch, {r.label: r.j - 2 for r in H.FR})
    row = H.FR[0]
    runs = D.RunsFolder.of(str(tmp_path / "runs"), str(tmp_path))
    left = runs.out_dir("lh", row.label, row.j - 2, 0)
    polls = iter([True, True, False])

    def alive(self, d):
        assert d == left
        up = next(polls)
        if not up:  # the earlier driver's run ends: its results appear
            D.Driver.run(self, ("lh", row, row.j - 2, 0))
        return up
    monkeypatch.setattr(D.Driver, "left_running", lambda self: [left])
    monkeypatch.setattr(D.Driver, "alive", alive)
    d = D.Driver(runs, "wt", H.SETTINGS, wait_s=0.01)
    d.drive(H.PICKS["frontier"])
    assert done.count((row.label, row.j - 2, 0)) == 1  # once, by the "earlier driver"
    assert (row.label, row.j - 2, 1) in done and (row.label, row.j - 2, 2) in done


def test_committed_records_resume_the_grid_and_bf16_runs_are_other_rows(tmp_path):
    """A run whose folder is gone (an earlier session's) is finished when the committed re-evaluation
    record holds it, so a new runs folder does not rerun it; a record made with bf16 products does
    not stand for the study's fp32 run of the same name."""
    repo = tmp_path / "repo"
    rec = repo / "docs/results/checks/reeval-windows"
    rec.mkdir(parents=True)
    row = D.Row("B", "dobb:blocks=4", 3)
    runs = D.RunsFolder.of(str(tmp_path / "runs"), str(repo))
    fp32 = {"run_dir": "lh-B-j3-s0", "hparams": {"blocks": "4"}, "logged_val_loss": 1.5,
            "common_val_loss": 1.4, "common_groups": [1.4, 1.4]}
    bf16 = {"run_dir": "lh-B-j4-s0", "hparams": {"blocks": "4", "product_dtype": "torch.bfloat16"},
            "logged_val_loss": 1.3, "common_val_loss": 1.2, "common_groups": [1.2, 1.2]}
    (rec / "reeval.jsonl").write_text(json.dumps(fp32) + "\n" + json.dumps(bf16) + "\n")
    assert runs.loss("lh", "B", 3, 0) == 1.5 and runs.common("lh", "B", 3, 0) == 1.4
    assert runs.loss("lh", "B", 4, 0) is None and runs.common("lh", "B", 4, 0) is None
    # the rule starts the centre's neighbours, never the committed centre; the bf16 lr is run again
    st = _study([row], lrs=(0, 1, -1))
    assert _next(st, runs) == ("B", 4, 0)
    assert D.Study("t", H.TWENTY_TOKENS, (row._replace(centre=5),)).first_lrs(row._replace(centre=5)) == [5, 4, 6]
