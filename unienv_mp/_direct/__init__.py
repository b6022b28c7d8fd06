"""Direct gather: a batch written by a worker straight into its slot, row by row, from
the replay buffer's own tensors (see `.gather` for the contract: exactness, bit for bit,
with UniEnv's own methods).

* `.base`: what every plan shares: the refusal (``NotDirect``), a slot writer that fills a
  planned layout, the row mapping of a ReplayBuffer.
* `.storages`: the planner of a ReplayBuffer's storages, and the layout of flat rows.
* `.files`: the readers of UniEnv's file-backed storages (HDF5, images, video, parquet),
  which the storage planner hands their leaves.
* `.views`: the planners of UniEnv's views (frame stacks, columns, combined datasets,
  sub-items) and of unienv_mp's ``WindowedBatch``, built on the storage planner they are
  handed.
* `.gather`: the entry points: whether a sampler qualifies, its bytes per row, the sampler's
  ``Planner`` and the worker's ``Gatherer``, which pick the storage or the view plan.
* `.rows`: the compiled row gather, rows read from a file, stacked-view windows and episode
  spans (``csrc/umr_rows.c``, ``csrc/umr_pread.c``, ``csrc/umr_window.c``).
* `.unienv`: every use of UniEnv's private names, in one place.

Imports go one way: `.base` below `.files`, below `.storages` and `.views` (which never
import each other), and those below `.gather`, which nothing here imports.

May import: `unienv_mp._transport`, `unienv_mp.errors`, `unienv_mp.windows` (the view
`.views` plans), UniEnv and torch; not the process backend or the sampler.
"""
