"""The studies room: each study's experiment or docs tables (``main_job``, ``ablations``,
``controlled``, ``diagnostics``, ``operating_point``, ``family_dash``, ``family_soap``,
``two_sided``) and ``docs_tables``, every docs table by name and the ``report`` command;
``define`` (what a study is, the bracket-and-seed rule, the driver) and ``catalog`` (every study
declared once: what ``dobb-bench study`` lists and runs, and what its records are checked against).
"""
