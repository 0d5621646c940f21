"""Dobb's own components, in a room of their own beside the shared infrastructure.

Why a room: the package root holds what every optimizer of ``dobb`` uses (the shared base
``_base``, the math ``functional``, the layouts ``layout``/``placement``/``sharding``, capture hooks
``capture``, ``collectives``, the meter, the typed options machinery ``_hparams``, the registry and
factory); the baselines have ``dobb.baselines``. What only Dobb needs lives here, folded by concern
so that one eager ``Dobb.step()`` is read in five files: ``_base`` (the shared step loop),
``core.optimizer``, ``core.statistics``, ``functional`` and ``layout``.

- ``optimizer``: the ``Dobb`` class, its per-matrix ``Plan`` and the one refresh rule ``due``, the
  two-sided layouts, and the update (``apply_directions``, ``apply_two_sided``: which kernel runs
  where, equal blocks batched);
- ``statistics``: what the ranks agree on before a step (``agree``), the statistic of a refresh
  (``gram_statistic``, ``fold_side``) and the basis solve with its split across ranks (``solve``);
- ``options``: ``DobbOptions``, Dobb's typed options and the combinations that make sense (read at
  set-up, not by the step);
- ``experts``: the layout of a 3-D expert stack ``(E, out, in)``.

Why ``core`` and not ``dobb.dobb``: that name is the package's own and would read as the package
twice; Dobb is the package's namesake, and this is its core. Imports run one way: this room
imports the shared modules, and none of them imports it (only ``dobb/__init__`` and the registry
name the class), so a baseline never loads Dobb's machinery. The public names stay where users
find them: ``dobb.Dobb``, ``dobb.functional``, ``dobb.capture.CaptureHooks``.
"""
