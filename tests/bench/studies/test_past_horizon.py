"""dobb_bench.studies.past_horizon (table:past-horizon) on hand records: only this study's runs
(folders ``ph-*``, 16,600 steps) are read; each row's loss is its own common-windows loss, its gap to
Muon the seed-0 difference; the 8,300-step loss of the same row, lr and seed is looked up in
table:one-revision's runs first; the norm columns read the run's norm curve at the eval nearest the
20-tokens horizon, at its end and at its peak."""
import pytest

from dobb_bench.studies import past_horizon as P

DOBB = "Dobb-Muon B=4 Bo=4 Nesterov"


def _re(run, lr, seed, common, folder="ph", steps=16600):
    return {"run": run, "seed": seed, "lr": lr, "steps": steps, "checkpoint_step": steps - 100,
            "model": {"width": 128}, "common_val_loss": common, "hparams": {"ns_dtype": "torch.float32"},
            "run_dir": f"{folder}-{run.replace(' ', '')}-j0-s{seed}",
            "provenance": {"git_rev": "57db80f37c", "git_dirty": False, "machine": {"cpu": "Intel(R) Xeon(R)"}}}


def _run(run, lr, curve):
    return {"run": run, "lr": lr, "seed": 0, "steps": 16600, "norm_curve": curve,
            "provenance": {"git_rev": "57db80f37c", "git_dirty": False, "machine": {"cpu": "Intel(R) Xeon(R)"}}}


def test_norm_path_reads_the_horizon_eval_the_end_and_the_peak():
    curve = [[0, 0.02, 0.6], [8000, 0.1, 4.0], [8250, 0.1, 4.5], [12000, 0.1, 5.5], [16600, 0.1, 5.0]]
    assert P.norm_path({"norm_curve": curve}) == (4.5, 5.0, 5.5, 12000)
    assert P.norm_path({}) is None


@pytest.fixture
def hand(monkeypatch):
    def use(reevals, runs, short):
        monkeypatch.setattr(P, "reeval_records", lambda: reevals)
        monkeypatch.setattr(P.one_revision, "reeval_records", lambda: short)
        monkeypatch.setattr(P.R, "reeval_records", lambda: [])
        monkeypatch.setattr(P.R, "load", lambda study: runs)
        monkeypatch.setattr(P.Path, "exists", lambda self: True)
    return use


def test_rows_gaps_and_the_same_run_at_the_horizon(hand):
    a = 0.003536
    reevals = [_re("Muon", a, 0, 1.250), _re(DOBB, a, 0, 1.262),
               _re("Muon", a, 0, 0.5, folder="rev")]  # another study's folder: never read here
    short = [_re("Muon", a, 0, 1.287, folder="rev", steps=8300), _re(DOBB, a, 0, 1.273, folder="rev", steps=8300)]
    runs = [_run(DOBB, a, [[0, 0.02, 0.6], [8250, 0.1, 5.0], [16600, 0.1, 6.0]])]
    hand(reevals, runs, short)
    text, used = P.past_horizon()
    muon = next(x for x in text.splitlines() if x.startswith("| Muon |"))
    assert "| 1.250 |" in muon and "1.287 (`table:one-revision`; -0.037 here)" in muon
    dobb = next(x for x in text.splitlines() if x.startswith(f"| {DOBB} |"))
    assert "| 1.262 | +0.012 |" in dobb and "1.273 (`table:one-revision`; -0.011 here)" in dobb
    assert "5.00 / 6.00 (1.20x) | 6.00 (16,600)" in dobb
    assert "| Row-block Muon R=4 |" in text and "not run yet" in text
    assert "revision 57db80f" in text and all(r.get("run_dir", "ph").startswith("ph") for r in used)
