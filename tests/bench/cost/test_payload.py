"""dobb_bench.cost.payload: the derived cross-shard payload (Tables 3, 7, Figure 1) against hand counts,
and the derived optimizer-state sizes against the buffers the library actually allocates."""
import math

import pytest
import torch
from torch import nn

from dobb_bench.bench_entries import bench_entry
from dobb_bench.cost import payload as P
from dobb_bench.cost.shapes import matrix_shapes
import dobb
from dobb import registry
from dobb.meter import state_bytes


def test_dion_is_rank_times_m_plus_n():
    # m=6, n=10: min=6, rho=1/2 -> r=3 -> 3*(6+10)=48 whichever axis is sharded
    for axis in ("output", "input"):
        assert P.payload_entries("dion", 6, 10, {"rank_fraction": 0.5}, sharded=axis) == 48
    assert P.payload_entries("dion", 6, 10, {"rank_fraction": 0.01}) == 16  # r >= 1


def test_table3_and_table7_entries():
    m, n = 12, 20
    for axis in ("output", "input"):
        assert P.payload_entries("muon", m, n, sharded=axis) == m * n
        assert P.payload_entries("torch-muon", m, n, sharded=axis) == m * n
        assert P.payload_entries("adamw", m, n, sharded=axis) == 0
        assert P.payload_entries("dobb", m, n, {"blocks": 4}, sharded=axis) == 0
        assert P.payload_entries("dobb-g", m, n, {"blocks": 4}, sharded=axis) == 0
    # Table 7: the ell2 variants reduce one norm per coefficient column (row) across the other axis
    assert P.payload_entries("dobb-l2", m, n, {"blocks": 4}, sharded="output") == n
    assert P.payload_entries("dobb-l2", m, n, {"blocks": 4}, sharded="input") == 0
    assert P.payload_entries("dobb-g-l2", m, n, {"blocks": 4}, sharded="output") == 0
    assert P.payload_entries("dobb-g-l2", m, n, {"blocks": 4}, sharded="input") == m
    # one shard: nothing crosses shards
    assert P.payload_entries("muon", m, n, shards=1) == 0


def test_derived_baselines():
    m, n = 8, 6
    assert P.payload_entries("rmnp", m, n, sharded="output") == 0
    assert P.payload_entries("rmnp", m, n, sharded="input") == m
    assert P.payload_entries("pr-muon", m, n, {"period": 3}, sharded="output") == pytest.approx(48 / 3)
    assert P.payload_entries("pr-muon", m, n, {"period": 3}, sharded="input") == pytest.approx((48 + 2 * 8) / 3)
    assert P.payload_entries("dion2", m, n, {"fraction": 0.25}) == 2 * 6
    # block Muon: column blocks under row sharding span every shard; row blocks aligned with shards: 0
    assert P.payload_entries("block-muon", m, n, {"blocks": 4, "axis": 1}, sharded="output") == 48
    assert P.payload_entries("block-muon", m, n, {"blocks": 4, "axis": 0}, sharded="output", shards=4) == 0


def test_muonbp_is_the_owner_full_step_amortized():
    m, n = 8, 6  # mn = 48; a full step sends the shards to the owner and the result back: 96
    for axis in ("output", "input"):  # the block steps' blocks follow the sharded axis: 0
        assert P.payload_entries("muonbp", m, n, {"period": 4}, sharded=axis, shards=4) == 96 / 4
        assert P.payload_entries("muonbp", m, n, {"period": 0}, sharded=axis, shards=4) == 0
        assert P.payload_entries("muonbp", m, n, {"period": 1}, sharded=axis) == P.payload_entries("owner-muon", m, n)
    assert P.payload_entries("muonbp", m, n, sharded="output") == 96 / 5  # the class' default period
    # 2 row blocks of 4 over 4 shards of 2 rows straddle (48 on each block step): (96 + 2 * 48) / 3
    assert P.payload_entries("muonbp", m, n, {"period": 3, "blocks": 2}, sharded="output", shards=4) == 64
    # 18 rows over 2 shards (9, 9), 4 blocks: cut at the boundary first (5, 4 | 5, 4), none crosses
    assert P.payload_entries("muonbp", 18, 10, {"period": 3, "blocks": 4}, sharded="output", shards=2) == 2 * 180 / 3
    with pytest.raises(ValueError, match="period"):
        P.payload_entries("muonbp", m, n, {"period": -1})


def test_dion2_shard_selection_needs_no_exchange_under_row_sharding():
    m, n = 16, 6
    hp = {"fraction": 0.25, "select": "shard", "blocks": 4}
    assert P.payload_entries("dion2", m, n, {"fraction": 0.25}, sharded="output") == 4 * 6  # global: k n
    assert P.payload_entries("dion2", m, n, hp, sharded="output", shards=4) == 0
    assert P.payload_entries("dion2", m, n, hp, sharded="output", shards=2) == 0  # 2 blocks per shard
    # columns sharded: the selected rows, k_b = round(0.25 * 4) = 1 per block, move
    assert P.payload_entries("dion2", m, n, hp, sharded="input", shards=4) == 4 * 6
    assert P.payload_entries("dion2", 18, n, {**hp, "fraction": 0.5}, sharded="input") == (2 + 2 + 2 + 2) * 6
    # 2 blocks of 8 rows over 4 shards of 4: the library refuses; both blocks straddle
    assert P.payload_entries("dion2", m, n, {**hp, "blocks": 2}, sharded="output", shards=4) == 16 * 6


def test_straddling_blocks_are_charged_their_slab():
    # m=8 rows over 4 shards (2 rows each); Dobb-G with 2 blocks of 4 rows: both straddle a boundary
    assert P.payload_entries("dobb-g", 8, 3, {"blocks": 2}, sharded="output", shards=4) == 8 * 3
    assert P.payload_entries("dobb-g", 8, 3, {"blocks": 4}, sharded="output", shards=4) == 0
    assert P.payload_entries("dobb-g", 8, 3, {"blocks": 8}, sharded="output", shards=4) == 0
    # 3 blocks of (3, 3, 2) over shards of 2: blocks [0,3) and [3,6) straddle, [6,8) does not
    assert P.payload_entries("dobb-g", 8, 3, {"blocks": 3}, sharded="output", shards=4) == (3 + 3) * 3


def test_figure1_dion_aggregate_is_one_and_a_half_rho_on_gpt2_xl():
    shapes = matrix_shapes("xl")
    assert len(shapes) == 48 * 6
    for rho in (1.0, 0.25, 1 / 16):
        assert P.relative_payload("dion", {"rank_fraction": rho}, shapes) == pytest.approx(1.5 * rho, rel=1e-12)
    # rho = 1/3: r = round(1600/3) = 533 for every matrix, so the ratio is 1.5 * 533/1600
    assert P.relative_payload("dion", {"rank_fraction": 1 / 3}, shapes) == pytest.approx(1.5 / 3, rel=2e-3)
    # fused qkv (3d x d): (4 + 2 + 10) rho d^2 / 12 d^2 = 4/3 rho, so Figure 1 counts q, k, v apart
    fused = matrix_shapes("xl", fused_qkv=True)
    assert P.relative_payload("dion", {"rank_fraction": 0.25}, fused) == pytest.approx(0.25 * 4 / 3)
    assert P.relative_payload("muon", {}, shapes) == 1.0
    for name in ("dobb", "adamw", "dobb-g"):
        assert P.relative_payload(name, {"blocks": 16}, shapes) == 0.0
    # plain (m, n) tuples work as well as (name, (m, n)) pairs (report.plot_payload passes tuples)
    assert P.relative_payload("dion", {"rank_fraction": 0.25}, [s for _, s in shapes]) == pytest.approx(0.375)


def test_dp_statistic_sync_is_n_squared_over_b():
    assert P.dp_stat_entries("dobb", 768, 3072, {"blocks": 16}) == 3072**2 / 16
    assert P.dp_stat_entries("dobb-g", 768, 3072, {"blocks": 16}) == 768**2 / 16
    assert P.dp_stat_entries("dobb", 768, 3072, {"blocks": 16, "refresh_every": 9}, per_step=True) == 3072**2 / 16 / 9
    assert P.dp_stat_entries("dion", 768, 3072, {}) == 0
    assert P.dp_stat_entries("dobb", 768, 3072, {"blocks": 16, "source": "grad_gram"}) == 0


def test_bad_names_and_arguments():
    with pytest.raises(ValueError, match="unknown optimizer"):
        P.payload_entries("sgd", 4, 4)
    with pytest.raises(ValueError, match="sharded"):
        P.payload_entries("muon", 4, 4, sharded="rows")
    with pytest.raises(ValueError, match="no matrix shapes"):
        P.relative_payload("muon", {}, [])
    with pytest.raises(ValueError, match="rank_fraction must lie"):
        P.payload_entries("dion", 4, 4, {"rank_fraction": 0})


@pytest.mark.parametrize("name", [n for n in P.PAYLOAD_NAMES if n != "adamw" and n not in P.PLACEMENT_NAMES])
def test_defaults_are_those_of_the_optimizers_built(name):
    """What payload assumes for a bare name is what dobb.build_optimizer builds for it."""
    import dobb

    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16))
    opt = dobb.build_optimizer(name, model, lr=1e-3)
    group = next(g for g in opt.param_groups if g["algorithm"] != "adamw")
    defaults = P.optimizer_defaults(name)
    # layout options are None in a group ("follow the layout"); on a plain matrix that is the value payload
    # assumes (tests/test_placement.py checks the unsharded step bitwise against it)
    layout = type(opt).Options.layout_names()
    assert all(group[k] is None for k in defaults if k in layout)
    built = {k: type(opt).Options.hparam_defaults()[k] if k in layout else group[k] for k in defaults}
    assert defaults and built == defaults
    getattr(opt, "remove_hooks", lambda: None)()


def test_defaults_drive_the_counts():
    # PR-Muon's period, Dion's rank fraction and block Muon's axis come from the classes
    import dobb

    period = dobb.PeriodicRowMuon.matrix_defaults["period"]
    assert P.payload_entries("pr-muon", 8, 6, sharded="output") == pytest.approx(48 / period)
    rho = dobb.Dion.matrix_defaults["rank_fraction"]
    assert P.payload_entries("dion", 8, 16) == max(1, round(rho * 8)) * 24
    assert P.optimizer_defaults("dobb-g-l2")["side"] == "output" and P.optimizer_defaults("adamw") == {}


def test_derived_state_matches_the_library_buffers():
    from dobb import Dobb

    lin = nn.ModuleList([nn.Linear(12, 8, bias=False), nn.Linear(8, 12, bias=False)])
    for p in lin.parameters():
        p.grad = torch.randn_like(p)
    opt = Dobb(list(lin.parameters()), model=lin, lr=1e-3, blocks=4, source="grad_gram", check_finite=False)
    opt.step()
    derived = sum(P.derived_state_bytes("dobb", m, n, {"blocks": 4}) for m, n in [(8, 12), (12, 8)])
    # momentum fp32 (mn*4) + fp32 statistic + bf16 basis: (12*3 + 8*2) * 6 bytes
    assert derived == (96 + 96) * 4 + (12 * 3 + 8 * 2) * 6
    assert state_bytes(opt) == derived
    adam = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    adam.step()
    assert state_bytes(adam) == sum(P.derived_state_bytes("adamw", 8, 12) for _ in range(2)) + 2 * 4  # + step scalars
    assert P.derived_state_bytes("dion", 8, 12, {"rank_fraction": 0.5}) == 96 * 4 + 12 * 4 * 4
    # per rank: weight-shaped state split over every shard, Dobb's block state only over its axis
    assert P.derived_state_bytes("dobb", 8, 12, {"blocks": 4}, out_shards=2) == 96 * 2 + 12 * 3 * 6
    assert P.derived_state_bytes("dobb", 8, 12, {"blocks": 4}, in_shards=2) == 96 * 2 + 12 * 3 * 3
    assert math.isclose(P.derived_state_bytes("dobb", 1600, 1600, {"blocks": 16}) - 1600 * 1600 * 4,
                        6 * 1600**2 / 16)  # Table 18's 6 n^2 / B


def test_every_registry_entry_has_its_formulas_and_a_payload_name():
    for name in registry.OPTIMIZERS:
        entry = bench_entry(name)
        assert entry.payload in P.PAYLOAD_FORMULAS and entry.state in P.STATE_FORMULAS, name
        assert P.canonical_name(name) == name
    assert set(P.PAYLOAD_NAMES) == set(registry.OPTIMIZER_NAMES) | set(P.PLACEMENT_NAMES)


_SHAPES = [(8, 12), (12, 8)]  # two matrices, both ways


def _allocated_state(name: str, **hp) -> int:
    """Bytes of per-matrix buffers ``name`` holds after two steps on two matrices (0-dim step
    counters aside: the formulas count buffers per matrix)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8, bias=False), nn.Linear(8, 12, bias=False))
    opt = dobb.build_optimizer(name, model, lr=1e-3, **hp)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 12)).square().mean().backward()
        opt.step()
    scalars = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.dim() == 0)
    return state_bytes(opt) - scalars


@pytest.mark.parametrize("name", list(registry.OPTIMIZER_NAMES))
def test_derived_state_of_every_optimizer_is_its_allocated_buffers(name):
    """The state formula a registry entry names, against what its optimizer holds."""
    assert _allocated_state(name) == sum(P.derived_state_bytes(name, m, n) for m, n in _SHAPES)


@pytest.mark.parametrize("hp", [dict(side="both", out_blocks=2), dict(side="both", out_blocks=4, blocks=2, norm="adam")])
def test_derived_state_of_two_sided_dobb_is_its_allocated_buffers(hp):
    """side='both' holds both sides' statistic and basis (and, for norm='adam', a second moment)."""
    one_sided = sum(P.derived_state_bytes("dobb", m, n) for m, n in _SHAPES)
    assert _allocated_state("dobb", **hp) == sum(P.derived_state_bytes("dobb", m, n, hp) for m, n in _SHAPES) > one_sided


def test_two_sided_dobb_payload_and_statistic_entries():
    """side='both': no cross-shard entries when both sides' blocks align with the shards; both
    statistics in the data-parallel mean (``n^2/B + m^2/Bo``); grad-Gram bases sum the unsharded
    side's ``G G^T`` over the shards (what one-sided Dobb-G pays under column sharding)."""
    hp = dict(side="both", blocks=4, out_blocks=4)
    assert P.payload_entries("dobb", 64, 32, hp, sharded="output", shards=4) == 0.0
    assert P.payload_entries("dobb", 64, 32, hp, sharded="input", shards=4) == 0.0
    assert P.dp_stat_entries("dobb", 64, 32, hp) == 4 * 8 * 8 + 4 * 16 * 16
    gram = dict(hp, source="grad_gram")
    assert P.payload_entries("dobb", 64, 32, gram, sharded="input", shards=4) == 4 * 16 * 16 / 9
    assert P.dp_stat_entries("dobb", 64, 32, gram) == 0.0


def test_state_bytes_counts_each_storage_once():
    """The one state-size definition (dobb.meter.state_bytes) against storages counted by hand:
    a view counts its base once, lists and nested dicts are searched, Python numbers are not."""
    base, other = torch.zeros(10, 6), torch.zeros(3, dtype=torch.float64)
    state = {0: {"a": base, "b": base[2:], "c": [other, 3], "d": {"e": base.t()}, "step": torch.tensor(1.0)}}
    assert state_bytes(state) == 10 * 6 * 4 + 3 * 8 + 4

    class Opt(torch.optim.SGD):
        pass

    opt = Opt([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    opt.state.update(state)
    assert state_bytes(opt) == state_bytes(opt.state) == state_bytes(state)


# The strongest peers' rows (owner-compute Muon, owner placement, NorMuon, Dion3), moved here from the
# library's tests (a library test should not import the bench).
def test_payload_rows_of_the_peers():
    """Derived per-step payload (dobb-bench payload): owner compute twice Muon's dense count, owner
    placement nothing in the step and 2 mn in forward/backward, NorMuon as Muon, Dion3 as Dion2."""
    m, n = 24, 8
    assert P.payload_entries("owner-muon", m, n) == 2 * P.payload_entries("muon", m, n) == 2 * m * n
    assert P.payload_entries("owner-placement", m, n) == 0
    assert P.forward_backward_entries("owner-placement", m, n) == 2 * m * n
    assert P.forward_backward_entries("owner-placement", m, n, shards=1) == 0
    assert P.payload_entries("normuon", m, n) == m * n
    k = round(dion3_fraction() * m)
    assert P.payload_entries("dion3", m, n) == P.payload_entries("dion2", m, n) == k * n
    assert P.derived_state_bytes("normuon", m, n) == m * n * 4 + m * 4


def dion3_fraction():
    from dobb.baselines import Dion3

    return Dion3.matrix_defaults["fraction"]


def test_split_refresh_basis_broadcast_per_refresh():
    """split_refresh=True sends each even-sized shared block's s^2 basis entries once per refresh;
    odd-sized blocks are solved on every rank (dobb.core.statistics) and send nothing."""
    split = {"split_refresh": True}
    assert P.dp_basis_entries("dobb", 768, 3072, {"blocks": 1, **split}) == 3072 ** 2
    assert P.dp_basis_entries("dobb", 768, 3072, {"blocks": 4, **split}) == 4 * 768 ** 2
    assert P.dp_basis_entries("dobb", 8, 9, {"blocks": 2, **split}) == 4 * 4  # blocks 5 and 4: only the 4 is sent
    assert P.dp_basis_entries("dobb-g", 768, 3072, {"blocks": 2, **split}) == 2 * 384 ** 2  # output side: m
    assert P.dp_basis_entries("dobb", 6, 10, {"side": "both", "blocks": 2, "out_blocks": 1, **split}) == 0 + 36
    assert P.dp_basis_entries("dobb", 768, 3072, {"blocks": 1}) == 0  # off by default
    assert P.dp_basis_entries("dobb", 768, 3072, {"blocks": 1, "source": "grad_gram", **split}) == 0
    assert P.dp_basis_entries("muon", 768, 3072, split) == 0


def test_splus_payload_and_state_hand_values():
    """SPlus: the sharded side's blocks within shards cost nothing per step; the other side's Gram
    blocks are all-reduced per refresh (every inverse_every steps); a side at max_dim has none."""
    hp = dict(blocks=2, out_blocks=4, inverse_every=10)
    # rows sharded over 4: out_blocks=4 lie within shards; G^T G's two 16x16 blocks every 10 steps
    assert P.payload_entries("splus", 64, 32, hp, sharded="output", shards=4) == 2 * 16 * 16 / 10
    # columns sharded over 4 (shards of 8): blocks=2 (two of 16) straddle bounds, charged their slabs
    assert P.payload_entries("splus", 64, 32, hp, sharded="input", shards=4) == 2 * 16 * 64 + 4 * 16 * 16 / 10
    assert P.payload_entries("splus", 64, 32, dict(hp, blocks=4), sharded="input", shards=4) == 4 * 16 * 16 / 10
    # out_blocks=1 under row sharding: the one 64-row block straddles every bound (its dense slab)
    assert P.payload_entries("splus", 64, 32, dict(hp, out_blocks=1), sharded="output", shards=4) == 64 * 32 + 2 * 16 * 16 / 10
    # max_dim=32: the 32-column side keeps no statistic, nothing is reduced
    assert P.payload_entries("splus", 64, 32, dict(hp, max_dim=32), sharded="output", shards=4) == 0.0
    assert P.payload_entries("splus", 64, 32, hp, shards=1) == 0.0
    # defaults: inverse_every=100, blocks=out_blocks=1
    assert P.payload_entries("splus", 768, 3072, sharded="output", shards=4) == 768 * 3072 + 3072**2 / 100
    # state: momentum + average (weight dtype, 2 mn) + fp32 stat and basis per side (k * ceil(k/B) * 8)
    assert P.derived_state_bytes("splus", 64, 32, hp) == 2 * 64 * 32 * 4 + 32 * 16 * 8 + 64 * 16 * 8
    assert P.derived_state_bytes("splus", 64, 32, hp, out_shards=4) == 2 * 64 * 32 + 32 * 16 * 8 + 64 * 16 * 2
    assert P.derived_state_bytes("splus", 64, 32, dict(hp, max_dim=64)) == 2 * 64 * 32 * 4 + 32 * 16 * 8
