"""Start-up of spawn workers over a large in-memory buffer: how long until batches come,
and how much memory the workers add, unienv_mp against UniEnv's MultiprocessingSampler.

    PYTHONPATH=. python benchmarks/spawn_startup.py                 # 1 GiB, 4 workers
    PYTHONPATH=. python benchmarks/spawn_startup.py --gib 0.25 --workers 2 --json

The buffer is the main job's (``unienv_mp.bench.data.build_buffer``: a ReplayBuffer of
{state 10 f32, action 7 f32, image 3x128x128 u8} rows), as many rows as make ``--gib`` GiB, sampled in
batches of 256 by 4 workers started with spawn.  Each implementation runs in a fresh
process of its own (UniEnv's reductions move the buffer's tensors into /dev/shm, which
would change what the next one sees).  For each:

* **first batch**: seconds from making the sampler to its first ``sample()`` returning;
  the workers start in between (both samplers start them at the first call).
* **warm**: seconds from making the sampler until ``8 * workers`` batches have come, so
  that every worker has started and made batches.
* **workers' PSS**: the proportional set size of the worker processes, added up
  (``/proc/PID/smaps_rollup``), taken then, with its anonymous (``Pss_Anon``: the
  interpreter, torch, each worker's own memory) and shared-memory (``Pss_Shmem``: the
  workers' share of the buffer's pages they have read) parts.  Pages several processes
  map are divided among them, so the parent's share of the buffer is not in this sum.
  Of that, **buffer**: the PSS of the workers' mappings of the buffer's shared copy
  (unienv_mp's data segment; the files torch's reductions made in /dev/shm for UniEnv).
* **memory added**: what the parent and the workers hold together then, less what the
  parent held before the sampler was made (PSS; every page of the buffer's copy is mapped
  by the parent, so it is counted once here).

Run it once: it allocates several GiB for a 1 GiB buffer.
"""
import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

IMPLS = ("unienv_mp", "UniEnv")


def pss(pid):
    """``{field: bytes}`` of Pss, Pss_Anon, Pss_Shmem from /proc/PID/smaps_rollup."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Pss", "Pss_Anon", "Pss_Shmem"):
                out[name] = int(rest.split()[0]) * 1024
    return out


def buffer_pss(pid):
    """PSS in bytes of process ``pid``'s mappings of the buffer's shared copy: unienv_mp's
    data segments, or the files torch's reductions made in /dev/shm."""
    total, counting = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):      # a mapping's header line
                counting = "unienv_mp_data_" in line or "/torch_" in line
            elif counting and first == "Pss:":
                total += int(line.split()[1]) * 1024
    return total


def measure(impl, gib, n_workers, batches_per_worker=8):
    import torch
    from unienv_data.samplers import StepSampler

    from unienv_mp.bench.config import Config
    from unienv_mp.bench.data import build_buffer

    row = 10 * 4 + 7 * 4 + 3 * 128 * 128
    n = int(gib * (1 << 30) // row)
    rb = build_buffer(Config(transitions=n, image_shape=(3, 128, 128)))
    data = sum(s.data.nbytes for s in rb.storage.storage_map.values())
    torch.set_num_threads(1)
    before = pss(os.getpid())["Pss"]
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    if impl == "unienv_mp":
        from unienv_mp import MultiprocessingSampler
    else:
        from unienv_data.samplers import MultiprocessingSampler
    s = MultiprocessingSampler(StepSampler(rb, 256, seed=0), n_workers=n_workers, ctx=ctx)
    try:
        s.sample()
        first = time.perf_counter() - t0
        for _ in range(batches_per_worker * n_workers - 1):
            s.sample()
        warm = time.perf_counter() - t0
        workers = [p.pid for p in mp.active_children()]
        assert len(workers) == n_workers, workers
        per = [pss(pid) for pid in workers]
        total = {k: sum(p.get(k, 0) for p in per) for k in ("Pss", "Pss_Anon", "Pss_Shmem")}
        total["buffer"] = sum(buffer_pss(pid) for pid in workers)
        parent = pss(os.getpid())["Pss"]
    finally:
        s.close()
    return {"impl": impl, "rows": n, "data_bytes": data, "workers": n_workers,
            "first_batch_s": first, "warm_s": warm, "batches": batches_per_worker * n_workers,
            "workers_pss": total, "added_bytes": parent + total["Pss"] - before}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB (default 1)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--impl", choices=IMPLS, action="append",
                    help="run only this one (repeatable; default: both)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(measure(a.child, a.gib, a.workers)))
        return
    results = []
    for impl in a.impl or IMPLS:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", impl,
                            "--gib", str(a.gib), "--workers", str(a.workers)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{impl} failed:\n{r.stderr}")
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    if a.json:
        print(json.dumps(results, indent=1))
        return
    mib = 1 << 20
    r0 = results[0]
    print(f"buffer: {r0['rows']} rows, {r0['data_bytes'] / mib:.0f} MiB; "
          f"{r0['workers']} spawn workers; batches of 256")
    print(f"{'':>10} {'first batch s':>14} {'warm s':>8} {'workers PSS MiB':>16} "
          f"{'anon':>6} {'shmem':>6} {'buffer':>7} {'added MiB':>10}")
    for r in results:
        p = r["workers_pss"]
        print(f"{r['impl']:>10} {r['first_batch_s']:14.2f} {r['warm_s']:8.2f} "
              f"{p['Pss'] / mib:16.0f} {p['Pss_Anon'] / mib:6.0f} {p['Pss_Shmem'] / mib:6.0f} "
              f"{p['buffer'] / mib:7.0f} {r['added_bytes'] / mib:10.0f}")


if __name__ == "__main__":
    main()
