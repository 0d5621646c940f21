"""Muon and its family: the optimizers built on Muon's momentum and on Newton-Schulz (NS5).

- ``muon``: Muon and ``_MuonFamily`` (the momentum, the protocol's scale and the tiled update
  every member shares); ``newton_schulz`` and ``gram_ns``: the NS5 kernels and their options
  (Dion2 and Dion3, and Dobb's whole steps, use them too); ``_split``: CMuon's fused-weight split.
- Muon's distributed and blocked forms: ``owner_muon`` (owner compute), ``block_muon``, ``muonbp``
  (block-periodic).
- Muon's variants: ``normuon``, ``pr_muon``, ``samuon``, ``newton_muon``, and ``rmnp`` (rows
  normalized instead of NS5).

The classes are exported from ``dobb.baselines`` (and ``dobb``), the public import path.
"""
