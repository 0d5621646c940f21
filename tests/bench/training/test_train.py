"""Training loop: the schedule reaches the optimizer, exact determinism, exact resume, atomic checkpoints,
accumulation, validation weights (the schedule itself: test_config.py)."""
import json
import math
from dataclasses import replace

import pytest
import torch

from dobb_bench.training import train as T
from dobb_bench.training.train import TrainConfig, lr_factor, run_training  # noqa: F401


def test_lr_reaches_optimizer(corpus, tiny_model_cfg, tiny_train_cfg):
    seen = []

    class Spy(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(self.param_groups[0]["lr"])
            return super().step(closure)

    cfg = replace(tiny_train_cfg, steps=4, warmup=2, schedule="linear", min_lr_ratio=0.0, lr=1.0)
    run_training(tiny_model_cfg, cfg, corpus, lambda m: Spy(m.parameters(), lr=cfg.lr))
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.0])


def _curve(result):
    return result["train_losses"], [e["val_loss"] for e in result["evals"]]


def test_two_runs_give_the_same_curve(corpus, tiny_model_cfg, tiny_train_cfg, adamw_factory):
    a = run_training(tiny_model_cfg, tiny_train_cfg, corpus, adamw_factory)
    b = run_training(tiny_model_cfg, tiny_train_cfg, corpus, adamw_factory)
    assert _curve(a) == _curve(b)  # exact equality
    assert [e["step"] for e in a["evals"]] == [0, 3, 6]
    assert a["final_val_loss"] < a["evals"][0]["val_loss"] - 0.2
    c = run_training(tiny_model_cfg, replace(tiny_train_cfg, seed=1), corpus, adamw_factory)
    assert _curve(c) != _curve(a)


def test_resume_equals_uninterrupted(tmp_path, corpus, tiny_model_cfg, tiny_train_cfg, adamw_factory):
    cfg = replace(tiny_train_cfg, micro_batches=2, grad_clip=0.5, steps=8, eval_every=2,
                  checkpoint_every=2)
    full = run_training(tiny_model_cfg, cfg, corpus, adamw_factory, out_dir=tmp_path / "full")
    part = run_training(tiny_model_cfg, cfg, corpus, adamw_factory, out_dir=tmp_path / "cut", stop_after=3)
    assert part["type"] == "interrupted" and part["step"] == 3
    assert not list((tmp_path / "cut").glob("*.tmp"))
    resumed = run_training(tiny_model_cfg, cfg, corpus, adamw_factory, out_dir=tmp_path / "cut")
    assert _curve(resumed) == _curve(full)
    lines = [json.loads(x) for x in (tmp_path / "cut" / T.METRICS_FILE).read_text().splitlines()]
    assert [r["type"] for r in lines] == ["eval"] * 5 + ["final"]
    assert [r["step"] for r in lines[:-1]] == [0, 2, 4, 6, 8]
    # a checkpoint from another configuration is refused, naming the difference
    with pytest.raises(ValueError, match="different configuration.*train"):
        run_training(tiny_model_cfg, replace(cfg, lr=1e-2), corpus, adamw_factory, out_dir=tmp_path / "cut")


def test_failed_checkpoint_write_keeps_previous(tmp_path, corpus, tiny_model_cfg, tiny_train_cfg, monkeypatch, adamw_factory):
    cfg = replace(tiny_train_cfg, checkpoint_every=2, steps=6)
    out = tmp_path / "run"
    run_training(tiny_model_cfg, cfg, corpus, adamw_factory, out_dir=out, stop_after=2)
    good = torch.load(out / T.CKPT_FILE, weights_only=False)
    real_save = torch.save

    def crash(obj, path, *a, **k):
        real_save({"partial": True}, path)
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(T.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        run_training(tiny_model_cfg, cfg, corpus, adamw_factory, out_dir=out, stop_after=4)
    monkeypatch.setattr(T.torch, "save", real_save)
    kept = torch.load(out / T.CKPT_FILE, weights_only=False)
    assert kept["step"] == good["step"] == 2
    assert torch.equal(kept["model"]["wte.weight"], good["model"]["wte.weight"])
    full = run_training(tiny_model_cfg, cfg, corpus, adamw_factory)
    resumed = run_training(tiny_model_cfg, cfg, corpus, adamw_factory, out_dir=out)
    assert _curve(resumed) == _curve(full)


def test_micro_batches_average_the_gradient(corpus, tiny_model_cfg, tiny_train_cfg):
    cfg = replace(tiny_train_cfg, steps=3, batch_size=8)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.5)  # linear in the gradient
    one = run_training(tiny_model_cfg, cfg, corpus, sgd)
    four = run_training(tiny_model_cfg, replace(cfg, micro_batches=4), corpus, sgd)
    assert _curve(one)[0] == pytest.approx(_curve(four)[0], rel=1e-5)
    assert _curve(one)[1] == pytest.approx(_curve(four)[1], rel=1e-5)


def test_divergence_is_reported(tmp_path, corpus, tiny_model_cfg, tiny_train_cfg):
    boom = lambda m: torch.optim.SGD(m.parameters(), lr=float("inf"))
    final = run_training(tiny_model_cfg, replace(tiny_train_cfg, steps=20), corpus, boom, out_dir=tmp_path)
    assert final["diverged"] and final["steps"] < 20 and math.isnan(final["final_val_loss"])
    last = json.loads((tmp_path / T.METRICS_FILE).read_text().splitlines()[-1])  # valid JSON, no NaN
    assert last["final_val_loss"] is None and last["diverged"] is True


def test_metrics_fields(corpus, tiny_model_cfg, tiny_train_cfg, adamw_factory):
    final = run_training(tiny_model_cfg, tiny_train_cfg, corpus, adamw_factory, meta={"run": "x"})
    assert final["run"] == "x" and final["tokens_per_s"] > 0 and final["opt_ms_per_step"] > 0
    assert final["peak_mem_mb"] > 10
    from dobb_bench.training.model import GPT

    n = sum(p.numel() for p in torch.nn.Module.parameters(GPT(tiny_model_cfg)))
    assert final["opt_state_mb"] == pytest.approx(2 * 4 * n / 2**20, rel=0.01)  # AdamW: 2 fp32 moments
    assert final["final_val_bpb"] == pytest.approx(final["final_val_loss"] / math.log(2))


def test_seq_len_over_context(corpus, tiny_model_cfg, tiny_train_cfg, adamw_factory):
    with pytest.raises(ValueError, match="exceeds the model context"):
        run_training(tiny_model_cfg, replace(tiny_train_cfg, seq_len=64), corpus, adamw_factory)


@pytest.mark.parametrize("name,hp", [("dobb", {"blocks": 2, "refresh_every": 2}),
                                     ("dobb-g", {"blocks": 2, "refresh_every": 3}), ("muon", {})])
def test_library_optimizer_resume_equals_uninterrupted(tmp_path, corpus, tiny_model_cfg, tiny_train_cfg, name, hp):
    """Checkpoints must carry the library's state (momentum, statistics, bases, step counters)."""
    import functools

    from dobb_bench.training.commands_train import make_optimizer

    factory = functools.partial(make_optimizer, name, hp, 3e-3, 0.1)
    cfg = replace(tiny_train_cfg, micro_batches=2, steps=7, eval_every=3)
    full = run_training(tiny_model_cfg, cfg, corpus, factory)
    run_training(tiny_model_cfg, cfg, corpus, factory, out_dir=tmp_path, stop_after=3)
    resumed = run_training(tiny_model_cfg, cfg, corpus, factory, out_dir=tmp_path)
    assert _curve(resumed) == _curve(full)
    again = run_training(tiny_model_cfg, cfg, corpus, factory)
    assert _curve(again) == _curve(full)


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for arbitrary code in a checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_planted_pickle_payload_is_refused(tmp_path, corpus, tiny_model_cfg, tiny_train_cfg, adamw_factory):
    out = tmp_path / "run"
    cfg = replace(tiny_train_cfg, steps=6)
    run_training(tiny_model_cfg, cfg, corpus, adamw_factory, out_dir=out, stop_after=2)
    state = torch.load(out / T.CKPT_FILE, weights_only=True)  # our own checkpoints load safely
    assert state["step"] == 2
    marker = tmp_path / "code-ran"
    state["evil"] = _Payload(marker)
    torch.save(state, out / T.CKPT_FILE)
    with pytest.raises(ValueError, match="refusing to load .*checkpoint.pt.*could run code"):
        run_training(tiny_model_cfg, cfg, corpus, adamw_factory, out_dir=out)
    assert not marker.exists()
    # DCP's .metadata (read by torch with plain pickle) is vetted before torch sees it
    import pickle

    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps({"x": _Payload(marker)}))
    with pytest.raises(ValueError, match="refusing to load .*dcp.*metadata"):
        T.check_dcp_metadata(folder)
    assert not marker.exists()
    with pytest.raises(ValueError, match="refusing to load"):
        torch.save([{"evil": _Payload(marker)}], folder / "extra.pt")
        T.safe_load(folder / "extra.pt")
    assert not marker.exists()


def test_validation_uses_the_iterate_average_where_the_optimizer_keeps_one(corpus, tiny_model_cfg, tiny_train_cfg,
                                                                            adamw_factory):
    """SPlus keeps an average of its iterates: every eval swaps it in (opt.eval()) and the raw
    weights back (opt.train()), and the records say which weights were validated."""
    import functools

    from dobb_bench.training.commands_train import make_optimizer

    factory = functools.partial(make_optimizer, "splus", {"inverse_every": 2, "ema_rate": 0.5}, 0.05, 0.0)
    run = T.Run(tiny_model_cfg, tiny_train_cfg, corpus, factory)
    final = run.run()
    assert final["eval_weights"] == "iterate-ema" and all(e["eval_weights"] == "iterate-ema" for e in run.evals)
    opt = run.optimizer
    assert not opt._in_eval()  # training resumed on the raw weights
    raw = [p.detach().clone() for p in run.model.parameters()]
    args = (run.model, corpus, run.eval_offsets, run.seq_len, tiny_train_cfg.eval_batch_size, run.env)
    on_raw = T.evaluate(*args)
    opt.eval()
    on_average = T.evaluate(*args)
    opt.train()
    assert all(torch.equal(p, r) for p, r in zip(run.model.parameters(), raw))
    assert run.evals[-1]["val_loss"] == on_average != on_raw
    plain = run_training(tiny_model_cfg, tiny_train_cfg, corpus, adamw_factory)
    assert plain["eval_weights"] == "raw" and all(e["eval_weights"] == "raw" for e in plain["evals"])


def test_eval_seed_fixes_the_held_out_windows_across_seeds(corpus, tiny_model_cfg, tiny_train_cfg, adamw_factory):
    """By default a run's held-out windows come from its seed; with ``eval_seed`` every seed evaluates
    on the windows of that seed: the step-0 eval of seed 1's model on eval_seed=0 equals a direct
    evaluation of that model on seed 0's windows, and differs from its default eval."""
    from dobb_bench.training.data import eval_offsets

    cfg0 = replace(tiny_train_cfg, seed=0)
    r_default = T.Run(tiny_model_cfg, replace(cfg0, seed=1), corpus, adamw_factory)
    r_fixed = T.Run(tiny_model_cfg, replace(cfg0, seed=1, eval_seed=0), corpus, adamw_factory)
    r_zero = T.Run(tiny_model_cfg, cfg0, corpus, adamw_factory)
    own = eval_offsets(corpus.val, r_default.seq_len, cfg0.eval_seqs, 1)
    zero = eval_offsets(corpus.val, r_default.seq_len, cfg0.eval_seqs, 0)
    assert (r_default.eval_offsets == own).all() and not (own == zero).all()
    assert (r_fixed.eval_offsets == zero).all() and (r_zero.eval_offsets == zero).all()
    # the fingerprint names a set eval_seed only (checkpoints from before the option still resume)
    assert "eval_seed" not in r_default.fingerprint()["train"] and r_fixed.fingerprint()["train"]["eval_seed"] == 0
    with pytest.raises(ValueError, match="eval_seed must be None or a non-negative integer"):
        replace(cfg0, eval_seed=-1)
