"""Dobb's own components, in a room of their own beside the shared infrastructure.

Why a room: the package root holds what every optimizer of ``dobb`` uses (the shared base
``_base``, the math ``functional``, the layouts ``layout``/``placement``/``sharding``, capture hooks
``capture``, ``collectives``, the meter, the typed options machinery ``_hparams``, the registry and
factory); the baselines have ``dobb.baselines``. What only Dobb needs lives here, folded by concern
so that one eager ``Dobb.step()`` is read in seven files: ``_base`` (the shared step loop),
``core.optimizer``, ``core.schedule``, ``core.statistics``, ``core.update``, ``functional`` and ``layout``.

- ``optimizer``: the ``Dobb`` class (state, capture API, the step's order); it re-exports the public
  names of ``schedule`` and ``update``;
- ``schedule``: the per-matrix ``Plan`` and the one refresh rule ``due``, refresh periods and
  staggered offsets, the two-sided layouts and the queue of a step's refreshes (``queue_refresh``);
- ``update``: the update (``apply_directions``, ``apply_two_sided``, ``apply_preconditioned_muon``,
  whole-matrix steps: which kernel runs where, equal blocks batched);
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
