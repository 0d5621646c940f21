"""dobb_bench.studies.long_horizon: the tables against hand-built records (ranks both ways, best lr,
bracketing, seeds at the best lr, the 800-step references, the common windows), and
scripts/reeval_windows.py, which writes the common-windows record, on a real tiny run, and
the orders of the grid's bracket and close modes over a fake runs folder (the rule itself:
test_define.py)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dobb_bench.cli import main as cli_main
from dobb_bench.studies import define as D
from dobb_bench.studies import long_horizon as L
from dobb_bench.studies import long_horizon_runs as H


def _rec(run, lr, loss, seed=0, steps=8300, width=128, diverged=False):
    return {"run": run, "lr": lr, "seed": seed, "steps": steps, "final_val_loss": loss, "diverged": diverged,
            "model": {"layers": 2, "width": width, "seq_len": 64},
            "train": {"batch_size": 16, "micro_batches": 1, "weight_decay": 0.1, "schedule": "cosine"},
            "corpus": {"name": "stdlib"}, "provenance": {"git_rev": "abcdef0", "machine": {"cpu": "X"}}}


def test_table_ranks_both_horizons_and_marks_edges(monkeypatch):
    short = {"AdamW": {(0.005, 0): {"final_val_loss": 2.0}}, "Muon-fp32": {(0.01, 0): {"final_val_loss": 1.6}}}
    monkeypatch.setattr(L, "runs_of", lambda label, studies: short.get(label, {}))
    recs = [_rec("AdamW", 0.005, 1.40), _rec("AdamW", 0.00354, 1.45), _rec("AdamW", 0.00707, 1.42),
            _rec("Muon", 0.01, 1.50), _rec("Muon", 0.0141, 1.48), _rec("Muon", 0.0141, 1.47, seed=1),
            _rec("AdamW", 0.005, 1.43, seed=1), _rec("AdamW", 0.005, 1.41, seed=2),
            _rec("Muon", 0.01, 9.0, width=256)]  # another setting: not in this table
    monkeypatch.setattr(L.R, "load", lambda study: recs if study == L.STUDY else [])
    text, used = L.long_horizon()
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    # AdamW: 800-step rank 2 (2.0 > 1.6), long rank 1 (1.40 < 1.48); best 0.005 bracketed
    adamw = [c.strip() for c in rows["AdamW"].split("|")]
    assert adamw[2:5] == ["0.005", "2.000", "2"] and "**1.400**" in adamw and adamw[-5:-2] == ["0.005", "1", "seed 1: 1.430 (-0.040 to Muon), seed 2: 1.410"]
    # gap to Muon: 2.0 - 1.6 = +0.4 at 800 steps, 1.40 - 1.48 = -0.08 here
    assert adamw[-2] == "+0.400 -> -0.080 (changed sign)"
    muon = [c.strip() for c in rows["Muon"].split("|")]
    assert muon[2:5] == ["0.01", "1.600", "1"]
    assert muon[-5:-2] == ["0.0141 (edge)", "2", "seed 1: 1.470"] and muon[-2] == ""
    assert rows["SOAP"].count("—") >= 4  # no record yet: dashes, not a crash
    assert len(used) == 8 and "8300 steps" in text and "width 128" in text


def _re(run, seed, common, groups, own=1.5, steps=8300, width=128, lr=0.01):
    return {"run": run, "seed": seed, "lr": lr, "steps": steps, "checkpoint_step": 8000, "model": {"width": width},
            "own_val_loss": own, "common_val_loss": common, "common_groups": groups, "run_git_rev": "197e872aa",
            "provenance": {"git_rev": "e1d94e4bb", "git_dirty": False}}


def _write_reeval(tmp_path, monkeypatch, recs):
    path = tmp_path / "results" / "checks" / "reeval-windows" / "reeval.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setattr(L.R, "DOCS", tmp_path)


def test_common_windows_table(tmp_path, monkeypatch):
    """Paired gaps to Muon of the same setting and seed with +-2 SE over the window groups, ranks within
    a setting and seed (a dash when alone), the 64-window spread and the seed-to-seed differences."""
    recs = [_re("Muon", 0, 1.30, [1.2, 1.4, 1.3, 1.3]), _re("Muon", 0, 1.40, [1.3, 1.5, 1.4, 1.4], steps=3200, width=256),
            _re("AdamW", 0, 1.40, [1.31, 1.49, 1.41, 1.39], own=1.6),  # diffs .11 .09 .11 .09: mean .1, SE .005774
            _re("AdamW", 1, 1.41, [1.4, 1.4, 1.4, 1.44], own=1.45),
            _re("Muon", 0, 1.35, [1.3, 1.4, 1.35, 1.35], lr=0.005),  # Muon's worse lr: not the reference
            _re("Muon", 0, 1.29, [1.2, 1.4, 1.29, 1.27], lr=0.02, width=256, steps=3200),  # lower, but one seed
            _re("Muon", 1, 1.50, [1.5, 1.5, 1.5, 1.5], width=256, steps=3200)]  # lr 0.01: two seeds
    _write_reeval(tmp_path, monkeypatch, recs)
    text, used = L.common_windows()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()[2:7]]
    assert [r[:3] for r in rows] == [["8300 steps, width 128", "0", "AdamW"], ["8300 steps, width 128", "0", "Muon"],
                                     ["8300 steps, width 128", "0", "Muon"], ["8300 steps, width 128", "1", "AdamW"],
                                     ["3200 steps, width 256", "0", "Muon"]]
    rows = rows[:2] + rows[3:]
    assert rows[0][3] == "0.01" and rows[0][6:] == ["1.400", "3", "+0.100 [+0.088, +0.112]"]
    assert rows[1][6:] == ["1.300", "1", ""]
    assert rows[2][7:] == ["—", "—"]  # alone at seed 1, no Muon there
    assert "seeds 0 and 1: +0.010 on the common windows, -0.150 on their own" in text
    assert "varies by 0.074 nats" in text and len(used) == 7
    w256 = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| 3200 steps, width 256 | 0 | Muon | 0.02")]
    assert w256[0][-1].startswith("-0.110 [")  # measured against Muon at lr 0.01, run at two seeds
    muon2 = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
             if line.startswith("| 8300 steps, width 128 | 0 | Muon | 0.005")]
    assert muon2[0][-1].startswith("+0.050 [")  # its gap to the reference Muon
    summary = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
               if line.startswith("| 8300 steps, width 128 | AdamW | 0.01 | 0, 1")]
    assert summary == [["8300 steps, width 128", "AdamW", "0.01", "0, 1", "1.405", "+0.100 (seed 0)", ""]]


# ----- scripts/reeval_windows.py, which writes the common-windows record -------------------------------
SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "reeval_windows.py"


def _script():
    spec = importlib.util.spec_from_file_location("reeval_windows", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reeval_reproduces_the_logged_loss_and_refuses_other_weights(tmp_path, text_dir, cache_dir):
    run = tmp_path / "cmp"
    assert cli_main(["compare", "--optimizers", "adamw@A", "--no-isolate", "--data", str(text_dir), "--cache-dir",
                     str(cache_dir), "--layers", "1", "--width", "32", "--heads", "2", "--context", "32",
                     "--steps", "4", "--batch-size", "4", "--eval-every", "2", "--eval-seqs", "8", "--seed", "3",
                     "--checkpoint-every", "2", "--no-progress", "--out", str(run)]) == 0
    mod = _script()
    mod.GROUPS = 4
    out = tmp_path / "re.jsonl"
    args = [str(run), "--out", str(out), "--windows", "16", "--data", str(text_dir), "--cache-dir", str(cache_dir)]
    assert mod.main(args) == 0
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["run"] == "A" and rec["seed"] == 3 and rec["checkpoint_step"] == 2 and rec["run_dir"] == "cmp"
    assert rec["own_val_loss"] == pytest.approx(rec["logged_val_loss"], abs=1e-6)
    assert len(rec["common_groups"]) == 4 and rec["common_windows"] == 16
    assert sum(rec["common_groups"]) / 4 == pytest.approx(rec["common_val_loss"], abs=1e-6)
    assert rec["provenance"]["git_rev"] is not None
    assert mod.main(args) == 0 and len(out.read_text().splitlines()) == 1  # resumable: a run once
    # other weights under the same log: refused, nothing written
    (ckpt,) = run.glob("runs/*/checkpoint.pt")
    state = torch.load(ckpt, weights_only=False)
    state["model"] = {k: v * 0.5 for k, v in state["model"].items()}
    torch.save(state, ckpt)
    out2 = tmp_path / "re2.jsonl"
    assert mod.main([*args[:1], "--out", str(out2), *args[3:]]) == 1
    assert not out2.exists() or out2.read_text() == ""


def test_reeval_scores_an_iterate_average_and_the_raw_weights(tmp_path, text_dir, cache_dir):
    """SPlus validates its iterate average: the re-evaluation rebuilds the optimizer, swaps the
    average in (the own-window loss must equal the logged one) and scores the raw weights too."""
    run = tmp_path / "cmp"
    assert cli_main(["compare", "--optimizers", "splus:inverse_every=2@S", "--no-isolate", "--data", str(text_dir),
                     "--cache-dir", str(cache_dir), "--layers", "1", "--width", "32", "--heads", "2", "--context",
                     "32", "--steps", "4", "--batch-size", "4", "--eval-every", "2", "--eval-seqs", "8", "--seed",
                     "3", "--checkpoint-every", "2", "--no-progress", "--lr", "0.05", "--out", str(run)]) == 0
    mod = _script()
    mod.GROUPS = 4
    out = tmp_path / "re.jsonl"
    assert mod.main([str(run), "--out", str(out), "--windows", "16", "--data", str(text_dir), "--cache-dir",
                     str(cache_dir)]) == 0
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["eval_weights"] == "iterate-ema"
    assert rec["own_val_loss"] == pytest.approx(rec["logged_val_loss"], abs=1e-6)
    # the raw weights, scored by hand on the same common windows
    from dobb_bench.training.data import eval_offsets, load_corpus
    from dobb_bench.training.dist_env import DistEnv
    from dobb_bench.training.evaluate import evaluate
    from dobb_bench.training.model import GPT, ModelConfig

    (ckpt,) = run.glob("runs/*/checkpoint.pt")
    state = torch.load(ckpt, weights_only=False)
    cfg = ModelConfig(**rec["model"])
    model = GPT(cfg, seed=0)
    model.load_state_dict(state["model"])
    corpus = load_corpus(str(text_dir), cache_dir=str(cache_dir), val_fraction=0.02)
    raw = evaluate(model, corpus, eval_offsets(corpus.val, cfg.seq_len, 16, 12345), cfg.seq_len, 8, DistEnv())
    assert rec["common_val_loss_raw"] == pytest.approx(raw, abs=1e-6)
    assert abs(rec["common_val_loss"] - raw) > 1e-4  # the average is another set of weights


def test_best_on_common_picks_each_rows_lr_on_the_common_windows(tmp_path, monkeypatch):
    """Best lr per row and setting on the common windows (the one rule, lr_rule.choose: here the
    seed-0 best, no neighbour being close), edges marked with the run they need, ranks within a
    setting, and the paired gap to Muon at Muon's own best lr."""
    recs = [_re("Muon", 0, 1.30, [1.2, 1.4, 1.3, 1.3], lr=0.01),
            _re("Muon", 0, 1.33, [1.3, 1.5, 1.4, 1.4], lr=0.0141),  # worse by 0.1 in every group: not close
            _re("Muon", 0, 1.35, [1.3, 1.4, 1.35, 1.35], lr=0.00707),
            _re("Muon", 1, 1.10, [1.1, 1.1, 1.1, 1.1], lr=0.0141),  # seed 1 off Muon's best lr: not used
            _re("Muon", 1, 1.32, [1.3, 1.3, 1.3, 1.38], lr=0.01),
            _re("AdamW", 1, 1.36, [1.35, 1.35, 1.35, 1.39], lr=0.005),  # seed-1 gap +0.04
            _re("AdamW", 4, 1.50, [1.5, 1.5, 1.5, 1.5], lr=0.005),  # no Muon seed 4: not paired
            _re("SOAP", 1, 1.28, [1.28] * 4, lr=0.005), _re("SOAP", 2, 1.29, [1.29] * 4, lr=0.005),
            _re("Muon", 2, 1.33, [1.33] * 4, lr=0.01), _re("SOAP", 3, 1.3, [1.3] * 4, lr=0.005),
            _re("Muon", 3, 1.305, [1.305] * 4, lr=0.01),
            _re("AdamW", 0, 1.40, [1.31, 1.49, 1.41, 1.39], lr=0.005),  # gap +0.1, SE .005774
            _re("AdamW", 0, 1.45, [1.4, 1.5, 1.45, 1.45], lr=0.00707),
            _re("SOAP", 0, 1.25, [1.15, 1.35, 1.25, 1.25], lr=0.005, own=1.2),
            _re("Muon", 0, 1.60, [1.6, 1.6, 1.6, 1.6], steps=3200, width=256)]
    _write_reeval(tmp_path, monkeypatch, recs)
    short = {"AdamW": {(0.005, 0): {"final_val_loss": 2.0}}, "Muon-fp32": {(0.01, 0): {"final_val_loss": 1.6}}}
    monkeypatch.setattr(L, "runs_of", lambda label, studies: short.get(label, {}))
    text, used = L.best_on_common()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()[2:6]]
    # AdamW: 2.0 - 1.6 = +0.4 at 800 steps; 1.40 - 1.30 = +0.1 here
    # seed 1 at both best lrs: 1.36 - 1.32 = +0.04, mean with seed 0's +0.1 is +0.07
    assert rows[0] == ["8300 steps, width 128", "AdamW", "0.005: **1.400**, 0.00707: 1.450",
                       "0.005 (edge) (lr not settled: needs 0.00354 seed 0)", "3",
                       "+0.100 [+0.088, +0.112]", "seed 1: +0.040; mean +0.070", "+0.400 -> +0.100 (shrank)"]
    assert rows[1] == ["8300 steps, width 128", "Muon", "0.00707: 1.350, 0.01: **1.300**, 0.0141: 1.330", "0.01", "2",
                       "", "seed 1, seed 2, seed 3", ""]
    # SOAP's gaps -0.05, -0.04, -0.04, -0.005: mean -0.034, SE 0.0103, t(3) 3.182 -> 0.033: beyond
    assert rows[2][1:] == ["SOAP", "0.005: **1.250**", "0.005 (edge) (lr not settled: needs 0.00707 seed 0)", "1", "-0.050 [-0.050, -0.050]",
                           "seed 1: -0.040, seed 2: -0.040, seed 3: -0.005; mean -0.034 over 4 seeds, beyond seed noise",
                           "—"]
    assert rows[3][:2] == ["3200 steps, width 256", "Muon"] and rows[3][4:] == ["1", "", "—", ""]
    assert len(used) == 14 and "seed 4" not in text


# ----- the long-horizon grid's orders (scripts/long_horizon.py's bracket and close modes) over a fake runs folder
def _runs(tmp_path, finished):
    """A fake runs folder: ``finished`` maps (kind, label, j, seed) to (logged loss, common-window loss or None)."""
    runs = D.RunsFolder(str(tmp_path / "runs"), [str(tmp_path / "reeval.jsonl")])
    tmp_path.mkdir(parents=True, exist_ok=True)
    lines = []
    for (kind, label, j, seed), (logged, common) in finished.items():
        d = Path(runs.out_dir(kind, label, j, seed))
        d.mkdir(parents=True)
        (d / "results.jsonl").write_text(json.dumps({"final_val_loss": logged}) + "\n")
        if common is not None:
            lines.append(json.dumps({"run_dir": d.name, "common_val_loss": common}) + "\n")
    (tmp_path / "reeval.jsonl").write_text("".join(lines))
    return runs


def test_driver_judges_on_the_common_windows_and_steps_out_from_an_edge(tmp_path):
    """The best lr is taken on the common windows only when every finished lr of the row has them;
    the next lr out is one index past the best when the best sits at an edge, else none."""
    m = _runs(tmp_path, {
        ("lh", "Muon", 1, 0): (1.30, 1.25), ("lh", "Muon", 2, 0): (1.28, 1.27),  # logged and common disagree
        ("lh", "SOAP", 1, 0): (1.30, 1.25), ("lh", "SOAP", 2, 0): (1.28, None),  # one not re-evaluated
        ("lh", "Dobb B=1", -1, 0): (1.4, 1.4), ("lh", "Dobb B=1", 0, 0): (1.3, 1.3), ("lh", "Dobb B=1", 1, 0): (1.5, 1.5)})
    row = {r.label: r for r in H.LH}
    assert D.best_j(m, "lh", row["Muon"]) == ([1, 2], 1) and D.edge(m, "lh", row["Muon"]) == 0
    assert D.best_j(m, "lh", row["SOAP"]) == ([1, 2], 2) and D.edge(m, "lh", row["SOAP"]) == 3
    assert D.edge(m, "lh", row["Dobb B=1"]) is None  # bracketed
    assert D.best_j(m, "lh", row["AdamW"]) is None and D.edge(m, "lh", row["AdamW"]) is None


def _picks(driver, pick, n=20):
    out = []
    while (t := pick(driver)) is not None and len(out) < n:
        out.append((t[0], t[1].label, t[2], t[3]))
    return out


def test_driver_close_mode_order(tmp_path):
    """`close`: a second seed at each bracketed 20-tokens row's best lr, taking turns with the third
    width-256 lr of the rows that have fewer than three; then the outward steps, AdamW's last."""
    fin = {}
    for label, _, j0, *_ in H.LH:
        for j, v in ((j0 - 1, 1.31), (j0, 1.30), (j0 + 1, 1.32)):  # every 20-tokens row bracketed at j0 ...
            fin[("lh", label, j, 0)] = (v, v)
    fin[("lh", "Two-sided B=1 Bo=4", 0 - 1, 0)] = (1.29, 1.29)  # ... but this one, best at its lower edge
    fin[("lh", "Muon", 2, 1)] = (1.3, 1.3)  # Muon's second seed already at its best lr
    fin.update({("w256", "Muon", j, 0): (v, v) for j, v in ((1, 1.4), (2, 1.41), (3, 1.42))})
    fin.update({("w256", "Dobb B=1", j, 0): (v, v) for j, v in ((-1, 1.4), (0, 1.41))})
    fin.update({("w256", "Two-sided B=1 Bo=4", j, 0): (v, v) for j, v in ((-2, 1.42), (-1, 1.4), (0, 1.41))})
    fin.update({("w256", "AdamW", j, 0): (v, v) for j, v in ((-3, 1.49), (-2, 1.5), (-1, 1.51))})
    m = _runs(tmp_path, fin)
    picks = _picks(D.Driver(m, "wt", H.SETTINGS), H.next_close)
    assert picks[:3] == [("lh", "AdamW", -1, 1), ("w256", "Dobb B=1", -2, 0), ("lh", "SOAP", 2, 1)]
    assert ("lh", "Muon", 2, 1) not in picks
    lh_seeds = [p for p in picks if p[0] == "lh" and p[3] == 1]
    assert len(lh_seeds) == 7 and lh_seeds[-1] == ("lh", "Two-sided B=1 Bo=4", -1, 1)  # not bracketed: last
    out = picks.index(("lh", "Two-sided B=1 Bo=4", -2, 0))
    assert max(picks.index(p) for p in lh_seeds[:-1]) < out < picks.index(lh_seeds[-1])
    assert picks.index(("w256", "Muon", 0, 0)) > 2
    # AdamW's steps after every matrix row's outward steps and the bracketed rows' width-256 seeds
    assert picks.index(("w256", "AdamW", -4, 0)) > max(out, picks.index(("w256", "Two-sided B=1 Bo=4", -1, 1)))


def test_driver_third_seed_goes_to_rows_that_lead_muon_at_both_seeds(tmp_path):
    fin = {}
    for label, by_seed in (("Muon", (1.30, 1.28)), ("SOAP", (1.28, 1.27)),  # leads by 0.02 and 0.01
                           ("Dobb B=1", (1.28, 1.29)),  # leads at seed 0 only
                           ("MuonBP R=4 P=5", (1.295, 1.275))):  # leads at both, by 0.005 on average
        for j, extra in ((0, 0.01), (1, 0.0), (2, 0.02)):  # bracketed at j=1
            for sd, v in enumerate(by_seed):
                if sd == 0 or j == 1:
                    fin[("lh", label, j, sd)] = (v + extra, v + extra)
    m = _runs(tmp_path, fin)
    assert [(r.label, j) for r, j in H.leads(m)] == [("Muon", 1), ("SOAP", 1)]
    d = D.Driver(m, "wt", H.SETTINGS)
    picks = [H.next_close(d) for _ in range(2)]
    assert [(t[1].label, t[2], t[3]) for t in picks] == [("Muon", 1, 2), ("SOAP", 1, 2)]


def test_a_bf16_run_is_named_under_the_tables_not_mixed_into_a_row(tmp_path, monkeypatch):
    """Issue 55: table:common-windows held Dobb-Muon's bf16 run beside its fp32 runs, and
    table:long-horizon-best could take it as the row's seed-0 point; both leave it out now, and
    common-windows names it under the table."""
    from dobb_bench.reports import claims as C
    bf = dict(_re("Dobb-Muon B=4 Bo=4", 0, 1.20, [1.2] * 4, lr=0.005), hparams={"product_dtype": "torch.bfloat16"})
    fp = [dict(_re("Dobb-Muon B=4 Bo=4", 0, 1.278, [1.278] * 4, lr=0.005), hparams={"product_dtype": "torch.float32"}),
          dict(_re("Dobb-Muon B=4 Bo=4", 0, 1.276, [1.276] * 4, lr=0.003536), hparams={"product_dtype": "torch.float32"})]
    recs = [_re("Muon", 0, 1.30, [1.2, 1.4, 1.3, 1.3]), bf, *fp]
    _write_reeval(tmp_path, monkeypatch, recs)
    text, used = L.common_windows()
    assert bf not in used and C.mixed_dtypes("common-windows", used) == []
    assert "Left out, so that no row mixes product dtypes: Dobb-Muon B=4 Bo=4 lr 0.005 seed 0" in text
    assert C.mixed_dtypes("common-windows", recs)  # as the table was: the check fails on it
    monkeypatch.setattr(L, "runs_of", lambda label, studies: {})
    text, used = L.best_on_common()
    row = next(line for line in text.splitlines() if "| Dobb-Muon B=4 Bo=4 |" in line)
    assert "0.005: 1.278" in row and "1.200" not in row and bf not in used
