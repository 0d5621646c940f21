"""dobb_bench.training.commands_train (``train``, ``compare``, ``sweep``): one-line errors with exit
code 2 for bad input, tiny end-to-end compare/sweep/train runs, parallel isolated runs equal to
sequential ones, and the run's length passed to an optimizer that takes it."""
import json

import numpy as np
import pytest

from dobb_bench.cli import main
from dobb_bench.training import commands_train as C


SMALL = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--steps", "3",
         "--batch-size", "4", "--eval-every", "3", "--eval-seqs", "4", "--no-progress"]


def _error(capsys, argv, phrase):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert phrase in err, err
    return err


def test_bad_inputs_exit_2_with_one_line(capsys, tmp_path, text_dir, cache_dir):
    common = ["train", "--optimizer", "adamw", "--out", str(tmp_path / "o"), "--cache-dir", str(cache_dir)] + SMALL
    _error(capsys, common + ["--data", str(tmp_path / "nope")], "does not exist")
    (tmp_path / "empty.txt").write_text("")
    _error(capsys, common + ["--data", str(tmp_path / "empty.txt")], "is empty")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    _error(capsys, common + ["--data", str(tmp_path / "odd.bin")], "odd byte count")
    _error(capsys, common + ["--data", str(text_dir), "--seq-len", "64"], "exceeds the model context 32")
    _error(capsys, ["train", "--optimizer", "nosuchopt"] + SMALL, "nosuchopt")
    _error(capsys, ["train", "--optimizer", "adamw", "--hp", "blocks"] + SMALL, "malformed --hp 'blocks'")
    _error(capsys, ["train", "--optimizer", "adamw", "--hp", "=3"] + SMALL, "malformed --hp")
    _error(capsys, ["compare", "--optimizers", "adamw,nosuchopt:blocks=2"] + SMALL, "nosuchopt")
    _error(capsys, ["compare", "--optimizers", "adamw,adamw"] + SMALL, "duplicate labels")
    _error(capsys, ["sweep", "--optimizer", "adamw", "--grid", "-1,x"] + SMALL, "malformed grid")
    _error(capsys, common + ["--data", str(text_dir), "--steps", "0"], "--steps must be a positive")


def test_spec_lists_and_the_lr_grid():
    """--optimizers splits at commas outside brackets; the sweep grid is lr_j = 5e-3 * 2^(j/2)."""
    assert C.split_specs("a,b:betas=(0.9,0.99), c") == ["a", "b:betas=(0.9,0.99)", "c"]
    assert C.grid_lr(-1) == pytest.approx(3.5355e-3, rel=1e-4) and C.grid_lr(-2) == pytest.approx(2.5e-3)


def test_compare_smoke_writes_jsonl_and_markdown(capsys, tmp_path, text_dir, cache_dir):
    specs, labels = "adamw,dobb:blocks=2", ("AdamW", "Dobb B=2")
    out = tmp_path / "cmp"
    argv = ["compare", "--optimizers", specs, "--data", str(text_dir), "--cache-dir", str(cache_dir),
            "--out", str(out), "--no-isolate"] + SMALL
    assert main(argv) == 0
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    finals = [r for r in records if r["type"] == "final"]
    assert [f["run"] for f in finals] == list(labels)
    assert sorted((r["run"], r["step"]) for r in records if r["type"] == "eval") == sorted(
        (lab, s) for lab in labels for s in (0, 3))
    md = (out / "results.md").read_text()
    assert all(f"| {lab} |" in md for lab in labels) and "tokens/s" in md and "opt ms/step" in md
    assert (out / "val_loss.png").stat().st_size > 1000
    assert all(np.isfinite(f["final_val_loss"]) for f in finals)
    printed = capsys.readouterr().out
    assert "final val loss" in printed
    # a second invocation reuses the finished runs (same numbers, no retraining)
    assert main(argv) == 0
    again = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r.get("final_val_loss") for r in again] == [r.get("final_val_loss") for r in records]
    # changed settings are not mistaken for finished runs: refused (test_cli_safety), or on request
    # (--no-resume) retrained and replaced
    assert main(argv[:-len(SMALL)] + [x if x != "3" else "4" for x in SMALL]) == 2
    assert main(argv[:-len(SMALL)] + [x if x != "3" else "4" for x in SMALL] + ["--no-resume"]) == 0
    finals = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [f["steps"] for f in finals if f["type"] == "final"] == [4, 4]


def test_sweep_isolated_with_negative_grid(tmp_path, text_dir, cache_dir):
    out = tmp_path / "sw"
    argv = ["sweep", "--optimizer", "adamw", "--grid", "-2,0", "--data", str(text_dir), "--cache-dir",
            str(cache_dir), "--out", str(out), "--isolate"] + SMALL
    assert main(argv) == 0
    finals = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    finals = [f for f in finals if f["type"] == "final"]
    assert [f["lr"] for f in finals] == pytest.approx([2.5e-3, 5e-3])
    assert "best lr" in (out / "results.md").read_text()


def test_train_stop_and_resume(capsys, tmp_path, text_dir, cache_dir):
    out = tmp_path / "tr"
    argv = ["train", "--optimizer", "adamw", "--data", str(text_dir), "--cache-dir", str(cache_dir),
            "--out", str(out), "--micro-batches", "2"] + SMALL
    assert main(argv + ["--stop-after", "1"]) == 0
    assert "stopped after step 1" in capsys.readouterr().out
    assert main(argv) == 0
    resumed = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert main(argv[:-len(SMALL)] + SMALL + ["--no-resume", "--out", str(tmp_path / "fresh")]) == 0
    fresh = json.loads((tmp_path / "fresh" / "metrics.jsonl").read_text().splitlines()[-1])
    assert resumed["train_losses"] == fresh["train_losses"] and resumed["final_val_loss"] == fresh["final_val_loss"]


def test_compare_lr_grid_reports_shared_and_best(tmp_path, text_dir, cache_dir):
    out = tmp_path / "grid"
    argv = ["compare", "--optimizers", "adamw", "--lr-grid", "-2,-1", "--data", str(text_dir),
            "--cache-dir", str(cache_dir), "--out", str(out), "--no-isolate"] + SMALL
    assert main(argv) == 0
    finals = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    finals = [f for f in finals if f["type"] == "final"]
    assert [f["lr"] for f in finals] == pytest.approx([C.grid_lr(-1), 2.5e-3])  # j=-1 is the shared lr
    md = (out / "results.md").read_text()
    assert "| row lr | val loss @ row lr | best lr |" in md  # AdamW's recorded best lr is j=-1
    best = min(finals, key=lambda f: f["final_val_loss"])
    assert f"| {best['lr']:.3g} | {best['final_val_loss']:.4f} |" in md


SMALL4 = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--steps", "4",
         "--batch-size", "4", "--eval-every", "2", "--eval-seqs", "4", "--no-progress"]


def test_parallel_isolated_runs_equal_sequential(tmp_path, text_dir, cache_dir, capsys):
    specs = "adamw,dobb:blocks=2"
    common = ["compare", "--optimizers", specs, "--data", str(text_dir), "--cache-dir", str(cache_dir),
              "--isolate"] + SMALL4
    assert main(common + ["--jobs", "2", "--out", str(tmp_path / "par")]) == 0
    assert main(common + ["--jobs", "1", "--out", str(tmp_path / "seq")]) == 0
    out = capsys.readouterr().out
    assert "Summary (one seed" in out and "- Dobb B=2 (lr 0.00354; blocks 16 / 64 wide" in out

    def finals(d):
        rows = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines()]
        return {r["run"]: r for r in rows if r["type"] == "final"}

    par, seq = finals(tmp_path / "par"), finals(tmp_path / "seq")
    assert list(par) == list(seq) == ["AdamW", "Dobb B=2"]  # order of --optimizers, not of finishing
    for k in par:
        assert par[k]["train_losses"] == seq[k]["train_losses"]  # exact: same seed, one thread each
        assert par[k]["provenance"]["command"].startswith("dobb-bench compare --optimizers adamw")
        assert par[k]["tokens"] == 4 * 4 * 32
    assert main(common + ["--jobs", "0", "--out", str(tmp_path / "bad")]) == 2


def test_the_bench_gives_samuon_the_runs_length():
    """A spec without total_steps gets the run's steps when the optimizer takes it; others unchanged."""
    from dobb_bench.specs import parse_spec
    from dobb_bench.training.commands_train import run_hparams

    assert run_hparams(parse_spec("samuon:gamma=4"), 800) == {"gamma": 4, "total_steps": 800}
    assert run_hparams(parse_spec("samuon-lite:total_steps=50"), 800) == {"total_steps": 50}
    assert run_hparams(parse_spec("muon:split_sizes=qkv"), 800) == {"split_sizes": "qkv"}


def test_the_bench_keeps_the_adamw_part_its_records_were_made_with():
    """Issue 53 left the 1-D parameters of the library's AdamW part undecayed by default and gave it
    an ``adamw_lr``; the bench's rows keep what their records were made with: every parameter that
    is not a hidden matrix (embeddings, every LayerNorm weight) in one AdamW group with the run's
    weight decay and the matrix lr. Checked against the groups built by hand, for every row of the
    default compare and every registry name."""
    import torch

    import dobb
    from dobb_bench.specs import parse_spec
    from dobb_bench.training.model import GPT, ModelConfig

    torch.manual_seed(0)
    model = GPT(ModelConfig(layers=2, width=32, heads=2, seq_len=8))
    names = {id(p): n for n, p in model.named_parameters()}
    hidden = [f"blocks.{i}.{m}.weight" for i in (0, 1) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    rest = [n for n, _ in model.named_parameters() if n not in hidden]
    assert any(p.dim() == 1 for n, p in model.named_parameters() if n in rest)  # the case that changed
    specs = [parse_spec(s) for s in C.split_specs(C.DEFAULT_COMPARE)]
    specs += [parse_spec(n) for n in dobb.OPTIMIZER_NAMES if n not in {s.name for s in specs}]
    for spec in specs:
        opt = C.make_optimizer(spec.name, C.run_hparams(spec, 10), 3e-3, 0.1, model)
        got = [(g.get("algorithm", "adamw"), [names[id(p)] for p in g["params"]], g["lr"], g["weight_decay"])
               for g in opt.param_groups]
        if spec.name == "adamw":
            want = [("adamw", [n for n, _ in model.named_parameters()], 3e-3, 0.1)]
        else:
            algo = opt.algorithm
            want = [(algo, hidden, 3e-3, 0.1), ("adamw", rest, 3e-3, 0.1)]
        assert got == want, spec.label
        getattr(opt, "remove_hooks", lambda: None)()


def test_the_bench_keeps_dobb_muons_plain_momentum_its_records_were_made_with():
    """Issue 55 made Nesterov momentum Dobb-Muon's builder default (the library Muon's); the bench's
    Dobb-Muon rows keep the plain momentum their records ran with, and a spec that asks for
    Nesterov still gets it. The library default is checked too, so the pin is not a no-op."""
    import torch

    import dobb
    from dobb_bench.specs import parse_spec
    from dobb_bench.training.model import GPT, ModelConfig

    torch.manual_seed(0)
    model = GPT(ModelConfig(layers=2, width=32, heads=2, seq_len=8))
    lib = dobb.build_optimizer("dobb-muon", model, lr=3e-3, blocks=2, out_blocks=2)
    assert [g["nesterov"] for g in lib.param_groups if g["algorithm"] != "adamw"] == [True]
    lib.remove_hooks()
    for spec_text, want in (("dobb-muon:blocks=2:out_blocks=2", False),
                            ("dobb-muon:blocks=2:out_blocks=2:nesterov=true", True)):
        spec = parse_spec(spec_text)
        opt = C.make_optimizer(spec.name, C.run_hparams(spec, 10), 3e-3, 0.1, model)
        assert [g["nesterov"] for g in opt.param_groups if g["algorithm"] != "adamw"] == [want], spec_text
        opt.remove_hooks()
