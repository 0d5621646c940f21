"""The spectral room: the paper's spectral metrics (``metrics``), the orthogonality and spectrum
experiments as pure tables (``spectral_tables``) and runs (``spectral_run``), and their commands
(``commands``: ``orthogonality``, ``spectrum``).
"""
