"""Shampoo's family: Kronecker-factored preconditioners. ``dash`` (block Shampoo, and ``Shampoo``),
``soap`` (Adam in Shampoo's eigenbasis), ``splus`` (SPlus) and ``_matrix_roots`` (the inverse roots
Dash and Shampoo take).

The classes are exported from ``dobb.baselines`` (and ``dobb``), the public import path.
"""
