"""Where the time of a 1 MiB message goes: ShmQueue against multiprocessing.Queue.

    python benchmarks/queue_profile.py [--messages N] [--rounds R]

A producer process (spawn) puts N messages of 1 MiB (numpy uint8, then bytes) as fast as
it can; this process gets them and reads one byte per 4 KiB page of each, as
bench_queue.py's ``stream 1 MiB`` groups mean to (there, ``len(m[::4096])`` of a numpy
array makes a view and reads nothing; here every page is read).  One warm-up round (a ShmQueue's slots are
faulted in on first use), then R rounds.  Printed per message, mean within a round,
median over the rounds: the producer's ``put`` call, the consumer's ``get`` call, its page
reads, and the wall time per message (the inverse of the rate).  Then the floor of the
producer's copy: ``np.copyto`` of 1 MiB between two buffers of this process.
"""
import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

from unienv_mp import ShmQueue

MiB = 1 << 20


def _message(kind):
    if kind == "bytes":
        return bytes(range(256)) * (MiB // 256)
    return np.arange(MiB, dtype=np.uint64).astype(np.uint8)


def _produce(q, kind, conn):
    msg = _message(kind)
    conn.send("ready")
    while (n := conn.recv()) is not None:
        puts = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            q.put(msg)
            puts.append(time.perf_counter_ns() - t0)
        conn.send(puts)


def _round(q, conn, n):
    gets, reads = [], []
    conn.send(n)
    start = time.perf_counter_ns()
    for _ in range(n):
        t0 = time.perf_counter_ns()
        m = q.get()
        t1 = time.perf_counter_ns()
        np.frombuffer(m, np.uint8)[::4096].sum()   # (reads each page: a view alone does not)
        reads.append(time.perf_counter_ns() - t1)
        gets.append(t1 - t0)
        del m
    wall = (time.perf_counter_ns() - start) / n
    puts = conn.recv()
    return statistics.mean(puts), statistics.mean(gets), statistics.mean(reads), wall


def _measure(ctx, q, kind, n, rounds):
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_produce, args=(q, kind, child))
    p.start()
    parent.recv()
    _round(q, parent, n)   # warm-up
    rows = [_round(q, parent, n) for _ in range(rounds)]
    parent.send(None)
    p.join()
    return [statistics.median(col) / 1e3 for col in zip(*rows)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{args.messages} messages of 1 MiB per round, {args.rounds} rounds; "
          f"us per message (mean within a round, median over rounds)")
    print(f"{'queue':24} {'payload':8} {'put':>8} {'get':>8} {'read':>8} {'wall':>8}")
    for kind in ("numpy", "bytes"):
        for name in ("ShmQueue", "multiprocessing.Queue"):
            q = ShmQueue(ctx=ctx, slot_size=2 * MiB) if name == "ShmQueue" else ctx.Queue()
            put, get, read, wall = _measure(ctx, q, kind, args.messages, args.rounds)
            print(f"{name:24} {kind:8} {put:8.1f} {get:8.1f} {read:8.1f} {wall:8.1f}")
            if name == "ShmQueue":
                q.shutdown()
            q.close()
    src, dst = _message("numpy"), np.empty(MiB, np.uint8)
    copies = []
    for _ in range(1000):
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        copies.append(time.perf_counter_ns() - t0)
    print(f"floor: np.copyto of 1 MiB in one process: {statistics.median(copies) / 1e3:.1f} us")


if __name__ == "__main__":
    main()
