"""The process backend: ``MultiProcessingSampleManager`` and the worker processes it
runs.  Its sibling is `unienv_mp.ray`; both keep the contract of `unienv_mp.backend`.

* `.manager`: the manager, which drives the ledger and the pool it owns: submit, wait,
  deliver.
* `.pool`: the worker pool the manager owns: starting workers, waiting on one, noticing
  a dead or stalled one, replacing it and pushing the tasks the ledger queued for it,
  ``stats``, ``close``.
* `.ledger`: the work in flight, owned by the manager: the tickets and their tasks, each
  worker's tasks in flight and waiting, and the result slots they hold; tasks onto a
  worker's ring, results off it, and their delivery.
* `.polling`: waiting for the first of several tickets (``wait_any``, ``fetch`` not in
  order).
* `.unienv_queue`: UniEnv's ``add_work`` / ``fetch``, an adapter over a manager.
* `.handle`: one worker seen from the parent: its process, rings and slots.
* `.worker`: the worker's main loop, in the child.
* `.encoder`: tasks onto the ring.
* `.launch`: how a worker's process starts, every one from one snapshot of the work
  function: `.transfer` ships it to spawn and forkserver workers, `.snapshot` keeps a
  process to fork later fork workers from.
* `.deaths`: what the end of a worker's process means: replaced or not, and what the
  caller is told (a stall among them).

May import: `unienv_mp._transport`, `unienv_mp.backend`, and the root modules ``errors``,
``stats``, ``_validate``, ``_os``; not UniEnv, the direct gather or the sampler.  Word used
throughout: a *lane* is the pool's record of one worker (its handle, its deaths in a row,
its counters); the tasks in flight on it and waiting for a new process are the ledger's.
"""
