"""Baseline matrix optimizers under the shared update-scale protocol (the paper's Table 9; docs/baselines.md).

Every class is a ``dobb._base.MatrixOptimizer``: param groups with ``"algorithm": "adamw"`` run
torch's AdamW kernel, the others the class' matrix update, applied as
``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O``. ``dobb.build_optimizer`` builds any of them
from a model. The math is in pure functions beside each class (``newton_schulz``, ``dion_step``,
``dion2_step``) so it can be tested and timed on plain tensors.
"""
from .block_muon import BlockMuon
from .dash import Dash, Shampoo
from .dion import Dion, dion_step
from .dion2 import Dion2, dion2_step
from .dion3 import Dion3, dion3_step
from .gram_ns import gram_newton_schulz
from .muon import Muon, resolve_ns_dtype
from .muonbp import MuonBP
from .normuon import NorMuon, normuon_normalize
from .owner_muon import OwnerMuon
from .newton_schulz import NS_COEFFICIENTS, newton_schulz, orthogonalize, row_normalize
from .pr_muon import PeriodicRowMuon
from .rmnp import RMNP
from .samuon import SAMuon
from .soap import SOAP
from .splus import SPlus
from .newton_muon import NewtonMuon

__all__ = ["Muon", "Dion", "RMNP", "PeriodicRowMuon", "BlockMuon", "Dion2", "newton_schulz",
           "orthogonalize", "row_normalize", "dion_step", "dion2_step", "NS_COEFFICIENTS",
           "gram_newton_schulz", "NorMuon", "normuon_normalize", "Dion3", "dion3_step", "OwnerMuon",
           "MuonBP", "SAMuon", "Dash", "Shampoo", "SOAP", "NewtonMuon", "resolve_ns_dtype", "SPlus"]
