"""The main job (``python -m unienv_mp``): side-by-side timing of batch samplers over UniEnv
ReplayBuffers.  The benchmark harness, not the library: the core package never imports it.

Used by the main job (``cli.main``) and by ``benchmarks/bench_sampler.py``.
Every row of a case samples the same data with the same batch size; the consumer touches
one byte per 4 KiB page of every array it receives, as a training step that reads the
batch would.

The cases (``config.CASES``):

* ``image``, ``state``: batches per second of ``sample()`` from an in-memory ReplayBuffer
  (``build_buffer``), every implementation below;
* ``jpeg``: the same where every batch decodes: the images are JPEG files in UniEnv's
  ``ImageStorage`` (``build_jpeg_buffer``), so the worker (or the training process, in
  process) decodes each row it samples;
* ``online``: a training loop that appends ``Config.append`` transitions to a shared
  (``multiprocessing=True``) ReplayBuffer before every ``sample()`` (``measure_online``):
  time per loop step, and how stale the batches are (``staleness``);
* ``latency``: the time to one batch when nothing was prefetched (``measure_latency``),
  for each way of asking for one (``TRIGGERS``);
* ``views``: batches per second of ``sample()`` from the views robot learners sample
  (``VIEWS``: frame stacks, action chunks, columns, a combined dataset) over episodic
  in-memory ReplayBuffers (``build_episodic_buffer``), a row per view
  (``measure_view``), with the bare limit of each (``index_select`` below).
* ``epoch``: seconds per epoch of ``epoch_iter()`` over an in-memory ReplayBuffer, the
  first epoch and the later ones, and each epoch's first batch (``measure_epochs``), with
  a row for the same number of steady-state ``sample()`` batches (``EPOCH_ROWS``).
* ``windows``: batches per second of ``sample_with_metadata()`` of an observation history
  and an action chunk of one step per element, with pad masks (``unienv_mp.WindowedBatch``
  over the episodic buffer), against the same view in process, two UniEnv samplers paired
  by seed, a torch DataLoader over a map-style dataset doing the same indexing, and the
  bare gather (``measure_windows``; its extra rows ``config.WINDOW_ROWS``).

The implementations (``config.IMPLEMENTATIONS``, their samplers ``peers.make_sampler``):

* ``unienv_mp``: unienv_mp's MultiprocessingSampler (workers gather rows straight into
  the shared slots);
* ``unienv_mp_generic``: the same with ``direct_gather=False`` (workers call the wrapped
  sampler's ``sample()``, and the batch is copied into the slot);
* ``unienv``, ``unienv_shm``: UniEnv's MultiprocessingSampler, ``shared_memory`` False / True;
* ``in_process``: UniEnv's StepSampler, ``sample()`` in the training process;
* ``dataloader``: a torch DataLoader with as many workers, each calling ``sample()``;
* ``index_select``: the speed limit of in-process sampling: the StepSampler's indices, mapped
  to storage rows as the ReplayBuffer does, gathered with ``torch.index_select(..., out=)``
  into one set of output tensors allocated up front and reused for every batch (so a batch
  is only valid until the next one); for a view, its final rows and valid mask computed as
  unienv_mp's workers compute them, then the same gather;
* ``torchrl``: a TorchRL ``ReplayBuffer(prefetch=4)`` (uniform ``RandomSampler``, 4
  prefetch threads) over the same rows; for the action chunks of the views case, its
  ``SliceSampler`` (slices of 16 by the episode key); needs ``torchrl``, which is
  optional;
* ``ray``: unienv_mp's RaySampler on a local Ray that it starts, one actor per worker,
  with RaySampler's own default ``n_buffers`` (its label says how many) unless
  ``--buffers`` sets every row's; needs ``ray``, which is optional.  Not in
  ``DEFAULT_IMPLEMENTATIONS``: asked for by name.

Each measurement returns a result object (``Result``, ``OnlineResult``,
``LatencyResult``); the main job turns each case's results into one table.

The modules:

* ``config``: the rows, the cases, ``Config``; ``data``: the cases' buffers;
* ``peers``: the samplers compared (``make_sampler``), with ``index_select`` (the speed
  limit) and ``torchrl_peer`` (TorchRL's ReplayBuffer); ``views``: the views case's views;
  ``windows``: the windows case's view and the samplers it is compared with;
* ``measure``: timing a row (``Result``); ``online``, ``latency``, ``epochs``: the other
  cases' measurements and results;
* ``runner``: one case's rows measured into a table, a JSON payload and a chart;
  ``tables``, ``plots``, ``progress``: what the main job prints, draws and says while it
  works; ``cli``: its options and ``main``.
"""
