"""What a Ray actor costs beside a worker process, on one machine: three measurements
behind the Ray guide's account of where RaySampler loses to MultiprocessingSampler.

    PYTHONPATH=. python benchmarks/ray_actor_cost.py            # all three, about 2 minutes
    PYTHONPATH=. python benchmarks/ray_actor_cost.py --only gather --rounds 5

* **gather**: the jpeg case's gather loop (a `SamplerTarget` writing each batch into a
  result slot, as both samplers' workers do), ``--batches`` batches in 2 forked worker
  processes and in 2 Ray actors *at the same time*, on the same cores, with no Ray call
  inside the loop: the CPU per batch of each.  What differs is only the process the
  loop runs in.
* **call**: an actor call that does nothing but answer as ``SamplerActor.run`` does, one
  at a time and 4 in flight: the CPU of the caller and of the actor per call.
* **start**: a `RaySampler` over the state case (batches of 32) started on a fresh local
  Ray: when its 1st, 8003rd and 40003rd batches came, ms per batch over batches 3 to 5003
  (the window the main job times for this case: 5000 batches after 3 of warm-up) and over
  the 3000 after them, how many actors had made batches by then, and the longest waits
  between two batches, with the batch they came before.
"""
import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time


def _loop(target, frames, n):
    from unienv_mp._sampling.target import NO_ARG
    cpu = time.process_time()
    for i in range(n):
        frames.write(target(("sample", NO_ARG)), i % 8)
    return time.process_time() - cpu


def _made(rb, seed):
    from unienv_data.samplers import StepSampler
    from unienv_mp import _os
    from unienv_mp._sampling.target import SamplerTarget
    from unienv_mp.ray._batch import ActorFrames
    _os.limit_threads()
    return SamplerTarget(StepSampler(rb, 64, seed=seed), direct=True), ActorFrames(seed)


def _process(rb, seed, n, go, out):
    target, frames = _made(rb, seed)
    _loop(target, frames, 5)
    go.wait()
    out.put(_loop(target, frames, n))


def gather(rounds, n):
    import ray
    from unienv_mp.bench.config import case_config
    from unienv_mp.bench.data import build_jpeg_buffer

    @ray.remote(num_cpus=0)
    class Loop:
        def __init__(self, rb, seed):
            self.target, self.frames = _made(rb, seed)

        def run(self, k):
            return _loop(self.target, self.frames, k)

    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="unienv_mp-jpeg-") as directory:
        rb = build_jpeg_buffer(case_config("jpeg"), directory)
        print(f"gather: jpeg batches of 64, {n} a process, 2 worker processes and 2 actors "
              f"at once; CPU ms per batch")
        for r in range(rounds):
            out, go = ctx.Queue(), ctx.Event()
            procs = [ctx.Process(target=_process, args=(rb, s, n, go, out)) for s in (0, 1)]
            for p in procs:
                p.start()
            actors = [Loop.remote(rb, s) for s in (10, 11)]
            ray.get([a.run.remote(5) for a in actors])
            time.sleep(3)   # (the processes have made their 5 too)
            go.set()
            refs = [a.run.remote(n) for a in actors]
            process = [out.get() for _ in procs]
            actor = ray.get(refs)
            for p in procs:
                p.join()
            for a in actors:
                ray.kill(a)
            pms, ams = 1e3 * sum(process) / (2 * n), 1e3 * sum(actor) / (2 * n)
            print(f"  round {r}: worker process {pms:6.2f}   actor {ams:6.2f}   "
                  f"actor / process {ams / pms:.3f}")


def call(seconds):
    import psutil
    import ray

    @ray.remote(num_cpus=0)
    class Answers:
        def run(self, items):
            return [(0, (1, 3, 4, 5, 6), 100) for _ in items], os.getpid(), time.process_time()

    actor = Answers.remote()
    pid = ray.get(actor.run.remote([None]))[1]
    proc = psutil.Process(pid)
    items = [(("sample", 123456789, 1), 3)] * 2
    for _ in range(200):
        ray.get(actor.run.remote(items))
    print("call: an actor call answering 2 tasks, as SamplerActor.run does; per call")
    for depth in (1, 4):
        cpu0, mine0 = sum(proc.cpu_times()[:2]), time.process_time()
        start, n = time.perf_counter(), 0
        refs = [actor.run.remote(items) for _ in range(depth)]
        while time.perf_counter() - start < seconds:
            ray.get(refs.pop(0))
            refs.append(actor.run.remote(items))
            n += 1
        ray.get(refs)
        wall = time.perf_counter() - start
        print(f"  {depth} in flight: {1e6 * wall / n:5.0f} us, the caller's CPU "
              f"{1e6 * (time.process_time() - mine0) / n:4.0f} us, the actor's "
              f"{1e6 * (sum(proc.cpu_times()[:2]) - cpu0) / n:4.0f} us")
    ray.kill(actor)


def start(rounds):
    from unienv_data.samplers import StepSampler
    from unienv_mp.bench.config import case_config
    from unienv_mp.bench.data import build_buffer
    from unienv_mp.bench.measure import touch
    from unienv_mp.ray import RaySampler

    rb = build_buffer(case_config("state"))
    print("start: a RaySampler of 4 actors over the state case (batches of 32), on a new "
          "local Ray each round")
    for r in range(rounds):
        begin = time.perf_counter()
        sampler = RaySampler(StepSampler(rb, 32, seed=0), n_workers=4)
        made = time.perf_counter()
        at = []
        for i in range(40003):
            touch(sampler.sample())
            at.append(time.perf_counter() - made)
            if i == 8002:
                started = sum(w.pid is not None for w in sampler.stats().workers)
        sampler.close()
        waits = sorted(((at[i] - at[i - 1], i) for i in range(1, 8003)), reverse=True)[:3]
        print(f"  round {r}: made in {made - begin:.2f} s; batch 1, 8003 and 40003 came "
              f"{at[0]:.2f}, {at[8002]:.2f} and {at[40002]:.2f} s later; ms per batch over "
              f"3..5003 {1e3 * (at[5003] - at[3]) / 5000:.3f}, over 5003..8003 "
              f"{1e3 * (at[8002] - at[5002]) / 3000:.3f}; actors that had made batches by "
              f"batch 8003: {started} of 4; longest waits: "
              + ", ".join(f"{1e3 * w:.0f} ms before batch {i}" for w, i in waits))


def _positive(kind):
    def parse(text):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
        return value
    return parse


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("gather", "call", "start"), action="append",
                   help="run only this measurement (may be repeated)")
    p.add_argument("--rounds", type=_positive(int), default=3,
                   help="rounds of gather and start")
    p.add_argument("--batches", type=_positive(int), default=120,
                   help="batches a process (gather)")
    p.add_argument("--seconds", type=_positive(float), default=4.0,
                   help="seconds a depth (call)")
    args = p.parse_args(argv)
    which = args.only or ["gather", "call", "start"]
    import ray
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores")
    if "gather" in which or "call" in which:
        ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
        if "gather" in which:
            gather(args.rounds, args.batches)
        if "call" in which:
            call(args.seconds)
        ray.shutdown()
    if "start" in which:
        start(args.rounds)   # (each RaySampler starts a Ray of its own, and stops it)
    return 0


if __name__ == "__main__":
    sys.exit(main())
