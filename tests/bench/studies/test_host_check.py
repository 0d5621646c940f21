"""dobb_bench.studies.host_check (table:host-check) on hand records: each run of this study (folders
``hk-*``) is paired with table:one-revision's run of the same row, lr and seed (folders ``rev-*``);
the differences, their per-row summary against the seed spread there, the gap to Muon on each host
and the paired t-test over every pair are computed from those losses alone."""
import pytest

from dobb_bench.studies import host_check as H

A = 0.003536
INTEL = {"cpu": "Intel(R) Xeon(R)", "bf16_flags": ["amx_bf16"]}
AMD = {"cpu": "AMD EPYC", "bf16_flags": ["avx512_bf16"]}


def _re(run, seed, loss, folder, machine, lr=A):
    return {"run": run, "seed": seed, "lr": lr, "steps": 8300, "checkpoint_step": 8000, "model": {"width": 128},
            "common_val_loss": loss, "hparams": {"ns_dtype": "torch.float32"},
            "run_dir": f"{folder}-{run.replace('-', '')}-j-1-s{seed}",
            "provenance": {"git_rev": "57db80f37c", "git_dirty": False, "machine": machine}}


@pytest.fixture
def hand(monkeypatch):
    def use(here, there):
        monkeypatch.setattr(H, "reeval_records", lambda: here)
        monkeypatch.setattr(H.one_revision, "reeval_records", lambda: there)
    return use


def _line(text, start):
    return next(x for x in text.splitlines() if x.startswith(start))


def test_pairs_differences_and_gaps(hand):
    there = [_re("Muon", 0, 1.2870, "rev", INTEL), _re("Muon", 1, 1.2850, "rev", INTEL), _re("Muon", 2, 1.2800, "rev", INTEL),
             _re("Muon", 0, 1.2900, "rev", INTEL, lr=0.005),  # another lr: neither paired nor in the spread
             _re("SOAP-Muon", 0, 1.2600, "rev", INTEL), _re("SOAP-Muon", 1, 1.2680, "rev", INTEL)]
    here = [_re("Muon", 0, 1.2864, "hk", AMD), _re("Muon", 1, 1.2860, "hk", AMD), _re("Muon", 2, 1.2790, "hk", AMD),
            _re("SOAP-Muon", 0, 1.2610, "hk", AMD),
            _re("Muon", 1, 9.0, "rev", AMD)]  # another study's folder: never read as this host's
    hand(here, there)
    text, used = H.host_check()
    assert "| Muon | 0.00354 | 0 | 1.2870 | 1.2864 | -0.0006 |" in text
    assert "| Muon | 0.00354 | 1 | 1.2850 | 1.2860 | +0.0010 |" in text
    assert "| SOAP-Muon | 0.00354 | 1 | 1.2680 | not run yet | |" in text
    # Muon: mean of -0.0006, +0.0010, -0.0010 = -0.0002; largest 0.0010; spread over 1.2870, 1.2850, 1.2800
    assert _line(text, "| Muon | 3 |") == "| Muon | 3 | -0.0002 | 0.0010 | 0.0036 (3 seeds) |"
    # the gap SOAP-Muon - Muon at seed 0: -0.0270 there, -0.0254 here
    assert "| SOAP-Muon | 0 | -0.0270 | -0.0254 | +0.0016 |" in text
    assert "Over every pair (4): mean +0.0001" in text and "no host offset beyond noise" in text
    assert "AMD EPYC (avx512_bf16)" in text and "Intel(R) Xeon(R) (amx_bf16)" in text
    assert all(r["common_val_loss"] != 9.0 for r in used)


def test_a_systematic_offset_is_called(hand):
    there = [_re("Muon", s, 1.28 + 0.004 * s, "rev", INTEL) for s in range(3)]
    here = [_re("Muon", s, 1.28 + 0.004 * s + 0.003 + 0.0001 * s, "hk", AMD) for s in range(3)]
    hand(here, there)
    text, _ = H.host_check()
    assert "a host offset beyond noise" in text
