"""dobb: matrix-aware optimizers that stay local when weights are sharded.

``Dobb`` is the flagship (block-diagonal eigenbases of the input-activation second moment, sign of
the projected momentum); ``build_optimizer`` gives it and the baselines under one update-scale
protocol; ``param_groups`` splits a model between a matrix optimizer and AdamW.
"""
from . import functional
from .baselines import RMNP, BlockMuon, Dion, Dion2, Muon, PeriodicRowMuon
from .dobb import Dobb
from .factory import OPTIMIZER_NAMES, build_optimizer
from .groups import param_groups, split_parameters

__all__ = ["Dobb", "Muon", "Dion", "RMNP", "PeriodicRowMuon", "BlockMuon", "Dion2", "build_optimizer",
           "OPTIMIZER_NAMES", "param_groups", "split_parameters", "functional"]
__version__ = "0.1.0"
