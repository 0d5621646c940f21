"""The reports room: committed run records (``records``), a run's markdown and plots (``report``),
the table helpers every study uses (``tables``) and the check that figures name their records
(``figure_check``).
"""
