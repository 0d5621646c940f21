"""dobb: matrix-aware optimizers that stay local when weights are sharded.

``Dobb`` is the flagship (block-diagonal eigenbases of the input-activation second moment, sign of
the projected momentum); ``build_optimizer`` gives it and the baselines under one update-scale
protocol, by the names of ``dobb.registry`` (every optimizer declared once); ``param_groups``
splits a model between a matrix optimizer and AdamW.
"""
from . import checkpoints, functional, registry, resume
from .baselines import (RMNP, SOAP, BlockMuon, Dash, Dion, Dion2, Dion3, Muon, MuonBP, NewtonMuon, NorMuon, OwnerMuon,
                        PeriodicRowMuon, SAMuon, Shampoo, SOAPMuon, SPlus)
from .core.optimizer import Dobb
from .factory import OPTIMIZER_NAMES, build_optimizer, valid_hparams
from .groups import param_groups, split_parameters

__all__ = ["Dobb", "Muon", "Dion", "RMNP", "PeriodicRowMuon", "BlockMuon", "Dion2", "NorMuon", "Dion3",
           "OwnerMuon", "MuonBP", "SAMuon", "build_optimizer", "valid_hparams", "OPTIMIZER_NAMES", "param_groups",
           "split_parameters", "functional", "registry"]
__all__ += ["Dash", "Shampoo"]
__all__ += ["SOAP", "NewtonMuon"]
__all__ += ["SPlus"]
__all__ += ["SOAPMuon"]
__all__ += ["checkpoints"]
__version__ = "0.1.0"
