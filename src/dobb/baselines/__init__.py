"""Baseline matrix optimizers under the shared update-scale protocol (the paper's Table 9; docs/baselines.md).

Every class is a ``dobb._base.MatrixOptimizer``: param groups with ``"algorithm": "adamw"`` run
torch's AdamW kernel, the others the class' matrix update, applied as
``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O``. ``dobb.build_optimizer`` builds any of them
from a model. The math is in pure functions beside each class (``newton_schulz``, ``dion_step``,
``dion2_step``) so it can be tested and timed on plain tensors.

The modules live in rooms by family: ``muon_family`` (Muon, its kernels, its distributed, blocked
and varied forms, RMNP), ``dion_family`` (Dion, Dion2, Dion3) and ``shampoo_family`` (Dash and
Shampoo, SOAP, SPlus); ``_common`` (the DTensor forwarders) serves them all. This package is the
public import path of every class; each moved module also answers to its old path
(``dobb.baselines.muonbp``).
"""
import sys
from importlib import import_module

from .dion_family.dion import Dion, dion_step
from .dion_family.dion2 import Dion2, dion2_step
from .dion_family.dion3 import Dion3, dion3_step
from .muon_family.block_muon import BlockMuon
from .muon_family.gram_ns import gram_newton_schulz
from .muon_family.muon import Muon
from .muon_family.muonbp import MuonBP
from .muon_family.newton_muon import NewtonMuon
from .muon_family.newton_schulz import NS_COEFFICIENTS, newton_schulz, orthogonalize, resolve_ns_dtype, row_normalize
from .muon_family.normuon import NorMuon, normuon_normalize
from .muon_family.owner_muon import OwnerMuon
from .muon_family.pr_muon import PeriodicRowMuon
from .muon_family.rmnp import RMNP
from .muon_family.samuon import SAMuon
from .shampoo_family.dash import Dash, Shampoo
from .shampoo_family.soap import SOAP
from .shampoo_family.soap_muon import SOAPMuon
from .shampoo_family.splus import SPlus

# The room of each module that lived in this folder before the rooms (issue 42). Its old path still
# imports, as the same module object (``dobb.baselines.muonbp is dobb.baselines.muon_family.muonbp``),
# so code and pickles that name it keep working.
_MOVED = {**dict.fromkeys(("muon", "owner_muon", "block_muon", "muonbp", "normuon", "pr_muon", "samuon", "newton_muon",
                          "rmnp", "newton_schulz", "gram_ns", "_split"), "muon_family"),
         **dict.fromkeys(("dion", "dion2", "dion3"), "dion_family"),
         **dict.fromkeys(("dash", "soap", "splus", "_matrix_roots"), "shampoo_family")}
for _name, _room in _MOVED.items():
    _module = import_module(f"{__name__}.{_room}.{_name}")
    sys.modules.setdefault(f"{__name__}.{_name}", _module)
    globals().setdefault(_name, _module)  # an exported name (the function ``newton_schulz``) stays itself
del _name, _room, _module

__all__ = ["Muon", "Dion", "RMNP", "PeriodicRowMuon", "BlockMuon", "Dion2", "newton_schulz",
           "orthogonalize", "row_normalize", "dion_step", "dion2_step", "NS_COEFFICIENTS",
           "gram_newton_schulz", "NorMuon", "normuon_normalize", "Dion3", "dion3_step", "OwnerMuon",
           "MuonBP", "SAMuon", "Dash", "Shampoo", "SOAP", "NewtonMuon", "resolve_ns_dtype", "SPlus",
           "SOAPMuon"]
