"""Benchmark harness for the dobb optimizers. Uses the library only through its public API.

Module map, in rooms by concern (``tests/bench`` mirrors it: ``tests/bench/<room>/test_<module>.py``).
Imports go downwards only (``tests/bench/test_imports.py`` fails on any circle, imports inside
functions included, and on any use of the library outside its public API):

- top level: ``cli`` (the ``dobb-bench`` entry point; ``python -m dobb_bench.cli`` under
  ``torchrun``), ``errors`` (``CliError``, ``Interrupted``), ``specs`` (the optimizer-spec grammar;
  what an optimizer is, asked of ``dobb.registry``), ``bench_entries`` (each registry name's cost
  formulas and blocked axis), ``provenance`` (revision, machine, command of
  a record), ``timing`` (``python -m dobb_bench.timing``: the timing and payload commands alone).
- ``training``: ``model`` (the GPT), ``data`` (corpora, batches), ``train`` (the resumable
  training loop), ``checkpoint_io``, ``run_stats``, ``outdir`` (``--out`` safety), ``children``
  (isolated runs), ``commands_train`` (``train``, ``compare``, ``sweep``).
- ``cost``: ``shapes`` and ``matrices`` (GPT-2 matrix sets), ``timing`` / ``timing_run`` /
  ``timing_report`` (``timing``), ``payload`` / ``payload_command`` (``payload``), ``looptime``
  (step time in the training loop), ``roofline`` (step cost against this machine's limits).
- ``spectral``: ``metrics``, ``spectral_tables``, ``spectral_run``, ``commands``
  (``orthogonality``, ``spectrum``).
- ``reports``: ``records`` (committed run records), ``report`` (a run's table and plots),
  ``tables`` (helpers every docs table uses), ``figure_check`` (figures name their records).
- ``studies``: ``main_job``, ``ablations`` (``ablate``), ``controlled``, ``diagnostics``
  (``microbatch``), ``operating_point``, ``family_dash``, ``family_soap``, ``two_sided``, and
  ``docs_tables`` (every docs table by name; ``report``).
"""
