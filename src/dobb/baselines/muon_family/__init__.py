"""Muon and its family: the optimizers built on Muon's momentum and on Newton-Schulz (NS5).

- ``muon``: Muon and ``_MuonFamily`` (the momentum, the protocol's scale and the tiled update
  every member shares); ``_split``: CMuon's fused-weight split. The NS5 kernels and their options
  are the library's ``dobb.newton_schulz`` (Dion2, Dion3 and Dobb-Muon use them too).
- Muon's distributed and blocked forms: ``owner_muon`` (owner compute through
  ``dobb.distribution``), ``block_muon``, ``muonbp`` (block-periodic; its full steps through the
  same layer).
- Muon's variants: ``normuon``, ``pr_muon``, ``samuon``, ``newton_muon``, and ``rmnp`` (rows
  normalized instead of NS5).

The classes are exported from ``dobb.baselines`` (and ``dobb``), the public import path.
"""
