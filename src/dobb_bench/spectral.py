"""Spectral experiments: update orthogonality (paper Tables 1 and 2) and the effective rank of the
captured second moments (Figure 2). CLI: ``dobb-bench orthogonality`` and ``dobb-bench spectrum``.

The experiment functions return plain rows (lists of dicts) so tests can check them without the
CLI; the CLI only formats them. All matrix math is float64: the outputs are compared with the
paper's three decimals. See docs/spectral.md for the constructions and measured numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dobb import metrics
from dobb_bench.cli import CliError

TABLE1_TARGETS = (0.80, 0.50, 0.20, 0.05)
# Paper Table 1(a): effective rank -> (orthogonality of Y, of sign(Y)).
PAPER_1A = {0.80: (0.736, 0.775), 0.50: (0.412, 0.643), 0.20: (0.205, 0.543), 0.05: (0.109, 0.457)}
# Paper Table 2 (GPT-2 Small, step 5000): B -> (Dobb, Dion at r = min(m, n) / B).
PAPER_2 = {1: (0.849, 0.804), 4: (0.834, 0.427), 16: (0.815, 0.208)}
F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- Table 1(a)
def table1a(size: int = 768, seeds: int = 3, targets=TABLE1_TARGETS, profile: str = "power") -> list[dict]:
    """Orthogonality of ``Y`` (``size x size``, prescribed singular-value effective rank) and of
    ``sign(Y)``, averaged over ``seeds`` draws of the random singular vectors."""
    rows = []
    for t in targets:
        oy, os_ = [], []
        for seed in range(seeds):
            Y = metrics.matrix_with_effective_rank(size, size, t, _gen(seed), profile=profile)
            oy.append(metrics.orthogonality(Y))
            os_.append(metrics.orthogonality(torch.sign(Y)))
        paper = PAPER_1A.get(t, (None, None))
        rows.append({"erank": t, "Y": statistics.fmean(oy), "sign(Y)": statistics.fmean(os_),
                     "paper Y": paper[0], "paper sign(Y)": paper[1]})
    return rows


# ----------------------------------------------------------------------------- Table 1(b)
def factor_with_second_moment(dim: int, tokens: int, target: float, gen: torch.Generator,
                              profile: str = "power") -> torch.Tensor:
    """``dim x tokens`` matrix Z whose second moment (1/N) Z Z^T has effective rank ``target``
    *exactly*: Z = U diag(sqrt(N l)) V^T with random orthonormal U (dim x dim), V (N x dim)."""
    if tokens < dim:
        raise ValueError(f"tokens must be >= the dimension {dim}, got {tokens}")
    lam = metrics.spectrum_with_effective_rank(dim, target, profile)
    U = metrics.random_orthonormal(dim, dim, gen)
    V = metrics.random_orthonormal(tokens, dim, gen)
    return (U * (tokens * lam).sqrt()) @ V.T


def dobb_direction(U: torch.Tensor, A: torch.Tensor, blocks: int = 1, norm: str = "sign") -> torch.Tensor:
    """Dobb's raw update for momentum ``U`` (m x n) with exact eigenbases of the ``blocks``
    diagonal blocks of the activation second moment ``A`` (n x n); uses ``dobb.functional``."""
    from dobb import functional as F

    sizes = F.block_sizes(U.shape[1], blocks)
    basis = torch.zeros(U.shape[1], max(sizes), dtype=F64)
    start = 0
    for s in sizes:
        basis[start:start + s, :s] = F.eigh_basis(A[start:start + s, start:start + s].to(F64))
        start += s
    return F.direction_input(U.to(F64), basis, sizes, norm=norm)


def table1b(size: int = 768, seeds: int = 3, targets=TABLE1_TARGETS, act_target: float = 0.15,
            tokens: int | None = None, profile: str = "power") -> list[dict]:
    """Sign (Dobb) vs column-l2 normalization of the coefficients of G = D X^T in the eigenbasis
    of the full activation second moment (one block). ``targets`` are the effective ranks of the
    output-gradient second moment (1/N) D D^T; (1/N) X X^T has effective rank ``act_target``."""
    tokens = tokens or 4 * size
    rows = []
    for t in targets:
        vals = {"G": [], "Dobb (sign)": [], "column l2": []}
        for seed in range(seeds):
            g = _gen(seed)
            D = factor_with_second_moment(size, tokens, t, g, profile)
            X = factor_with_second_moment(size, tokens, act_target, g, profile)
            G, A = D @ X.T, (X @ X.T) / tokens
            vals["G"].append(metrics.orthogonality(G))
            vals["Dobb (sign)"].append(metrics.orthogonality(dobb_direction(G, A, 1, "sign")))
            vals["column l2"].append(metrics.orthogonality(dobb_direction(G, A, 1, "l2")))
        rows.append({"erank G": t, **{k: statistics.fmean(v) for k, v in vals.items()}})
    return rows


# ----------------------------------------------------------------------------- Table 2
def dion_direction(M: torch.Tensor, rank: int, gen: torch.Generator) -> torch.Tensor:
    """One-shot Dion (rank ``r``): P = orth(M Q0) from a random Q0 (n x r), R = M^T P, unit-norm
    columns of R, O = P R^T. No error feedback or warm start: this is the first step of Dion on
    the given momentum, which is what a single checkpoint can measure."""
    M = M.to(F64)
    Q0 = torch.randn(M.shape[1], rank, generator=gen, dtype=F64)
    P = torch.linalg.qr(M @ Q0).Q
    R = M.T @ P
    R = R / R.norm(dim=0, keepdim=True).clamp_min(1e-300)
    return P @ R.T


def table2_rows(stats, blocks=(1, 4, 16), seed: int = 0) -> list[dict]:
    """Average orthogonality over matrices of Dobb (B blocks, exact block eigenbases) and Dion
    (rank min(m, n) / B) updates. ``stats`` is a list of ``(momentum m x n, activation second
    moment n x n)`` pairs."""
    if not stats:
        raise ValueError("stats must hold at least one (momentum, second moment) pair")
    g = _gen(seed)
    rows = []
    for B in blocks:
        dobb, dion = [], []
        for Mom, A in stats:
            dobb.append(metrics.orthogonality(dobb_direction(Mom, A, B)))
            dion.append(metrics.orthogonality(dion_direction(Mom, max(1, min(Mom.shape) // B), g)))
        paper = PAPER_2.get(B, (None, None))
        rows.append({"B": B, "Dobb": statistics.fmean(dobb), "Dion rank": f"min(m,n)/{B}",
                     "Dion": statistics.fmean(dion), "paper Dobb": paper[0], "paper Dion": paper[1]})
    return rows


# ----------------------------------------------------------------------------- capture
class SecondMomentCapture:
    """Accumulates, while ``enabled``, the activation second moment x^T x / N (input of each
    ``nn.Linear``, n x n) and the output-gradient second moment g^T g / N (m x m) in float64.

    A forward hook sees the input; it registers a tensor hook on the output so the backward pass
    delivers g = dLoss/dOutput. Hooks, not optimizer internals, so any optimizer can drive training.
    """

    def __init__(self, modules: dict):
        self.modules, self.enabled = dict(modules), False
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in self.modules.items()]
        self.reset()

    def reset(self):
        self.sums = {name: {"A": 0.0, "G": 0.0, "nA": 0, "nG": 0} for name in self.modules}

    def _hook(self, name):
        def fwd(module, inputs, output):
            if not self.enabled:
                return
            s = self.sums[name]
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(F64)
            s["A"], s["nA"] = s["A"] + x.T @ x, s["nA"] + x.shape[0]
            if output.requires_grad:
                def bwd(g):
                    g = g.detach().reshape(-1, g.shape[-1]).to(F64)
                    s["G"], s["nG"] = s["G"] + g.T @ g, s["nG"] + g.shape[0]
                output.register_hook(bwd)
        return fwd

    def moments(self) -> dict:
        """name -> {"A": n x n, "G": m x m (absent without a backward pass)}."""
        out = {}
        for name, s in self.sums.items():
            if s["nA"]:
                out[name] = {"A": s["A"] / s["nA"], **({"G": s["G"] / s["nG"]} if s["nG"] else {})}
        return out

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []


# ----------------------------------------------------------------------------- training run
def hidden_linears(model) -> dict:
    """name -> nn.Linear for every hidden matrix: all ``nn.Linear`` layers except an output head
    (a weight shared with an embedding, or a module named ``head``/``lm_head``). Decided here by
    module type and name, not by shape, so a width equal to the context or vocabulary is no issue."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m.weight) not in tied
            and name.rsplit(".", 1)[-1] not in ("head", "lm_head")}


def make_optimizer(name: str, model, lr: float, weight_decay: float):
    """``dobb`` (Dobb on the matrices of ``hidden_linears``, AdamW on the rest) or ``adamw`` built
    here; any other name through ``dobb.build_optimizer`` when the library has it. The explicit
    split keeps these runs independent of the library's shape-based default split."""
    import dobb

    if name == "dobb":
        ids = {id(m.weight) for m in hidden_linears(model).values()}
        groups = dobb.param_groups(model, is_matrix=lambda _n, _m, p: id(p) in ids)
        return dobb.Dobb(groups, model, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    if hasattr(dobb, "build_optimizer"):
        return dobb.build_optimizer(name, model, lr=lr, weight_decay=weight_decay)
    raise CliError(f"optimizer {name!r} needs dobb.build_optimizer (not available yet); use dobb or adamw")


def setup_run(preset: str, data, batch_size: int, seed: int):
    """Model (from dobb_bench.model) and the deterministic batch sampler (dobb_bench.data)."""
    from dobb_bench.data import BatchSampler, load_corpus
    from dobb_bench.model import GPT, config_from_preset

    corpus = load_corpus(data)
    cfg = config_from_preset(preset, vocab_size=corpus.vocab_size)
    model = GPT(cfg, seed=seed)
    return model, BatchSampler(corpus.train, cfg.seq_len, batch_size, seed)


def _loss(model, sampler, step: int):
    x, y = sampler.micro_batch(step, 0, 1)
    return model(x, y)[1]


def train(model, sampler, optimizer, stop: int, start: int = 0, on_step=None) -> list[float]:
    """Plain loop over steps ``start+1 .. stop``: forward, backward, ``on_step(step)`` (gradients
    present), optimizer step. Returns the training losses."""
    losses = []
    model.train()
    for step in range(start + 1, stop + 1):
        loss = _loss(model, sampler, step)
        loss.backward()
        if on_step is not None:
            on_step(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def probe_moments(model, sampler, capture: SecondMomentCapture, batches: int, first_step: int) -> dict:
    """Second moments averaged over ``batches`` forward+backward passes at the current weights
    (no optimizer step; gradients are discarded). The same probe batches are used at every
    fraction, so changes across fractions come from the weights only. (An optimizer with its own
    capture hooks, such as Dobb, may take its next statistic from a probe batch instead of the next
    training batch: another random batch of the same data, so the run is not biased.)"""
    capture.reset()
    capture.enabled = True
    try:
        for k in range(batches):
            _loss(model, sampler, first_step + k).backward()
    finally:
        capture.enabled = False
        model.zero_grad(set_to_none=True)
    return capture.moments()


def _layer_and_type(name: str) -> tuple[int, str]:
    """'blocks.3.attn.qkv' -> (3, 'attn.qkv')."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return int(p), ".".join(parts[i + 1:]) or name
    return 0, name


def _split_qkv(name: str, G: torch.Tensor):
    """The fused attention projection's output gradient as its q, k, v diagonal blocks (Fig. 2)."""
    if name.endswith("qkv") and G.shape[0] % 3 == 0:
        d = G.shape[0] // 3
        return [(name[:-3] + s, G[i * d:(i + 1) * d, i * d:(i + 1) * d]) for i, s in enumerate("qkv")]
    return [(name, G)]


def spectrum_rows(moments: dict, fraction: float) -> list[dict]:
    """One row per (statistic, layer, matrix type): effective rank as a percentage."""
    rows = []
    for name, st in moments.items():
        layer, typ = _layer_and_type(name)
        rows.append({"fraction": fraction, "stat": "A", "layer": layer, "type": typ,
                     "erank %": 100 * metrics.effective_rank_of_psd(st["A"])})
        for sub, G in _split_qkv(name, st["G"]) if "G" in st else []:
            rows.append({"fraction": fraction, "stat": "G", "layer": layer, "type": _layer_and_type(sub)[1],
                         "erank %": 100 * metrics.effective_rank_of_psd(G)})
    return rows


def run_spectrum(preset="small-cpu", steps=400, fractions=(0.25, 0.5, 0.75, 1.0), optimizer="dobb",
                 lr=2.5e-3, weight_decay=0.1, batch_size=16, probe_batches=4, seed=0, data=None):
    """Figure 2: train, and at each fraction of ``steps`` measure the effective rank of every hidden
    layer's activation (A) and output-gradient (G) second moments. Returns (rows, losses)."""
    model, sampler = setup_run(preset, data, batch_size, seed)
    capture = SecondMomentCapture(hidden_linears(model))
    opt = make_optimizer(optimizer, model, lr, weight_decay)
    at = {max(1, round(f * steps)): f for f in fractions}
    if len(at) < len(set(fractions)):
        raise ValueError(f"steps={steps} is too few to measure at {len(set(fractions))} distinct fractions")
    rows, losses, done = [], [], 0
    for stop in sorted(at):
        losses += train(model, sampler, opt, stop, start=done)
        done = stop
        rows += spectrum_rows(probe_moments(model, sampler, capture, probe_batches, 10**6), at[stop])
    capture.remove()
    return rows, losses


# ----------------------------------------------------------------------------- Table 2 sources
class MomentumAndStats:
    """``on_step`` callback: the Muon/Dobb momentum M <- mu M + grad of every hidden matrix and an
    EMA of its activation second moment captured at every step (the paper's Table 2 setting).
    Kept here, not read from optimizer state, so any optimizer (or none) can produce it."""

    def __init__(self, model, mu: float = 0.95, decay: float = 0.9):
        self.linears = hidden_linears(model)
        self.capture = SecondMomentCapture(self.linears)
        self.capture.enabled = True
        self.mu, self.decay, self.M, self.A = mu, decay, {}, {}

    def __call__(self, step: int):
        for name, st in self.capture.moments().items():
            self.A[name] = st["A"] if name not in self.A else self.decay * self.A[name] + (1 - self.decay) * st["A"]
        self.capture.reset()
        for name, lin in self.linears.items():
            g = lin.weight.grad.detach().to(F64)
            self.M[name] = g if name not in self.M else self.mu * self.M[name] + g

    def pairs(self, split_qkv: bool = True) -> list:
        """(momentum, A) per matrix; a fused qkv weight counts as its three d x n row blocks, as
        the paper's 72 matrices of GPT-2 Small (12 layers x q, k, v, proj, fc, proj) do."""
        out = []
        for name, Mom in self.M.items():
            parts = Mom.chunk(3, 0) if split_qkv and name.endswith("qkv") and Mom.shape[0] % 3 == 0 else [Mom]
            out += [(p, self.A[name]) for p in parts]
        return out

    def close(self):
        self.capture.remove()


def table2_from_training(preset="small-cpu", steps=300, optimizer="dobb", lr=2.5e-3, weight_decay=0.1,
                         batch_size=16, seed=0, data=None, blocks=(1, 4, 16), checkpoint=None,
                         probe_steps=20):
    """Table 2 on a model of this harness. Returns (rows, info).

    Without ``checkpoint``: ``preset`` is trained ``steps`` steps with ``optimizer``; the momentum
    and the activation statistics (captured at every step) of the last step are used.
    With ``checkpoint`` (``dobb-bench train``'s ``checkpoint.pt`` or its run folder): the weights
    are loaded, the activation statistics are captured over ``probe_steps`` batches at those fixed
    weights, and the momentum is the checkpoint's own optimizer state when it has one per hidden
    matrix (``momentum``, ``momentum_buffer`` or AdamW's ``exp_avg``; the metric is scale-free),
    else it is rebuilt from the ``probe_steps`` gradients."""
    saved = None
    if checkpoint is not None:
        model, sampler, saved = load_checkpoint(checkpoint, data, batch_size, seed)
        opt, stop, start = _NoStep(), 10**6 + probe_steps, 10**6
    else:
        model, sampler = setup_run(preset, data, batch_size, seed)
        opt, stop, start = make_optimizer(optimizer, model, lr, weight_decay), steps, 0
    track = MomentumAndStats(model)
    losses = train(model, sampler, opt, stop, start=start, on_step=track)
    track.close()
    if saved is not None:
        track.M = saved
    pairs = track.pairs()
    rows = table2_rows(pairs, blocks, seed)
    shapes = sorted({tuple(M.shape) for M, _ in pairs})
    momentum = ("trained run" if checkpoint is None else "checkpoint optimizer state" if saved is not None
                else f"rebuilt from {probe_steps} gradients at the checkpoint")
    return rows, {"matrices": len(pairs), "shapes": shapes, "final loss": losses[-1], "momentum": momentum}


class _NoStep:
    """Stands in for an optimizer when the weights must stay those of the checkpoint."""

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


def load_checkpoint(path, data, batch_size: int, seed: int):
    """(model, sampler, momentum or None) from a ``dobb-bench train`` checkpoint: a ``torch.save``d
    dict with the model ``state_dict`` under ``model`` and the ``ModelConfig`` fields under
    ``fingerprint.model`` (or ``config``)."""
    from dobb_bench.data import BatchSampler, load_corpus
    from dobb_bench.model import GPT, ModelConfig

    path = Path(path)
    if path.is_dir():
        if (path / "checkpoint_dcp").exists() and not (path / "checkpoint.pt").exists():
            raise CliError(f"{path} holds a sharded (FSDP/DCP) checkpoint; only checkpoint.pt files are supported")
        path = path / "checkpoint.pt"
    if not path.is_file():
        raise CliError(f"checkpoint {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a user error here
        raise CliError(f"cannot read checkpoint {path}: {exc}") from None
    ckpt = ckpt if isinstance(ckpt, dict) else {}
    cfg = ckpt.get("config") or (ckpt.get("fingerprint") or {}).get("model")
    if not isinstance(cfg, dict) or "model" not in ckpt:
        raise CliError(f"checkpoint {path} must hold 'model' (state_dict) and 'fingerprint.model' or 'config' "
                       "(ModelConfig fields)")
    model = GPT(ModelConfig(**{k: v for k, v in cfg.items() if k in ModelConfig.__dataclass_fields__}))
    model.load_state_dict(ckpt["model"])
    corpus = load_corpus(data)
    if corpus.vocab_size > model.config.vocab_size:
        raise CliError(f"corpus vocabulary {corpus.vocab_size} exceeds the checkpoint's {model.config.vocab_size}")
    sampler = BatchSampler(corpus.train, model.config.seq_len, batch_size, seed)
    return model, sampler, checkpoint_momentum(ckpt, model)


def checkpoint_momentum(ckpt: dict, model) -> dict | None:
    """Momentum per hidden matrix from the checkpoint's optimizer state, or None. Parameters are
    matched by the order in which ``dobb.build_optimizer`` lists them (``param_groups`` order, or
    ``model.parameters()`` for AdamW); any missing buffer or shape mismatch gives None."""
    from dobb import param_groups

    opt = ckpt.get("optimizer")
    if not isinstance(opt, dict) or "state" not in opt:
        return None
    if (ckpt.get("fingerprint") or {}).get("optimizer") == "adamw":
        order = [name for name, _ in model.named_parameters()]
    else:
        order = [name for g in param_groups(model) for name, _ in g["params"]]
    ids = [i for g in opt["param_groups"] for i in g["params"]]
    if len(ids) != len(order):
        return None
    state = {name: opt["state"].get(i, {}) for name, i in zip(order, ids)}
    out = {}
    for name, lin in hidden_linears(model).items():
        st = state.get(name + ".weight", {})
        buf = next((st[k] for k in ("momentum", "momentum_buffer", "exp_avg") if k in st), None)
        if buf is None or tuple(buf.shape) != tuple(lin.weight.shape):
            return None
        out[name] = buf.detach().to(F64)
    return out


# ----------------------------------------------------------------------------- Figure 2 summary
def stability(rows: list[dict], since: float = 0.5) -> dict:
    """Change of every (statistic, type, layer) curve across the fractions >= ``since``: max - min
    of its effective rank in percentage points. Returns the largest (and its curve), the median,
    and the largest relative to the curve's mean."""
    curves = {}
    for r in rows:
        if r["fraction"] >= since - 1e-9:
            curves.setdefault((r["stat"], r["type"], r["layer"]), []).append(r["erank %"])
    changes = {"/".join(map(str, k)): (max(v) - min(v), (max(v) - min(v)) / statistics.fmean(v))
               for k, v in curves.items()}
    curve = max(changes, key=lambda k: changes[k][0])
    return {"pp": changes[curve][0], "curve": curve, "median pp": statistics.median(c[0] for c in changes.values()),
            "relative": max(c[1] for c in changes.values())}


def plot_spectrum(rows: list[dict], out_dir: Path) -> list[Path]:
    """Figure 2 layout: one PNG per statistic, one panel per fraction, effective rank vs depth,
    one curve per matrix type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fractions = sorted({r["fraction"] for r in rows})
    for stat, label in (("A", "activation second moment A (% of n)"), ("G", "output-gradient second moment G (% of m)")):
        fig, axes = plt.subplots(1, len(fractions), figsize=(3.2 * len(fractions), 3), sharey=True, squeeze=False)
        for ax, f in zip(axes[0], fractions):
            sel = [r for r in rows if r["stat"] == stat and r["fraction"] == f]
            for typ in sorted({r["type"] for r in sel}):
                pts = sorted((r["layer"], r["erank %"]) for r in sel if r["type"] == typ)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=typ)
            ax.set_title(f"{round(100 * f)}% of training")
            ax.set_xlabel("layer")
        axes[0][0].set_ylabel("effective rank (%)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center right", fontsize=7)
        fig.suptitle(label, fontsize=9)
        fig.tight_layout(rect=(0, 0, 0.9, 1))
        path = out_dir / f"spectrum_{stat}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- CLI
def markdown(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows as a markdown table; floats with 3 decimals, None as 'n/a'."""
    columns = columns or list(rows[0])
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise CliError(f"{what} must be positive integers, got {text!r}")
    return vals


def _positive(args, *names):
    for n in names:
        if getattr(args, n) is not None and getattr(args, n) <= 0:
            raise CliError(f"--{n.replace('_', '-')} must be positive, got {getattr(args, n)}")


def _add_training_args(p, steps: int):
    p.add_argument("--preset", default="small-cpu", help="model preset of dobb_bench.model (default small-cpu)")
    p.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    p.add_argument("--optimizer", default="dobb", help="optimizer that trains the model (default dobb)")
    p.add_argument("--lr", type=float, default=2.5e-3, help="default 2.5e-3 (paper grid j = -2)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="corpus (default: the interpreter's stdlib sources)")


def cmd_orthogonality(args) -> int:
    table = args.table.lower()
    if table not in ("1a", "1b", "2"):
        raise CliError(f"unknown table {args.table!r}; choose 1a, 1b or 2")
    _positive(args, "size", "seeds", "tokens", "steps", "lr", "batch_size", "probe_steps")
    if args.size < 2:
        raise CliError(f"--size must be at least 2, got {args.size}")
    if args.checkpoint is not None and table != "2":
        raise CliError("--checkpoint applies to --table 2 only")
    if not 0 < args.act_erank <= 1:
        raise CliError(f"--act-erank must be in (0, 1], got {args.act_erank}")
    if table == "1a":
        rows = table1a(args.size, args.seeds, profile=args.profile)
        print(f"Table 1(a): {args.size}x{args.size} Y, {args.profile} singular values, mean of {args.seeds} seeds")
    elif table == "1b":
        rows = table1b(args.size, args.seeds, act_target=args.act_erank, tokens=args.tokens, profile=args.profile)
        print(f"Table 1(b): G = D X^T, {args.size}x{args.size}, N = {args.tokens or 4 * args.size} tokens, "
              f"activation effective rank {args.act_erank:.0%}, mean of {args.seeds} seeds "
              "(the paper's values for 1(b) are not in the available text)")
    else:
        blocks = _int_list(args.blocks, "--blocks")
        rows, info = table2_from_training(args.preset, args.steps, args.optimizer, args.lr, args.weight_decay,
                                          args.batch_size, args.seed, args.data, blocks, args.checkpoint,
                                          args.probe_steps)
        src = f"checkpoint {args.checkpoint}" if args.checkpoint else \
            f"preset {args.preset} trained {args.steps} steps with {args.optimizer}"
        print(f"Table 2: {src}; {info['matrices']} matrices {info['shapes']}; momentum from {info['momentum']}; "
              f"last train loss {info['final loss']:.3f}")
    print(markdown([{k: f"{v:.0%}" if k.startswith("erank") else v for k, v in r.items()} for r in rows]))
    return 0


def cmd_spectrum(args) -> int:
    if args.from_json:
        path = Path(args.from_json)
        if not path.is_file():
            raise CliError(f"--from-json file {path} does not exist")
        saved = json.loads(path.read_text())
        rows, losses, a = saved["rows"], saved["losses"], argparse.Namespace(**saved["args"])
        out = path.parent
    else:
        _positive(args, "steps", "lr", "batch_size", "probe_batches")
        fractions = [int(v) / 100 for v in _int_list(args.fractions, "--fractions")]
        if max(fractions) > 1:
            raise CliError(f"--fractions are percentages in 1..100, got {args.fractions!r}")
        rows, losses = run_spectrum(args.preset, args.steps, fractions, args.optimizer, args.lr, args.weight_decay,
                                    args.batch_size, args.probe_batches, args.seed, args.data)
        out, a = Path(args.out), args
        out.mkdir(parents=True, exist_ok=True)
        (out / "spectrum.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "func"},
                                                       "rows": rows, "losses": losses}, indent=1))
    pngs = plot_spectrum(rows, out)
    print(f"Figure 2: preset {a.preset}, {a.steps} steps of {a.optimizer} (lr {a.lr}), final train loss "
          f"{losses[-1]:.3f}; second moments averaged over {a.probe_batches} probe batches")
    print(spectrum_report(rows))
    print("wrote " + ", ".join(str(p) for p in [out / "spectrum.json", *pngs]))
    return 0


def spectrum_report(rows: list[dict]) -> str:
    """Markdown tables (one per statistic: rows type/layer, columns fractions) and the changes."""
    fr = sorted({r["fraction"] for r in rows})
    cols = [f"{round(100 * f)}%" for f in fr]
    parts = []
    for stat in ("A", "G"):
        table = {}
        for r in rows:
            if r["stat"] == stat:
                table.setdefault((r["type"], r["layer"]), {"type": r["type"], "layer": r["layer"]})[
                    f"{round(100 * r['fraction'])}%"] = r["erank %"]
        parts += [f"\n{stat}: effective rank (% of dimension)", markdown([table[k] for k in sorted(table)], ["type", "layer"] + cols)]
    parts.append("\n| change over fractions | largest (pp) | curve | median (pp) | largest relative |\n|---|---|---|---|---|")
    for since in [f for f in fr[:-1] if f in (fr[0], 0.5, 0.75)] or fr:
        s = stability(rows, since)
        parts.append(f"| >= {since:.0%} | {s['pp']:.2f} | {s['curve']} | {s['median pp']:.2f} | {s['relative']:.1%} |")
    return "\n".join(parts)


def add_parsers(subparsers) -> None:
    p = subparsers.add_parser("orthogonality", help="update orthogonality (paper Tables 1 and 2)")
    p.add_argument("--table", required=True, help="1a, 1b or 2")
    p.add_argument("--size", type=int, default=768, help="matrix size for Table 1 (default 768)")
    p.add_argument("--seeds", type=int, default=3, help="random draws averaged for Table 1 (default 3)")
    p.add_argument("--profile", choices=("power", "geometric"), default="power",
                   help="singular-value / eigenvalue profile of the constructions (default power)")
    p.add_argument("--tokens", type=int, default=None, help="Table 1(b) token count N (default 4 x size)")
    p.add_argument("--act-erank", type=float, default=0.15, help="Table 1(b) activation effective rank")
    p.add_argument("--checkpoint", default=None, help="Table 2: checkpoint.pt of dobb-bench train (or its --out folder); default: train --preset")
    p.add_argument("--blocks", default="1,4,16", help="Table 2 block counts (Dion rank min(m,n)/B)")
    p.add_argument("--probe-steps", type=int, default=20, help="Table 2 with --checkpoint: gradients in the momentum")
    _add_training_args(p, steps=300)
    p.set_defaults(func=cmd_orthogonality)

    p = subparsers.add_parser("spectrum", help="effective rank of captured second moments (paper Figure 2)")
    _add_training_args(p, steps=400)
    p.add_argument("--fractions", default="25,50,75,100", help="percentages of training to measure at")
    p.add_argument("--probe-batches", type=int, default=4, help="batches averaged per measurement")
    p.add_argument("--out", default="runs/spectrum", help="folder for spectrum.json and the PNGs")
    p.add_argument("--from-json", default=None, help="re-report (tables, changes, PNGs) a saved spectrum.json; no training")
    p.set_defaults(func=cmd_spectrum)
