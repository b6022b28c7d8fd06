"""ShmQueue as a drop-in for multiprocessing.Queue: two producer processes put dicts of
numpy arrays, and the main process gets them.

Arrays travel through shared memory, not pickled through a pipe.
Run: python examples/shm_queue.py [--steps N]
"""
import argparse
import multiprocessing as mp

import numpy as np

from unienv_mp import ShmQueue

N_PRODUCERS = 2


def produce(queue, producer, n):
    """Puts n observations on the queue, then None to say it is done."""
    rng = np.random.default_rng(producer)
    for i in range(n):
        queue.put({"producer": producer, "i": i,
                   "image": rng.integers(0, 256, (3, 64, 64), dtype=np.uint8),   # 12 KB
                   "state": rng.random(10, dtype=np.float32)})
    queue.put(None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="messages per producer")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be 1 or more")

    ctx = mp.get_context("spawn")   # fork and forkserver work the same way
    queue = ShmQueue(ctx=ctx)       # was: queue = ctx.Queue()
    producers = [ctx.Process(target=produce, args=(queue, p, args.steps))
                 for p in range(N_PRODUCERS)]
    for p in producers:
        p.start()

    received = {p: [] for p in range(N_PRODUCERS)}   # the i's each producer sent
    done = 0
    while done < N_PRODUCERS:
        msg = queue.get(timeout=60)
        if msg is None:
            done += 1
            continue
        # msg["image"] is a numpy array viewing the queue's shared memory (zero-copy).
        # Its slot goes back to the queue once the array is garbage collected.
        received[msg["producer"]].append(msg["i"])
        example = msg
    for p in producers:
        p.join()
    queue.close()   # as with multiprocessing.Queue: this process puts no more on it

    # Messages of one producer arrive in the order it put them.
    assert all(ids == list(range(args.steps)) for ids in received.values())
    print("received", ", ".join(f"{len(ids)} messages from producer {p}"
                                 for p, ids in received.items()), "in order")
    image, state = example["image"], example["state"]
    print(f"the last message: producer {example['producer']}, i {example['i']}, "
          f"image {type(image).__name__} {image.dtype} {image.shape}, "
          f"state {type(state).__name__} {state.dtype} {state.shape}")


if __name__ == "__main__":
    main()
