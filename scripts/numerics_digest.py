"""Bitwise fingerprint of every optimizer's numbers: did a refactor change any of them?

For every optimizer of ``dobb.registry`` (default options) and a set of Dobb variants, a fixed
seeded small model is trained on CPU in fp32 for ``--steps`` steps (refreshes included) and the
sha256 of the final weights and of every state tensor (and Python value) is recorded. Dobb's
capture counts are digested as one flat list of ints, so a change of their nesting alone (one
count, a list per expert, per side) is not a change of numbers. Two runs of
this script on two revisions, on the same machine and torch, compare with ``--compare a.json b.json``:
equal digests mean the two revisions compute the same numbers, bit for bit.

    PYTHONPATH=src OMP_NUM_THREADS=1 python scripts/numerics_digest.py --out before.json

``--adamw-foreach`` builds every optimizer with ``foreach=True`` (torch's foreach AdamW kernel for
the AdamW part, the default before the fused kernel became it): it compares a revision with the
fused default against one from before it, every other number bit for bit.
    python scripts/numerics_digest.py --compare before.json after.json

``--decay-all`` builds every matrix optimizer with ``decay_names`` = every parameter name (the 1-D
parameters of the AdamW part decay, as before issue 53 made them undecayed by default, and as the
bench keeps them): it compares a revision from before that change against one after it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch
from torch import nn

E = 3  # experts of the stack variants


class Transposed(nn.Module):
    """A linear layer stored ``(in, out)`` (as Hugging Face's Conv1D): a ``transposed=True`` group."""

    dobb_transposed = True

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Experts(nn.Module):
    """Top-1 routing by a fixed router into an ``(E, out, in)`` stack; routed rows fed to ``capture``."""

    dobb_capture = False
    dobb_experts = ("w",)

    def __init__(self, d, h):
        super().__init__()
        self.router = nn.Linear(d, E, bias=False).requires_grad_(False)
        self.w = nn.Parameter(torch.randn(E, h, d) / d**0.5)
        self.capture = None

    def forward(self, x):
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        choice = self.router(x).argmax(-1)
        out = x.new_zeros(x.shape[0], self.w.shape[1])
        for e in range(E):
            idx = (choice == e).nonzero().squeeze(-1)
            rows = x[idx]
            if self.capture is not None:
                self.capture(self.w, rows, expert=e)
            out[idx] = rows @ self.w[e].T
        return out.reshape(*lead, -1)


class Net(nn.Module):
    def __init__(self, experts: bool):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 20, bias=False)
        self.proj = Transposed(20, 16)
        self.moe = Experts(16, 12) if experts else None
        self.norm = nn.LayerNorm(12 if experts else 16)
        self.head = nn.Linear(12 if experts else 16, 32)

    def forward(self, tokens):
        x = self.emb(tokens)
        x = torch.nn.functional.gelu(self.fc1(x))
        x = torch.nn.functional.gelu(self.fc2(x))
        x = self.proj(x)
        if self.moe is not None:
            x = self.moe(x)
        return self.head(self.norm(x))


def variants() -> list[tuple[str, str, dict, bool]]:
    """(label, registry name, hyperparameters, expert stack model)."""
    from dobb import registry

    out = [(name, name, {}, False) for name in registry.OPTIMIZER_NAMES]
    dobb_variants = {
        "blocks=1": dict(blocks=1),
        "blocks=4": dict(blocks=4),
        "side=both": dict(side="both"),
        "side=both:out_blocks=4": dict(side="both", out_blocks=4, blocks=2),
        "side=both:norm=adam": dict(side="both", norm="adam"),
        "side=output": dict(side="output", source="output_grad"),
        "norm=l2": dict(norm="l2", blocks=2),
        "source=grad_gram": dict(source="grad_gram", blocks=2),
        "basis=eigh": dict(basis="eigh", blocks=2),
        "stagger=false": dict(stagger=False, blocks=2),
        "split_refresh=false": dict(split_refresh=False, blocks=2),
        "split_refresh=true": dict(split_refresh=True, blocks=2),
        "nesterov": dict(nesterov=True, blocks=2),
        "refresh_width=8": dict(refresh_width=8, refresh_every=3, blocks=2),
        "init_basis=identity": dict(init_basis="identity", blocks=2),
        "capture=all": dict(capture="all", blocks=2),
        "capture_every=1": dict(capture_every=1, refresh_every=3, blocks=2),
    }
    out += [(f"dobb:{k}", "dobb", v, False) for k, v in dobb_variants.items()]
    out += [("dobb:experts", "dobb", dict(blocks=2), True),
            ("dobb:experts:grad_gram", "dobb", dict(blocks=2, source="grad_gram"), True),
            ("dobb:experts:side=output", "dobb", dict(side="output", source="grad_gram"), True)]
    return out


def flat(value) -> list:
    """Nested lists of ints as one flat list: a capture count's value, whatever the nesting of its form."""
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in flat(v)]
    return [int(value)]


def digest(value) -> str:
    h = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}[{','.join(digest(v) for v in value)}]".encode())
    elif isinstance(value, dict):
        h.update(f"{{{','.join(f'{k!r}:{digest(v)}' for k, v in sorted(value.items(), key=repr))}}}".encode())
    else:
        h.update(repr(value).encode())
    return h.hexdigest()[:24]


def run(name: str, hparams: dict, experts: bool, steps: int, adamw_foreach: bool = False,
        decay_all: bool = False) -> dict:
    import dobb

    torch.manual_seed(0)
    model = Net(experts)
    grouping = {"experts": ["moe.w"]} if experts else {}
    if decay_all and dobb.registry.get(name).is_matrix:
        grouping["decay_names"] = [n for n, _ in model.named_parameters()]
    if adamw_foreach:
        hparams = dict(hparams, foreach=True)
    opt = dobb.build_optimizer(name, model, lr=0.02, weight_decay=0.01, **grouping, **hparams)
    if experts and hparams.get("source", "activation") == "activation":
        model.moe.capture = opt.capture
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 32, (4, 9), generator=gen) for _ in range(steps)]
    for tokens in data:
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
    names = {p: n for n, p in model.named_parameters()}
    out = {"weights": {n: digest(p) for n, p in model.named_parameters()}, "state": {}}
    for p, st in opt.state.items():
        out["state"][names.get(p, "?")] = {k: digest(flat(v) if k == "captures" else v)
                                           for k, v in sorted(st.items())}
    out["loss"] = float(loss)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the JSON here (default: stdout)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", help="comma-separated labels")
    parser.add_argument("--adamw-foreach", action="store_true",
                        help="foreach=True for every optimizer (torch's foreach AdamW kernel in the AdamW part)")
    parser.add_argument("--decay-all", action="store_true",
                        help="every AdamW-part parameter decays, the 1-D ones included (decay_names = every "
                             "name): the default before issue 53, and what the bench passes")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two JSON files and exit")
    args = parser.parse_args()
    if args.compare:
        a, b = (json.load(open(f))["runs"] for f in args.compare)
        differ = [k for k in a if k in b and a[k] != b[k]]
        missing = sorted(set(a) ^ set(b))
        for k in differ:
            print(f"DIFFERENT: {k}")
        for k in missing:
            print(f"only in one: {k}")
        print(f"{len([k for k in a if k in b]) - len(differ)} equal, {len(differ)} different, {len(missing)} in one only")
        return 1 if differ else 0
    torch.use_deterministic_algorithms(True)
    only = set(args.only.split(",")) if args.only else None
    runs = {}
    for label, name, hparams, experts in variants():
        if only and label not in only:
            continue
        runs[label] = run(name, hparams, experts, args.steps, args.adamw_foreach, args.decay_all)
        print(f"{label}: loss {runs[label]['loss']:.6f}", file=sys.stderr)
    text = json.dumps({"torch": torch.__version__, "steps": args.steps,
                       "adamw_foreach": args.adamw_foreach, "runs": runs}, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
