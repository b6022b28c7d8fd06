"""Direct gather: a batch written by a worker straight into its slot, row by row, from
the replay buffer's own tensors (see :mod:`.gather` for the contract: exactness, bit for
bit, with UniEnv's own methods).

* :mod:`.base`: what every plan shares: the refusal (``NotDirect``), a slot writer that
  fills a planned layout, the row mapping of a ReplayBuffer.
* :mod:`.storages`: the planner of a ReplayBuffer's storages, and the layout of flat rows.
* :mod:`.views`: the planners of UniEnv's views (frame stacks, columns, combined datasets,
  sub-items), built on the storage planner they are handed.
* :mod:`.gather`: the entry points: whether a sampler qualifies, its bytes per row, the
  sampler's ``Planner`` and the worker's ``Gatherer``, which pick the storage or the view
  plan.
* :mod:`.rows`: the compiled row gather and stacked-view windows (``csrc/umr_rows.c``,
  ``csrc/umr_window.c``).
* :mod:`.unienv`: every use of UniEnv's private names, in one place.

Imports go one way: :mod:`.base` below :mod:`.storages` and :mod:`.views` (which never
import each other), and those below :mod:`.gather`, which nothing here imports.

May import: :mod:`unienv_mp._transport`, :mod:`unienv_mp.errors`, UniEnv and torch; not
the process backend or the sampler.
"""
