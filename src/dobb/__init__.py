"""dobb: matrix-aware optimizers that stay local when weights are sharded.

``Dobb`` is the flagship (block-diagonal eigenbases of the input-activation second moment, sign of
the projected momentum); ``build_optimizer`` gives it and the baselines under one update-scale
protocol; ``param_groups`` splits a model between a matrix optimizer and AdamW.
"""
from . import functional
from .dobb import Dobb
from .groups import param_groups, split_parameters

__all__ = ["Dobb", "param_groups", "split_parameters", "functional"]
__version__ = "0.1.0"
from .factory import build_optimizer, OPTIMIZER_NAMES
from .baselines import Muon, Dion, RMNP, PeriodicRowMuon, BlockMuon, Dion2
__all__ += ["build_optimizer", "OPTIMIZER_NAMES", "Muon", "Dion", "RMNP", "PeriodicRowMuon", "BlockMuon", "Dion2"]
