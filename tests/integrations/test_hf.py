"""Hugging Face Trainer: GPT-2 and Llama from configs train with Dobb and resume exactly."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import dobb  # noqa: E402
from dobb.integrations.hf import DobbTrainer  # noqa: E402

VOCAB, SEQ, ROWS = 48, 16, 64


def _gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _dataset():
    """Arithmetic progressions mod VOCAB: the next token is predictable from the previous two."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (ROWS, 1), generator=g)
    stride = torch.randint(1, 5, (ROWS, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": r, "labels": r} for r in ids]


def _args(out, steps, save_steps=None):
    return TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-2,
        weight_decay=0.01, warmup_steps=3, logging_steps=1, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=0)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_trainer_trains_and_resumes_exactly(arch, tmp_path):
    model = MODELS[arch]()
    trainer = DobbTrainer(model=model, args=_args(tmp_path / "a", 30, save_steps=15), train_dataset=_dataset(),
                          optimizer_kwargs={"blocks": 2, "refresh_every": 4})
    trainer.train()
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # accelerate's wrapper
    assert isinstance(opt, dobb.Dobb)
    matrices = [p for g in opt.param_groups if g["algorithm"] == "dobb" for p in g["params"]]
    # every hidden projection of both blocks reaches Dobb (GPT-2's Conv1D too), and nothing else:
    # GPT-2 c_attn, attn c_proj, c_fc, mlp c_proj; Llama q, k, v, o, gate, up, down
    assert len(matrices) == {"gpt2": 2 * 4, "llama": 2 * 7}[arch]
    # statistics were captured through the Trainer's forward passes: ceil(30 / 4) refreshes
    assert all(opt.state[p]["captures"] == [[8]] for p in matrices)
    losses = _losses(trainer)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses

    resumed = DobbTrainer(model=MODELS[arch](seed=1), args=_args(tmp_path / "b", 30), train_dataset=_dataset(),
                          optimizer_kwargs={"blocks": 2, "refresh_every": 4})
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-15"))
    for (name, p), q in zip(model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0, msg=name)
    assert _losses(resumed) == pytest.approx(losses, abs=1e-6)  # its log history starts from the checkpoint's


def test_decay_split_follows_the_trainer_and_plain_trainer_accepts_the_optimizer(tmp_path):
    model = _llama()
    args = _args(tmp_path, 2)
    decay = set(Trainer(model=model, args=args).get_decay_parameter_names(model))
    groups = dobb.param_groups(model, decay_names=decay)
    by_wd = {(g["algorithm"], g.get("weight_decay")): {id(p) for _, p in g["params"]} for g in groups}
    norms = {id(p) for n, p in model.named_parameters() if "norm" in n}
    assert norms and norms <= by_wd[("adamw", 0.0)]
    assert id(model.model.embed_tokens.weight) in by_wd[("adamw", None)]
    opt = dobb.build_optimizer("muon", model, lr=1e-3, weight_decay=0.1, decay_names=decay)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset(), optimizers=(opt, None))
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    trainer.train()
    assert not torch.equal(before, model.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="weight_decay"):
        DobbTrainer(model=model, args=args, optimizer_kwargs={"weight_decay": 0.1})
    with pytest.raises(ValueError, match="unknown optimizer"):
        dobb.build_optimizer("adam", model, lr=1e-3)


class _Experts(torch.nn.Module):
    """A 3-D expert stack declared by full name only (``experts=``), beside a linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.randn(2, 8, 8) / 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, input_ids=None, labels=None):
        return {"loss": self.norm(self.proj(torch.ones(1, 8))).sum()}


def _groups_by_name(opt, model):
    names = {id(p): n for n, p in model.named_parameters()}
    return sorted((g.get("algorithm", "adamw"), g["weight_decay"], g.get("blocks"), tuple(sorted(names[id(p)] for p in g["params"])))
                  for g in opt.param_groups)


@pytest.mark.parametrize("name", ["dobb", "muon", "adamw"])
def test_trainer_forwards_what_build_optimizer_takes(name, tmp_path):
    """DobbTrainer builds exactly what dobb.build_optimizer builds from the same arguments, the
    grouping ones included (``experts=`` reached Dobb as an unknown argument before the one builder)."""
    model = _Experts()
    kwargs = {"dobb": {"experts": ["w"], "blocks": 2, "source": "grad_gram"}, "muon": {"experts": ["w"]},
              "adamw": {}}[name]
    args = _args(tmp_path, 1)
    trainer = DobbTrainer(model=model, args=args, optimizer_name=name, optimizer_kwargs=kwargs)
    opt = trainer.create_optimizer()
    decay = Trainer(model=model, args=args).get_decay_parameter_names(model)
    ref = dobb.build_optimizer(name, model, lr=args.learning_rate, weight_decay=args.weight_decay,
                               decay_names=decay, **kwargs)
    assert type(opt) is type(ref)
    assert _groups_by_name(opt, model) == _groups_by_name(ref, model)
    if name == "dobb":  # the stack is a Dobb matrix; the norm gets no weight decay (the Trainer's rule)
        assert ("dobb", args.weight_decay, 2, ("proj.weight", "w")) in _groups_by_name(opt, model)
    with pytest.raises(ValueError, match="blocks"):  # the registry's validation, at construction
        DobbTrainer(model=model, args=args, optimizer_name="dobb", optimizer_kwargs={"blocks": "4"})
