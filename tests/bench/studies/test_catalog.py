"""dobb_bench.studies.catalog: every declared study against its committed records (and the check
failing on planted contradictions), the fixed rule and the script runners through the one driver,
`dobb-bench study list|show`, and `dobb-bench ablate` taking its rows from the catalog."""
import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from dobb_bench.cli import main as cli_main
from dobb_bench.reports import records as R
from dobb_bench.studies import ablations as A
from dobb_bench.studies import catalog as C
from dobb_bench.studies import define as D
from dobb_bench.studies import long_horizon_runs as H

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def _load(study: str) -> list[dict]:
    return R.load(study) if (R.RECORDS / f"{study}.jsonl").exists() else []


def test_every_committed_record_is_a_run_its_declaration_plans():
    """For every records study a declared study collects into: each record's label, spec, setting,
    lr and seed are a run its declaration plans, and each run a fixed study plans has its record.
    The one record set aside: a frontier-20 run made with bf16 products (the study pins fp32)."""
    checked, aside = {}, []
    for records, studies in C.by_records().items():
        recs = _load(records)
        if not recs:  # the ablations: declared, not run since their figures were withdrawn
            continue
        problems, out = C.check(studies, recs)
        assert problems == [], records
        checked[records] = len(recs)
        aside += [(records, r["run"], r["lr"], r["seed"]) for r in out]
    assert aside == [("long-horizon", "Dobb-Muon B=4 Bo=4", 0.005, 0)]
    assert set(checked) == {"long-horizon", "shard-local", "family-dash", "family-soap",
                            "two-sided", "two-sided-adam-raw", "refresh-width", "dobb-forms", "one-revision",
                            "past-horizon", "host-check", "one-revision-amd"}
    # the finished studies' record counts; long-horizon and one-revision grow while their grids run
    assert checked.pop("long-horizon") >= 101
    assert checked.pop("one-revision") >= 1
    assert checked.pop("past-horizon") >= 1
    assert checked.pop("host-check") >= 1  # these two grow while their runs land
    assert checked.pop("one-revision-amd") >= 1
    assert checked == {"shard-local": 59, "family-dash": 17, "family-soap": 23, "two-sided": 29,
                       "two-sided-adam-raw": 1, "refresh-width": 3, "dobb-forms": 20}


def _swap(study: D.Study, label: str, **kw) -> D.Study:
    return replace(study, rows=tuple(r._replace(**kw) if r.label == label else r for r in study.rows))


def test_the_check_fails_where_a_declaration_contradicts_its_records():
    sl, recs = C.SHARD_LOCAL, R.load("shard-local")
    assert C.check([sl], recs) == ([], [])
    # another spec, another seed list, a missing row, a declared lr never run, a run never declared
    got = C.check([_swap(sl, "DASH 32", spec="dash:block_size=16")], recs)[0]
    assert sum("ran dash {'block_size': '32'}, shard-local declares 'dash:block_size=16'" in p for p in got) == 5
    assert sum("declared, no record" in p for p in got) == 5  # so its planned runs have none
    assert any("seed 2 is not one of" in p for p in C.check([replace(sl, seeds=(0, 1))], recs)[0])
    got = C.check([replace(sl, rows=sl.rows[1:])], recs)[0]
    assert got == [f"'Dobb B=1' lr 0.005 seed {s} (800 steps): no declared study has this row at this setting"
                   for s in (1, 2)]
    assert C.check([_swap(sl, "DASH 32", lrs=(0, 1, 2, 3))], recs)[0] == [
        "shard-local: 'DASH 32' j3 seed 0 declared, no record"]
    assert C.check([replace(_swap(sl, "DASH 32", lrs=(0, 1, 2, 3)), running=True)], recs)[0] == []  # still landing
    assert C.check([_swap(sl, "DASH 32", seeded=())], recs)[0] == [
        "shard-local: 'DASH 32' j1 seed 1 ran, not declared", "shard-local: 'DASH 32' j1 seed 2 ran, not declared"]
    # another setting: no study has the row at 400 steps
    got = C.check([replace(sl, setting=replace(sl.setting, steps=400))], recs)[0]
    assert sum("no declared study has this row at this setting" in p for p in got) == len(recs)
    # fp32 products declared where the runs were bf16 (dobb-forms ran under compare's rule)
    forms = C.by_records()["dobb-forms"]
    pinned = [replace(s, setting=replace(s.setting, product_dtype="float32")) for s in forms]
    assert C.check(pinned, R.load("dobb-forms"))[1]  # set aside: another row


def test_the_bracket_rule_check_reads_the_steps_out():
    """Under the bracket rule a row's seed-0 lrs run unbroken through its first lr, within its span,
    and a later seed only where seed 0 ran."""
    lh = H.STUDIES["long-horizon"]
    recs = [r for r in R.load("long-horizon") if r["steps"] == 8300 and r["run"] in {x.label for x in lh.rows}]
    assert C.check([lh], recs) == ([], [])
    far = C.check([_swap(lh, "Muon", j=12)], recs)[0]  # its first lr j12, its runs far below
    assert any("beyond j12 -+ 6" in p for p in far) and any("not the rule's steps out from j12" in p for p in far)
    gap = [r for r in recs if not (r["run"] == "Muon" and abs(r["lr"] - D.grid_lr(0)) < 1e-9)]
    assert C.check([lh], gap)[0] == ["long-horizon: 'Muon' seed-0 lrs j[-2, -1, 1, 2, 3] are not the rule's "
                                     "steps out from j2"]
    lone = [dict(r, lr=D.grid_lr(5)) if r["run"] == "Muon" and r["seed"] == 2 else r for r in recs]
    assert C.check([lh], lone)[0] == ["long-horizon: 'Muon' later seeds [(5, 2)] where seed 0 did not run"]


def test_one_setting_per_run_folder_kind_and_lrs_typed_to_three_digits():
    assert C.check_kinds() == []
    assert C.grid_j(0.0283) == 5 and C.grid_j(0.00707) == 1 and C.grid_j(D.grid_lr(-1)) == -1
    with pytest.raises(ValueError, match="not on the grid"):
        C.grid_j(0.006)
    assert set(H.STUDIES) < set(C.STUDIES)  # the long-horizon studies are the catalog's
    assert {f"ablate-{n}" for n in C.ABLATIONS} < set(C.STUDIES)


# ----- the fixed rule and the script runners through the one driver
def _finish(runs, kind, label, j, seed, loss):
    d = Path(runs.out_dir(kind, label, j, seed)) / "runs" / "x"
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text(json.dumps({"type": "eval"}) + "\n" + json.dumps(
        {"type": "final", "final_val_loss": loss, "diverged": False}) + "\n")


def test_a_fixed_study_plans_its_declared_grid_and_stops(tmp_path):
    st = C.FAMILY_SOAP
    runs = D.RunsFolder(str(tmp_path / "runs"))
    d = D.Driver(runs, "wt", C.settings(), windows=None)
    pick, order = D.rule(st), []
    while (t := pick(d)) is not None:
        order.append((t[1].label, t[2], t[3]))
        _finish(runs, t[0], t[1].label, t[2], t[3], 1.5)  # a script run: no results.jsonl, a final record
    assert order[:5] == [("SOAP", -1, 0), ("SOAP", 0, 0), ("SOAP", 1, 0), ("SOAP", 2, 0), ("SOAP", 3, 0)]
    assert sorted(order) == sorted((r.label, j, s) for r in st.rows for j, s in st.planned(r))
    assert order.index(("SOAP", -1, 1)) > max(order.index(x) for x in order if x[2] == 0)
    assert len(order) == 23  # the records of family-soap, one run each
    assert runs.loss("fsoap", "SOAP", -1, 0) == 1.5


def test_the_runners_commands(tmp_path):
    d = D.Driver(D.RunsFolder("/r"), "wt", C.settings())
    soap = C.FAMILY_SOAP.row("SOAP sides=input B=4")
    args = d.command(("fsoap", soap, -1, 1))
    assert args[1:] == ["scripts/family_rows.py", "--layers", "2", "--context", "64", "--no-progress", "--steps",
                        "800", "--eval-every", "50", "--seed", "1", "--lr", repr(D.grid_lr(-1)), "--out",
                        "/r/fsoap-SOAPsidesinputB4-j-1-s1", "--optimizer", "soap", "--hparams",
                        "sides=input:blocks=4", "--label", "SOAP sides=input B=4"]
    peer = C.FAMILY_SOAP.row("pytorch_optimizer.SOAP all params")
    assert d.command(("fsoap", peer, -1, 0))[-4:] == ["--package", "pytorch_optimizer", "--label", peer.label]
    dash = C.FAMILY_DASH.row("DASH package 128")
    assert d.command(("fdash", dash, -1, 0))[1] == "scripts/peer_dash.py"
    assert d.command(("fdash", dash, -1, 0))[-4:] == ["--block-size", "128", "--label", "DASH package 128"]
    dobb = C.SHARD_LOCAL.row("DASH 32")
    assert " ".join(d.command(("sl", dobb, 1, 2))) == (
        "dobb-bench compare --jobs 1 --layers 2 --context 64 --no-progress --steps 800 --eval-every 50 "
        "--product-dtype float32 --seed 2 --lr 0.007071067811865476 --out /r/sl-DASH32-j1-s2 "
        "--optimizers dash:block_size=32@DASH 32")
    capture = C.STUDIES["ablate-capture"]
    assert capture.setting.flags()[-2:] == ["--micro-batches", "2"]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("study,label", [("family-soap", "Newton-Muon-fp32 B=4"),
                                         ("family-soap", "pytorch_optimizer.SOAP all params")])
def test_the_scripts_take_the_drivers_command(study, label, tmp_path, monkeypatch):
    """The command the driver gives a script parses there and names the row as its records did."""
    st = C.STUDIES[study]
    row = st.row(label)
    args = D.Driver(D.RunsFolder(str(tmp_path)), "wt", C.settings()).command((st.setting.kind, row, 0, 1))
    mod = _script(D.RUNNERS[row.runner].split("/")[-1][:-3])
    seen = {}

    def run_configs(a):
        seen["args"] = a
        return None, SimpleNamespace(lr=a.lr, seed=a.seed, weight_decay=0.1), (None, None)
    monkeypatch.setattr(mod.T, "run_configs", run_configs)
    monkeypatch.setattr(mod, "run_training", lambda m, t, c, f, out_dir, meta, **kw: seen.update(
        meta=meta, out=out_dir) or {})
    monkeypatch.setattr(mod, "provenance", lambda argv: {})
    monkeypatch.setattr(mod, "replace", lambda c, **kw: c, raising=False)
    assert mod.main(args[2:]) == 0
    a = seen["args"]
    assert (a.steps, a.eval_every, a.layers, a.context, a.seed, a.lr) == (800, 50, 2, 64, 1, D.grid_lr(0))
    assert seen["meta"]["run"] == label
    assert (seen["meta"]["optimizer"], seen["meta"]["hparams"]) == C.spec_key(row.spec)
    assert str(seen["out"]).startswith(args[args.index("--out") + 1])


# ----- the CLI
def test_study_list_and_show(capsys):
    assert cli_main(["study", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("long-horizon", "frontier-20", "shard-local", "family-dash", "family-soap", "ablate-qr"):
        assert f"\n{name}: " in "\n" + out
    assert cli_main(["study", "ablate-qr"]) == 0
    out = capsys.readouterr().out
    assert "ablate-qr: Table 16: QR routine; rule fixed, seeds [0]" in out
    assert "  Dobb B=1 qr=cholesky: dobb:blocks=1:qr=cholesky (paper 3.016); seed 0 at 0.00354" in out
    assert cli_main(["study", "family-dash", "show"]) == 0
    assert "DASH package 128: peer:ista_daslab_optimizers.DashGpu:block_size=128 [peer-dash]" in capsys.readouterr().out
    assert cli_main(["study", "shard-local", "status"]) == 2
    assert "study status needs --runs" in capsys.readouterr().err


def test_study_status_of_a_fixed_study(tmp_path, capsys):
    runs = D.RunsFolder(str(tmp_path / "runs"))
    _finish(runs, "rw", "Dobb B=1 width-period", -1, 0, 1.25)
    assert cli_main(["study", "refresh-width", "status", "--runs", str(tmp_path / "runs"), "--repo", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "Dobb B=1 width-period: 1 of 3 runs finished; j-1 seed 0: 1.2500\n"


QR_TABLE = """### Table 16: QR routine

2/128/4 model, 800 steps, 16 x 64 tokens/step, 1 micro-batch(es), lr 0.00354, seeds [0, 1]. Delta = row minus `Dobb B=1`.

| setting | paper loss | paper delta | our loss (nats/byte) | our delta | seed spread |
|---|---|---|---|---|---|
| Dobb B=1 | 3.017 | +0.000 | 1.0100 | +0.0000 | 0.0200 |
| Dobb B=1 qr=cholesky | 3.016 | -0.001 | 1.0200 | +0.0100 | 0.0200 |
| Dobb B=4 | 3.024 | +0.007 | 1.0300 | +0.0200 | 0.0200 |
| Dobb B=4 qr=cholesky | 3.022 | +0.005 | 1.0400 | +0.0300 | 0.0200 |
"""


def test_ablate_runs_the_declared_rows(tmp_path, monkeypatch, capsys):
    """`dobb-bench ablate qr --seeds 2` with a fake runner: the catalog's rows, paper values and
    reference, each row at each seed, the table as before the catalog held them."""
    calls, loss = [], {"Dobb B=1": 1.0, "Dobb B=1 qr=cholesky": 1.01, "Dobb B=4": 1.02, "Dobb B=4 qr=cholesky": 1.03}
    cfg = SimpleNamespace(steps=800, batch_size=16, micro_batches=1, lr=D.grid_lr(-1), seed=0)
    monkeypatch.setattr(A, "run_configs", lambda args: (SimpleNamespace(layers=2, width=128, heads=4, seq_len=64),
                                                        cfg, {}))
    monkeypatch.setattr(A, "validate_spec", lambda spec, m: None)
    monkeypatch.setattr(A, "replace", lambda c, **kw: (replace(c, **kw) if hasattr(c, "__dataclass_fields__")
                                                       else SimpleNamespace(**{**vars(c), **kw})))

    def run_many(jobs, args, m, t, corpus, out):
        (spec, lr), = jobs
        calls.append((spec.name, spec.hparams, spec.label, lr, t.seed, Path(out).name))
        Path(out).mkdir(parents=True, exist_ok=True)
        return [{"final_val_loss": loss[spec.label] + 0.02 * t.seed}]
    monkeypatch.setattr(A, "run_many", run_many)
    assert cli_main(["ablate", "qr", "--seeds", "2", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(QR_TABLE)
    assert (tmp_path / "qr.md").read_text() == QR_TABLE
    assert json.loads((tmp_path / "qr.json").read_text())["paper"] == {
        "Dobb B=1": 3.017, "Dobb B=1 qr=cholesky": 3.016, "Dobb B=4": 3.024, "Dobb B=4 qr=cholesky": 3.022}
    assert [c[2:] for c in calls] == [(label, D.grid_lr(-1), s, f"seed{s}") for label in loss for s in (0, 1)]
    assert calls[2][:2] == ("dobb", {"blocks": 1, "qr": "cholesky"})
    assert cli_main(["ablate", "bogus"]) == 2
    assert "unknown study 'bogus'; choose from normalization, source" in capsys.readouterr().err


def test_the_tables_read_the_rows_their_studies_declare():
    """A table's rows from its own study's records are rows its declaration runs."""
    from dobb_bench.studies import family_dash, family_soap, refresh_width, shard_local

    def labels(st):
        return {r.label for r in st.rows}
    own = {label for _, label, studies, _ in shard_local.ROWS + shard_local.REFS if shard_local.STUDY in studies}
    assert own and own <= labels(C.SHARD_LOCAL)
    assert set(family_dash.DASH_ROWS) <= labels(C.FAMILY_DASH)
    assert set(family_soap.ROWS) <= labels(C.FAMILY_SOAP)
    assert refresh_width.ROW in labels(C.REFRESH_WIDTH)
