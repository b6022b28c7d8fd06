"""CPU cost, in the training process, of a ``MultiprocessingSampler.sample()`` whose batch
is already waiting: what the training loop pays per batch when the workers keep up.

    PYTHONPATH=. python benchmarks/consumer_cost.py --case state
    PYTHONPATH=. python benchmarks/consumer_cost.py --case image --buffers 24

The workers (4, fork) are given ``n_buffers + 1`` batches to make; once every one of them
sits on a result ring (nothing collected yet), the workers are stopped with SIGSTOP, so
that they take no CPU from this process, and ``n_buffers`` calls of ``sample()`` are timed
(each also submits the next request, as in training).  Then the workers are continued and
the next round waits for them again.  Nothing is touched in the batches: it is the
transport's cost, not the data's.

Prints the mean wall and CPU microseconds per call (best and median round), and the mean
of each position in a round: the first calls after a pause pay for cold caches (hundreds
of microseconds), so a round of few calls reports more per call than one of many.
``--profile`` prints a cProfile of the timed calls; ``--perf-control FIFO`` enables a
``perf record -D -1 --control fifo:FIFO`` around them.
"""
import argparse
import gc
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=("state", "image"), default="state",
                    help="state: B=32 {state 10 f32, action 7 f32}; image: B=256 with a "
                         "3x128x128 u8 image too")
    ap.add_argument("--buffers", type=int, default=None,
                    help="n_buffers, and calls timed per round (default: 200 state, "
                         "24 image)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--copy", action="store_true", help="MultiprocessingSampler(copy=True)")
    ap.add_argument("--no-stop", action="store_true",
                    help="leave the workers running while timing (they then compete for "
                         "the CPUs with the calls measured)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--perf-control", metavar="FIFO")
    a = ap.parse_args(argv)

    from unienv_data.samplers import StepSampler

    import unienv_mp
    from unienv_mp.bench.config import Config
    from unienv_mp.bench.data import build_buffer
    from unienv_mp._sampling.sampler import MultiprocessingSampler

    if a.case == "state":
        cfg = Config(transitions=20_000, batch_size=32, image_shape=())
        n = a.buffers or 200
    else:
        cfg = Config(transitions=4_000, batch_size=256, image_shape=(3, 128, 128))
        n = a.buffers or 24
    print(f"unienv_mp from {os.path.dirname(unienv_mp.__file__)}", file=sys.stderr)
    rb = build_buffer(cfg)
    s = MultiprocessingSampler(StepSampler(rb, cfg.batch_size, seed=0), n_workers=4,
                               n_buffers=n, ctx=mp.get_context("fork"), copy=a.copy)
    ctl = open(a.perf_control, "w") if a.perf_control else None
    prof = None
    if a.profile:
        import cProfile
        prof = cProfile.Profile()

    def fill():
        """Request n_buffers + 1 batches, then wait (collecting nothing) until every worker
        has published all of its results."""
        manager = s._pools.sample
        s._streams["sample"].top_up(manager.submit, s.n_buffers)   # (as sample() does)
        lanes = manager._lanes
        ledger = getattr(manager, "_ledger", None)   # (None before the WorkLedger)

        def in_flight():
            if ledger is None:
                return sum(len(lane.inflight) for lane in lanes)
            return sum(map(len, ledger.inflight))

        deadline = time.monotonic() + 300
        while sum(lane.worker.results_published for lane in lanes) < in_flight():
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not catch up in 300 s")
            time.sleep(0.005)

    def pause(sig):
        if not a.no_stop and s._pools.sample is not None:
            for lane in s._pools.sample._lanes:
                if lane.worker.pid is not None:
                    os.kill(lane.worker.pid, sig)

    try:
        s.sample()                                           # starts the workers
        for _ in range(3):                                   # slots made and mapped
            fill()
            for _ in range(n):
                b = s.sample()
            del b
        wall, cpu = [], []
        at = [0.0] * n
        clock = time.perf_counter
        for _ in range(a.rounds):
            fill()
            pause(signal.SIGSTOP)
            gc.collect()
            time.sleep(0.01)
            gc.disable()
            if ctl:
                ctl.write("enable\n")
                ctl.flush()
                time.sleep(0.1)
            if prof:
                prof.enable()
            c0, t0 = time.process_time(), clock()
            t = t0
            for i in range(n):
                b = s.sample()
                now = clock()
                at[i] += now - t
                t = now
            del b
            t1, c1 = clock(), time.process_time()
            if prof:
                prof.disable()
            if ctl:
                ctl.write("disable\n")
                ctl.flush()
                time.sleep(0.1)
            gc.enable()
            pause(signal.SIGCONT)
            wall.append((t1 - t0) / n * 1e6)
            cpu.append((c1 - c0) / n * 1e6)
    finally:
        pause(signal.SIGCONT)
        s.close()
    print(f"{a.case}: B={cfg.batch_size}, n_buffers={n}, {a.rounds} rounds of {n} calls: "
          f"us per sample(): wall best {min(wall):.1f} median {statistics.median(wall):.1f}, "
          f"CPU best {min(cpu):.1f} median {statistics.median(cpu):.1f}")
    shown = at if n <= 30 else at[:10] + at[-3:]
    print("  mean us by position in the round"
          + (":" if n <= 30 else " (first 10, last 3):"),
          " ".join(f"{x / a.rounds * 1e6:.1f}" for x in shown))
    if prof:
        import pstats
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
