"""Batches handed out on a device: the parent's side of a sampler whose wrapped sampler
asks for batches on a GPU (``StepSampler(..., device="cuda")``), or whose caller asks for
page-locked CPU batches (``pin_memory=True``), or whose data already lives on a GPU.

One file per idea:

* `.ops`: what is asked of a device (the seam): streams, events, copies, host registrations.
  `CudaOps` does it with torch; the CPU tests drive the same code with a fake device whose
  copies complete later.
* `.pins`: each slot segment's mapping registered with the device once, and unregistered
  before it can be unmapped.
* `.feed`: the copies, issued ahead on the sampler's own stream, handed to the caller's
  stream, and the CPU batch (so its slot) let go when its copy completed.  The orderings are
  argued there, in one note that the other files cite ("the feed's rules").
* `.placement`: where a wrapped sampler's batches are made (workers on the CPU, or this
  process for data on the GPU), what the workers run, and the errors for what cannot be
  done.
* `.resident`: the manager that makes batches in this process (one ``index_select`` per
  array where it can, else the wrapped sampler's own methods), for data that already lives
  on the GPU.

Workers never touch a device: everything here runs in the training process.
"""
