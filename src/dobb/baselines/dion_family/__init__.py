"""Dion and its successors: ``dion`` (low-rank power iteration with error feedback), ``dion2``
(NS5 of a subset of the momentum's rows) and ``dion3`` (Dion2's rows with NorMuon's per-neuron
normalization). They orthogonalize with the Muon family's kernels (``dobb.newton_schulz``).

The classes are exported from ``dobb.baselines`` (and ``dobb``), the public import path.
"""
