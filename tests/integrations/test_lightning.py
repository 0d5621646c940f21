"""Lightning: configure_optimizers returns Dobb; automatic optimization equals a hand-written loop,
and a Lightning checkpoint resumes to the same weights."""
import warnings

import pytest
import torch
from torch import nn

pl = pytest.importorskip("pytorch_lightning")

import dobb  # noqa: E402
from dobb.integrations.lightning import configure_optimizers  # noqa: E402

VOCAB, WIDTH, SEQ, BATCH, BATCHES = 32, 32, 9, 8, 10


class TinyLM(pl.LightningModule):
    def __init__(self, seed=0, **opt_kwargs):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))
        self.opt_kwargs = opt_kwargs

    def loss(self, batch):
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return configure_optimizers(self, "dobb", lr=1e-2, weight_decay=0.01, warmup_steps=3, **self.opt_kwargs)


def _loader():
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (BATCH * BATCHES, 1), generator=g)
    tokens = (start + 3 * torch.arange(SEQ)) % VOCAB
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=BATCH, shuffle=False)


def _trainer(tmp_path, epochs, callbacks=()):
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=list(callbacks), default_root_dir=str(tmp_path),
                      enable_checkpointing=bool(callbacks))


def _fit(module, tmp_path, epochs, callbacks=(), ckpt_path=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # num_workers / log-dir hints
        _trainer(tmp_path, epochs, callbacks).fit(module, _loader(), ckpt_path=ckpt_path)


def _hand_written_loop(module, epochs):
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    module.train()
    for _ in range(epochs):
        for batch in _loader():
            module.loss(batch).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    return opt


@pytest.mark.parametrize("opt_kwargs", [dict(blocks=2, refresh_every=3), dict(refresh_every=1, capture="all")])
def test_automatic_optimization_equals_a_hand_written_loop_and_resumes_exactly(tmp_path, opt_kwargs):
    reference = TinyLM(**opt_kwargs)
    ref_opt = _hand_written_loop(reference, epochs=2)

    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_epochs=1,
                                        filename="{epoch}")
    module = TinyLM(**opt_kwargs)
    _fit(module, tmp_path / "a", 2, [ckpt])
    opt = module.trainer.optimizers[0]
    assert isinstance(opt, dobb.Dobb)
    matrices = list(opt.iter_matrix_params())
    assert len(matrices) == 2
    for p, q in zip(matrices, ref_opt.iter_matrix_params()):
        # one capture per closure evaluation: as many statistics as the hand-written loop took
        # (the refresh steps: the first, then every T-th from the matrix's staggered offset)
        period, offset = opt_kwargs["refresh_every"], opt._plans[p].offset
        due = sum(1 for t in range(20) if t == 0 or (t - offset) % period == 0)
        assert opt.state[p]["captures"] == ref_opt.state[q]["captures"] == [[due]]
        torch.testing.assert_close(opt.state[p]["stat"], ref_opt.state[q]["stat"], atol=1e-6, rtol=0)
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)

    resumed = TinyLM(seed=1, **opt_kwargs)
    _fit(resumed, tmp_path / "b", 2, ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"))
    assert resumed.trainer.global_step == 20
    for (name, p), q in zip(module.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0, msg=name)


def test_configure_optimizers_without_warmup_returns_the_optimizer_and_checks_arguments():
    module = TinyLM()
    assert isinstance(configure_optimizers(module, "muon", lr=1e-3), dobb.Muon)
    with pytest.raises(ValueError, match="warmup_steps"):
        configure_optimizers(module, lr=1e-3, warmup_steps=-1)
    with pytest.raises(ValueError, match="unknown optimizer"):
        configure_optimizers(module, "sgd", lr=1e-3)
