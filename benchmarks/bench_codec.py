"""Batches of torch tensors through ShmQueue vs multiprocessing.Queue vs faster_fifo.Queue.

    pytest benchmarks/bench_codec.py --benchmark-only

Batches (built by the producer process):

* large: ``{"image": uint8 256x3x128x128, "state": float32 256x10}`` (12.6 MB)
* small: ``{"state": float32 32x17}`` (2 KiB)

The consumer (the parent) reads one byte per 4 KiB page of every array it gets
(``t.numpy().reshape(-1).view(np.uint8)[::4096].sum()``) and then drops the batch.

Groups:

* ``codec: consumer <size>``: consumer-side cost of a batch, from calling ``get()``
  until the touch is done and the batch is dropped, with the batches already waiting in
  the queue: before every round (untimed) the producer puts ``CONSUMER_K`` = 4 batches
  and goes idle, and we busy-wait until they are in the queue; the round then gets and
  touches the 4 (figures are per batch).  extra_info also has the median of each step
  (``median_get_us``, ``median_touch_us``, ``median_drop_us``, and ``median_touch_again_us``:
  touching the same batch a second time, i.e. the cost of the touch itself once mapped
  and cached).  Target: <= 50 us for the large batch and >= 10x faster than
  multiprocessing.Queue.
* ``codec: end-to-end <size> <source>``: throughput of a stream of batches, producer ->
  parent, through a bounded queue (maxsize=4).  ``reuse``: the producer sends a few
  pre-built batches over and over; ``fresh``: it clones one before every put (a new
  tensor each time, as a DataLoader-style producer would have).

Which path torch tensors take
-----------------------------
This module imports ``torch.multiprocessing`` (as users of torch do), which registers
torch's reductions with ``multiprocessing.reduction.ForkingPickler``.  So through
**mp.Queue** (and through **faster_fifo.Queue**, which also pickles with ForkingPickler)
a tensor is *not* pickled by value: its storage is moved into shared memory
(``share_memory_``: one copy, only the first time a given tensor is sent) and a handle
goes through the pipe; with the default ``file_descriptor`` sharing strategy the receiver
fetches the descriptor from the sender's ``resource_sharer`` thread over a Unix socket and
maps it.  With ``reuse`` batches that copy happens once per pre-built batch, so mp and
faster_fifo copy nothing per put.  **ShmQueue** copies every batch into one of its
slots at ``put`` and the receiver gets zero-copy views of the slot (copy=False).
"""
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's ForkingPickler reductions)

from .benchutil import IMPLS, MiB, getter, putter, record_rates, warmups

PAGE = 4096
POOL = 3              # pre-built batches the producer cycles through
QUEUE_MAXSIZE = 4

SHAPES = {
    "large": {"image": ((256, 3, 128, 128), torch.uint8), "state": ((256, 10), torch.float32)},
    "small": {"state": ((32, 17), torch.float32)},
}
BATCH_BYTES = {k: sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size()
                      for s, d in v.values()) for k, v in SHAPES.items()}

CONSUMER_K = QUEUE_MAXSIZE  # batches waiting at the start of a consumer round
CONSUMER_ROUNDS = {"large": 25, "small": 60}
SETTLE = 0.001
E2E_ROUNDS = 8
E2E_N = {"large": 16, "small": 200}

TARGET = "large batch: consumer cost <= 50 us and >= 10x faster than mp.Queue"
MP_PATH = (f"torch.multiprocessing reductions via ForkingPickler, sharing strategy "
           f"{torch.multiprocessing.get_sharing_strategy()}")
PATH = {
    "shm": "ShmQueue codec: copy into a slot at put, zero-copy views at get (copy=False)",
    "mp": MP_PATH,
    "faster_fifo": MP_PATH + " (faster_fifo pickles with ForkingPickler)",
}


def make_batch(size, seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in SHAPES[size].items():
        if dtype == torch.uint8:
            out[name] = torch.randint(0, 256, shape, dtype=dtype, generator=g)
        else:
            out[name] = torch.randn(shape, dtype=dtype, generator=g)
    return out


def touch(batch):
    """Read one byte per 4 KiB page of every array of the batch."""
    s = 0
    for t in batch.values():
        s += int(t.numpy().reshape(-1).view(np.uint8)[::PAGE].sum())
    return s


def _make_queue(queues, impl):
    return queues(impl, maxsize=QUEUE_MAXSIZE, slot_size=16 * MiB, n_slots=2 * QUEUE_MAXSIZE,
                  max_size_bytes=16 * MiB)


def _batch_producer(conn, q, impl, size, source):
    """On order (n, ack): put n batches (then answer if ack)."""
    torch.set_num_threads(1)
    pool = [make_batch(size, seed) for seed in range(POOL)]
    put = putter(q, impl)
    i = 0
    while True:
        order = conn.recv()
        if order is None:
            break
        n, ack = order
        for _ in range(n):
            b = pool[i % POOL]
            i += 1
            if source == "fresh":
                b = {k: v.clone() for k, v in b.items()}
            put(b)
            del b
        if ack:
            conn.send(i)


# ---------------------------------------------------------------------------------------
# consumer-side cost of one waiting batch
# ---------------------------------------------------------------------------------------

def _spin(seconds):
    """Busy-wait (a sleeping consumer comes back with cold caches on this shared VM)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("size", ["large", "small"])
@pytest.mark.parametrize("impl", IMPLS)
def test_consumer_cost(benchmark, impl, size, queues, spawn_worker):
    benchmark.group = f"codec: consumer {size}"
    q = _make_queue(queues, impl)
    w = spawn_worker(_batch_producer, q, impl, size, "reuse")
    get = getter(q, impl)
    k = CONSUMER_K

    def fill():
        """Untimed: the producer puts k batches and goes idle; wait until they are in."""
        w.order((k, True))
        w.ack()          # every put() returned
        deadline = time.monotonic() + 10
        while q.empty():  # mp.Queue: its feeder thread writes the pipe after put()
            if time.monotonic() > deadline:
                raise TimeoutError("no batch arrived")
        _spin(SETTLE)    # ... and the rest of the k messages

    def get_and_touch():
        for _ in range(k):
            b = get()
            touch(b)
            del b        # a ShmQueue slot goes back to the free list here

    # warm-up: every pre-built batch once (torch moves each one to shared memory the first
    # time mp / faster_fifo send it; ShmQueue's decode plan cache), every slot once
    for _ in range(warmups(benchmark, 3)):
        fill()
        get_and_touch()
    benchmark.pedantic(get_and_touch, setup=fill, rounds=CONSUMER_ROUNDS[size], iterations=1)
    extra = {}
    if not getattr(benchmark, "disabled", False):
        extra = _decompose(q, get, fill, k)
    record_rates(benchmark, msgs_per_round=k, bytes_per_msg=BATCH_BYTES[size],
                 label="batch", target=TARGET, path=PATH[impl], **extra)


def _decompose(q, get, fill, k, rounds=8):
    """Median time of each step of the consumer, over a few more filled rounds."""
    steps = {"get_us": [], "touch_us": [], "drop_us": [], "touch_again_us": []}
    for _ in range(rounds):
        fill()
        for _ in range(k):
            t0 = time.perf_counter()
            b = get()
            t1 = time.perf_counter()
            touch(b)
            t2 = time.perf_counter()
            touch(b)
            t3 = time.perf_counter()
            del b
            t4 = time.perf_counter()
            steps["get_us"].append(t1 - t0)
            steps["touch_us"].append(t2 - t1)
            steps["touch_again_us"].append(t3 - t2)
            steps["drop_us"].append(t4 - t3)
    return {f"median_{name}": round(float(np.median(v)) * 1e6, 1) for name, v in steps.items()}


# ---------------------------------------------------------------------------------------
# end-to-end throughput
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["reuse", "fresh"])
@pytest.mark.parametrize("size", ["large", "small"])
@pytest.mark.parametrize("impl", IMPLS)
def test_end_to_end(benchmark, impl, size, source, queues, spawn_worker):
    benchmark.group = f"codec: end-to-end {size} {source}"
    q = _make_queue(queues, impl)
    w = spawn_worker(_batch_producer, q, impl, size, source)
    get = getter(q, impl)
    n = E2E_N[size]

    def one_round():
        w.order((n, False))
        for _ in range(n):
            b = get()
            touch(b)
            del b

    for _ in range(warmups(benchmark, 1)):
        one_round()
    benchmark.pedantic(one_round, rounds=E2E_ROUNDS, iterations=1)
    record_rates(benchmark, msgs_per_round=n, bytes_per_msg=BATCH_BYTES[size],
                 label="batch", path=PATH[impl])
