"""Sharded (FSDP2, gloo) safety contracts: one rank's NaN makes every rank refuse (or skip) the step,
and a checkpoint another optimizer or layout cannot take is refused before anything loads.

Non-finite gradients, on 2 and 4 ranks, for a representative set (Dobb, Dobb-Muon, block Muon over
the sharded axis, Muon, SOAP): a NaN in one rank's shard of ``fc1.weight`` (and an Inf in one rank's
``norm.weight``, the AdamW part) is a ``ValueError`` naming it on every rank, with every full weight
and state tensor bitwise as before; ``nonfinite="skip"`` leaves them as before too, and with finite
gradients gives bitwise the default run (reference: the same optimizer that never saw the bad step).

Checkpoints (DCP, 2 -> 4 ranks): Dobb-Muon saved with ``out_blocks=2`` on 2 ranks cannot resume on 4
(row blocks must fit a shard) built with ``out_blocks=4``: ``check_resume`` refuses it naming both
values before the weights load, and so does ``set_optimizer_state_dict`` (``load_state_dict``),
leaving the group's ``out_blocks`` as built. A checkpoint of Muon is refused by Dobb naming both.
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, \
    set_optimizer_state_dict

from _common import Net, data
from _spawn import spawn

from dobb import build_optimizer
from dobb.resume import check_resume

pytestmark = pytest.mark.slow
F64 = {"basis_dtype": torch.float64, "stat_dtype": torch.float64}
CASES = {
    "dobb": {"blocks": 4, "refresh_every": 2, **F64},
    "dobb-muon": {"blocks": 4, "out_blocks": 4, "refresh_every": 2, **F64},
    "block-muon": {"blocks": 4, "axis": 0},
    "muon": {},
    "soap": {"precondition_frequency": 2},
}


def _make(name, world, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.fc1, model.fc2, model.head, model):
        fully_shard(m, mesh=mesh)
    return model, build_optimizer(name, model, lr=0.02, weight_decay=0.01, **{**CASES[name], **kw})


def _backward(model, batch, world, rank):
    x, y = batch
    rows = x.shape[0] // world
    torch.nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]).backward()


def _full(v):
    if isinstance(v, torch.Tensor):
        return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return v


def _everything(model, opt):
    """Every full weight and every full state value (collectives: the same on every rank)."""
    weights = [_full(p) for p in model.parameters()]
    state = [(i, k, _full(v)) for i, st in sorted(opt.state_dict()["state"].items()) for k, v in sorted(st.items())]
    return weights, state


def _same(a, b) -> bool:
    (wa, sa), (wb, sb) = a, b
    if len(wa) != len(wb) or len(sa) != len(sb):
        return False
    ok = all(torch.equal(x, y) for x, y in zip(wa, wb))
    for (i, k, x), (j, l, y) in zip(sa, sb):
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        ok = ok and (i, k) == (j, l) and bool(same)
    return ok


def _poison(model, where, rank, value):
    p = dict(model.named_parameters())[where]
    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
    if rank == 1 and g.numel():
        g.view(-1)[0] = value


def nonfinite_contract(rank, world, names):
    out = {}
    batches = data(4)
    for name in names:
        try:
            ref, ref_opt = _make(name, world)
            model, opt = _make(name, world)
            sk, sk_opt = _make(name, world, nonfinite="skip")
            runs = ((ref, ref_opt), (model, opt), (sk, sk_opt))
            for m, o in runs:
                _backward(m, batches[0], world, rank)
                o.step()
                o.zero_grad()
            errors = []
            for where, value in (("fc1.weight", float("nan")), ("norm.weight", float("inf"))):
                _backward(model, batches[1], world, rank)
                _poison(model, where, rank, value)
                before = _everything(model, opt)
                try:
                    opt.step()
                    errors.append(None)
                except ValueError as exc:
                    errors.append(str(exc))
                errors.append(_same(_everything(model, opt), before))
                opt.zero_grad()
            _backward(sk, batches[1], world, rank)
            _poison(sk, "fc1.weight", rank, float("nan"))
            before = _everything(sk, sk_opt)
            sk_opt.step()
            sk_opt.zero_grad()
            skipped_same = _same(_everything(sk, sk_opt), before)
            for t in (1, 2, 3):
                for m, o in runs:
                    _backward(m, batches[t], world, rank)
                    o.step()
                    o.zero_grad()
            end = _everything(ref, ref_opt)
            out[name] = {"errors": errors, "skipped_same": skipped_same,
                         "raise_then_default": _same(_everything(model, opt), end),
                         "skip_then_default": _same(_everything(sk, sk_opt), end)}
        except Exception:  # noqa: BLE001 - reported by the test
            out[name] = {"trace": traceback.format_exc()}
        dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_one_ranks_nan_makes_every_rank_refuse_or_skip(world):
    results = spawn(nonfinite_contract, world, sorted(CASES), timeout_s=600)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert "trace" not in r, f"rank {rank}, {name}:\n{r.get('trace')}"
            nan_msg, nan_same, inf_msg, inf_same = r["errors"]
            assert nan_msg is not None and "non-finite gradient (NaN or Inf) in fc1.weight on 1 of " \
                f"{world} ranks" in nan_msg, (rank, name, nan_msg)
            assert inf_msg is not None and "in norm.weight on 1 of" in inf_msg, (rank, name, inf_msg)
            assert nan_same and inf_same, (rank, name)
            assert r["skipped_same"], (rank, name)
            assert r["raise_then_default"] and r["skip_then_default"], (rank, name, r)


# ----------------------------------------------------------------------------- checkpoints
def _sd(model, opt):
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def save(rank, world, root):
    batches = data(2)
    for name, kw, sub in (("dobb-muon", {"out_blocks": 2}, "dobb-muon"), ("muon", {}, "muon")):
        model, opt = _make(name, world, **kw)
        for t in range(2):
            _backward(model, batches[t], world, rank)
            opt.step()
            opt.zero_grad()
        dcp.save(_sd(model, opt), checkpoint_id=os.path.join(root, sub))
    return True


def resume(rank, world, root):
    out = {}
    model, opt = _make("dobb-muon", world, out_blocks=4)
    weights = [_full(p) for p in model.parameters()]
    path = os.path.join(root, "dobb-muon")
    try:
        check_resume(model, opt, path)
        out["check_resume"] = None
    except ValueError as exc:
        out["check_resume"] = str(exc)
    out["weights_kept"] = all(torch.equal(a, _full(p)) for a, p in zip(weights, model.parameters()))
    sd = _sd(model, opt)
    # dcp.load writes the weights (and the state tensors) in place: check_resume is what runs first
    dcp.load(sd, checkpoint_id=path)
    try:
        set_optimizer_state_dict(model, opt, sd["optim"])
        out["load"] = None
    except ValueError as exc:
        out["load"] = str(exc)
    out["out_blocks"] = [g["out_blocks"] for g in opt.param_groups if g["algorithm"] != "adamw"]
    dobb_model, dobb_opt = _make("dobb", world)
    try:
        check_resume(dobb_model, dobb_opt, os.path.join(root, "muon"))
        out["foreign"] = None
    except ValueError as exc:
        out["foreign"] = str(exc)
    return out


def test_dobb_muon_out_blocks_saved_on_2_ranks_is_refused_on_4_before_loading(tmp_path):
    root = str(tmp_path)
    assert all(spawn(save, 2, root, timeout_s=300))
    for rank, r in enumerate(spawn(resume, 4, root, timeout_s=300)):
        for key in ("check_resume", "load"):
            msg = r[key]
            assert msg is not None and msg.startswith("Dobb-Muon cannot load") and \
                "param group 0 was saved with out_blocks=2 (this optimizer has out_blocks=4)" in msg, (rank, key, msg)
        assert r["out_blocks"] == [4], r  # never switched to the saved value
        assert r["weights_kept"]
        assert r["foreign"] is not None and r["foreign"].startswith("Dobb cannot load checkpoint") and \
            "saved by Muon (Muon)" in r["foreign"], r["foreign"]
