"""The transport: how bytes cross between processes.  Nothing here knows UniEnv or a
sampler.

* `.ring`: single-producer single-consumer rings, events and shared-memory segments (the
  Cython face of ``csrc/umr_ring.c`` and ``csrc/umr_shm.c``).
* `.codec`: the slot codec, pytrees of arrays in one flat frame.
* `.protocol`: the wire format of a ring entry, shared by both users of the rings.
* `.result_slots`: a writer's result slots, shared by the process workers and the Ray
  actors on the training node.
* `.headroom`: the memory left for a new segment.
* `.shm_queue`: ``ShmQueue``, a ``multiprocessing.Queue`` on a ring.

May import: `unienv_mp.errors` and `unienv_mp._validate`, nothing else of the package.
"""
