"""Baseline matrix optimizers under the shared update-scale protocol (the paper's Table 9; docs/baselines.md).

Every class is a ``dobb._base.MatrixOptimizer``: param groups with ``"algorithm": "adamw"`` run
torch's AdamW kernel, the others the class' matrix update, applied as
``W <- (1 - lr*wd) W - lr * tau*sqrt(max(m, n)) * O``. ``dobb.build_optimizer`` builds any of them
from a model. The math is in pure functions beside each class (``dion_step``, ``dion2_step``; the
Newton-Schulz kernels, shared with Dobb-Muon, in ``dobb.newton_schulz``) so it can be tested and timed
on plain tensors; owner compute (a matrix computed on one rank) is ``dobb.distribution``.

The modules live in rooms by family: ``muon_family`` (Muon, its kernels, its distributed, blocked
and varied forms, RMNP), ``dion_family`` (Dion, Dion2, Dion3) and ``shampoo_family`` (Dash and
Shampoo, SOAP, SPlus); ``_common`` (the DTensor forwarders) serves them all. This package is the
public import path of every class; a module is imported by its room's path
(``dobb.baselines.muon_family.muonbp``).
"""
# the Newton-Schulz kernels, exported here as before they moved out of the package
from ..newton_schulz import (NS_COEFFICIENTS, gram_newton_schulz, newton_schulz, orthogonalize, resolve_ns_dtype,
                             row_normalize)
from .dion_family.dion import Dion, dion_step
from .dion_family.dion2 import Dion2, dion2_step
from .dion_family.dion3 import Dion3, dion3_step
from .muon_family.block_muon import BlockMuon
from .muon_family.muon import Muon
from .muon_family.muonbp import MuonBP
from .muon_family.newton_muon import NewtonMuon
from .muon_family.normuon import NorMuon, normuon_normalize
from .muon_family.owner_muon import OwnerMuon
from .muon_family.pr_muon import PeriodicRowMuon
from .muon_family.rmnp import RMNP
from .muon_family.samuon import SAMuon
from .shampoo_family.dash import Dash, Shampoo
from .shampoo_family.soap import SOAP
from .shampoo_family.soap_muon import SOAPMuon
from .shampoo_family.splus import SPlus

__all__ = ["Muon", "Dion", "RMNP", "PeriodicRowMuon", "BlockMuon", "Dion2", "newton_schulz",
           "orthogonalize", "row_normalize", "dion_step", "dion2_step", "NS_COEFFICIENTS",
           "gram_newton_schulz", "NorMuon", "normuon_normalize", "Dion3", "dion3_step", "OwnerMuon",
           "MuonBP", "SAMuon", "Dash", "Shampoo", "SOAP", "NewtonMuon", "resolve_ns_dtype", "SPlus",
           "SOAPMuon"]
