"""Spectral experiments as pure table functions: update orthogonality (paper Tables 1 and 2) and
the effective rank of captured second moments (Figure 2), from tensors to rows of plain dicts.

No training, no I/O: ``dobb_bench.spectral.spectral_run`` produces the tensors from training runs and
checkpoints, ``dobb_bench.spectral.commands`` is the command. All matrix math is float64: the outputs are
compared with the paper's three decimals. See docs/spectral.md for the constructions.
"""
from __future__ import annotations

import statistics

import torch

from dobb import functional as F

from dobb_bench.spectral import metrics

TABLE1_TARGETS = (0.80, 0.50, 0.20, 0.05)
# Paper Table 1(a): effective rank -> (orthogonality of Y, of sign(Y)).
PAPER_1A = {0.80: (0.736, 0.775), 0.50: (0.412, 0.643), 0.20: (0.205, 0.543), 0.05: (0.109, 0.457)}
# Paper Table 2 (GPT-2 Small, step 5000): B -> (Dobb, Dion at r = min(m, n) / B).
PAPER_2 = {1: (0.849, 0.804), 4: (0.834, 0.427), 16: (0.815, 0.208)}
F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----- Table 1(a)
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


# ----- Table 1(b)
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
    sizes = F.block_sizes(U.shape[1], blocks)
    basis = torch.zeros(U.shape[1], max(sizes), dtype=F64)
    start = 0
    for s in sizes:
        basis[start:start + s, :s] = F.eigh_basis(A[start:start + s, start:start + s].to(F64))
        start += s
    return F.direction(U.to(F64), basis, sizes, norm=norm, side="input")


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


# ----- Table 2
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


# ----- Figure 2
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


def markdown(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows as a markdown table; floats with 3 decimals, None as 'n/a'."""
    columns = columns or list(rows[0])
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


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
