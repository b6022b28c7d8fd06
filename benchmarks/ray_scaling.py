"""RaySampler across nodes: where the CPU of a batch goes, measured on a simulated cluster
(``ray.cluster_utils.Cluster``) on this machine, and the batches/s it predicts.

    PYTHONPATH=. python benchmarks/ray_scaling.py                         # image and jpeg
    PYTHONPATH=. python benchmarks/ray_scaling.py --case image --nodes 1,2 --seconds 4

For each case, first the actors on the training process's own node (``nodes`` 0: they
write batches into result slots that the training process maps), then on 1, 2, ... other
nodes, two actors a node (every batch then crosses from another node's object store to
the training node's).  Each row measures, per batch:

* **ms**: wall-clock time per batch in a loop that reads one byte per 4 KiB of each batch;
* **caller**: CPU of the training process (all its threads);
* **ingest**: CPU of the training node's raylet (its object store receives every batch
  made on another node: Ray writes each into a new object);
* **make**: CPU of the actors and their nodes' raylets (gathering, and putting each batch
  into the node's object store).

The model: with ``n`` nodes of ``cores`` each making batches, a link of ``bw`` bytes/s,
and a training process that must take each batch,

    batches/s = min(n * cores / make, 1 / caller, 1 / ingest, bw / bytes)

(the training node's ingest runs on the raylet's threads, beside the training process).
On this machine every simulated node shares the same cores, so the prediction to check is
``cores / (make + caller + ingest)``: the CPU of a batch, wherever it runs, divided into
the machine's cores.  The simulated nodes talk over loopback, not a network.
"""
import argparse
import json
import os
import sys
import time

CASES = ("image", "jpeg")


def _cpu(pids):
    import psutil
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def measure(case, rb, cfg, nodes, seconds):
    """One row: ``nodes`` other nodes (0: this node) making ``case``'s batches."""
    import ray
    from ray.cluster_utils import Cluster
    from unienv_data.samplers import StepSampler

    from unienv_mp.bench.measure import batch_nbytes, touch
    from unienv_mp.ray import RaySampler

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2 if nodes == 0 else 0})
    others = [cluster.add_node(num_cpus=2, resources={"far": 2}) for _ in range(nodes)]
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        options = {"resources": {"far": 1}} if nodes else None
        n_workers = 2 * max(1, nodes)
        head = cluster.head_node.all_processes["raylet"][0].process.pid
        raylets = [n.all_processes["raylet"][0].process.pid for n in others]
        with RaySampler(StepSampler(rb, cfg.batch_size, seed=0), n_workers=n_workers,
                        actor_options=options) as sampler:
            for _ in range(10):
                batch = sampler.sample()
            nbytes = batch_nbytes(batch)
            del batch
            actors = [ray.get(a.where.remote())[1] for a in sampler.workers]
            make_pids = actors + raylets
            c0, i0, m0 = time.process_time(), _cpu([head]), _cpu(make_pids)
            t0 = time.perf_counter()
            n = 0
            while time.perf_counter() - t0 < seconds:
                touch(sampler.sample())
                n += 1
            wall = time.perf_counter() - t0
            caller = (time.process_time() - c0) / n
            ingest = (_cpu([head]) - i0) / n
            make = (_cpu(make_pids) - m0) / n
            if nodes == 0:   # (the head's raylet does not ingest: slots, no objects)
                make, ingest = make + ingest, 0.0
    finally:
        ray.shutdown()
        cluster.shutdown()
    cores = os.cpu_count() or 1
    return {"case": case, "nodes": nodes, "actors": n_workers, "bytes": nbytes,
            "ms": wall / n * 1e3, "caller_ms": caller * 1e3, "ingest_ms": ingest * 1e3,
            "make_ms": make * 1e3,
            "predicted_ms": (make + caller + ingest) / cores * 1e3}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", choices=CASES, action="append")
    p.add_argument("--nodes", default="0,1,2,3", help="comma-separated (0: this node)")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from unienv_mp.bench.config import case_config
    from unienv_mp.bench.data import case_data
    rows = []
    for case in args.case or CASES:
        cfg = case_config(case)
        with case_data(case, cfg) as rb:
            for nodes in (int(x) for x in args.nodes.split(",")):
                rows.append(measure(case, rb, cfg, nodes, args.seconds))
                if not args.json:
                    r = rows[-1]
                    print(f"{case:5s} {r['nodes']} node(s), {r['actors']} actors: "
                          f"{r['ms']:7.3f} ms/batch (model {r['predicted_ms']:.3f}); CPU "
                          f"ms/batch: caller {r['caller_ms']:.3f}, ingest "
                          f"{r['ingest_ms']:.3f}, make {r['make_ms']:.3f}; "
                          f"{r['bytes'] / 1e6:.2f} MB", flush=True)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()
