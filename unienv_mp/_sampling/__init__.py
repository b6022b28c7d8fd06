"""The sampler: ``MultiprocessingSampler`` and ``SamplerBase``, what the training loop
talks to.

* :mod:`.sampler`: the samplers: their options, ``sample*``, ``stats``, ``close``.
* :mod:`.pools`: the managers a sampler owns: the one ``sample*`` uses, those kept for
  epochs, and the ``persistent_workers`` rule.
* :mod:`.ahead`: requesting batches ahead (the first alone, then ``n_buffers`` ahead),
  shared by ``sample*`` and the epochs.
* :mod:`.epochs`: the ``epoch_*`` iterators.
* :mod:`.checkpoints`: what ``state_dict`` holds, and a state checked for
  ``load_state_dict``; :mod:`.state` the format of a state.
* :mod:`.streams`: where the caller is in each stream of batches (a pure state machine).
* :mod:`.fingerprint`: whether the data is still what the workers hold a copy of.
* :mod:`.target`: the work function the workers run, their seeds, epoch permutations.
* :mod:`.delegates`: one-line properties and methods that pass on to a part (the wrapped
  sampler's properties).

May import: everything below it (:mod:`unienv_mp._process`, :mod:`unienv_mp._direct`,
:mod:`unienv_mp._device`, :mod:`unienv_mp._transport`, :mod:`unienv_mp.backend`, the root
modules) and UniEnv; not :mod:`unienv_mp.ray` or the re-export modules at the root.
"""
