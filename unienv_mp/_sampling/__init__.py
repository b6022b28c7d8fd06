"""The sampler: ``MultiprocessingSampler`` and ``SamplerBase``, what the training loop
talks to.

* `.sampler`: the samplers: their options, ``sample*``, ``stats``, ``close``.
* `.pools`: the managers a sampler owns: the one ``sample*`` uses, those kept for epochs,
  and the ``persistent_workers`` rule.
* `.ahead`: requesting batches ahead (the first alone, then ``n_buffers`` ahead), shared by
  ``sample*`` and the epochs.
* `.epochs`: the ``epoch_*`` iterators.
* `.checkpoints`: what ``state_dict`` holds, and a state checked for ``load_state_dict``;
  `.state` the format of a state.
* `.streams`: where the caller is in each stream of batches (a pure state machine).
* `.fingerprint`: whether the data is still what the workers hold a copy of; `.files` the
  identities of the files it reads.
* `.target`: the work function the workers run, their seeds, epoch permutations.
* `.delegates`: one-line properties and methods that pass on to a part (the wrapped
  sampler's properties).

May import: everything below it (`unienv_mp._process`, `unienv_mp._direct`,
`unienv_mp._device`, `unienv_mp._transport`, `unienv_mp.backend`, the root modules) and
UniEnv; not `unienv_mp.ray` or the re-export modules at the root.
"""
