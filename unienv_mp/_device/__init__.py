"""Batches handed out on a device: the parent's side of a sampler whose wrapped sampler
asks for batches on a GPU (``StepSampler(..., device="cuda")``), or whose caller asks for
page-locked CPU batches (``pin_memory=True``), or whose data already lives on a GPU.

One file per idea:

* `.ops`: what is asked of a device (the seam): streams, events, copies, host registrations.
  `CudaOps` does it with torch, each call on the sampler's device; the CPU tests drive the
  same code with a fake device whose copies complete later, and `CudaOps` with a fake
  ``torch.cuda``.
* `.pins`: each slot segment's mapping registered with the device once, on a thread of its
  own, and unregistered there before it can be unmapped.
* `.keep`: the page-locked batches handed out (``pin_memory=True``), each kept until the
  caller's copies of it are done.
* `.feed`: the copies, issued ahead on the sampler's own stream, handed to the caller's
  stream, and the CPU batch (so its slot) let go when its copy completed; the hand-out of
  page-locked batches and of batches made on the device.  The orderings are argued there,
  in one note that the other files cite ("the feed's rules").
* `.placement`: where a wrapped sampler's batches are made (workers on the CPU, or this
  process for data on the GPU), what the workers run, and the errors for what cannot be
  done.
* `.resident`: the manager that makes batches in this process (one ``index_select`` per
  array where it can, else the wrapped sampler's own methods), for data that already lives
  on the GPU.

Workers never touch a device: everything here runs in the training process.
"""
