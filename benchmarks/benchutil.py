"""Helpers shared by the benchmark files (queues of each implementation, forked workers,
per-message figures)."""
import multiprocessing as mp

CTX = mp.get_context("fork")

IMPLS = ["shm", "mp", "faster_fifo"]

MiB = 1 << 20


# ---------------------------------------------------------------------------------------
# queues
# ---------------------------------------------------------------------------------------

def make_queue(impl, *, maxsize=0, slot_size=MiB, n_slots=None, max_size_bytes=16 * MiB):
    """A queue of implementation ``impl``.  ``slot_size``/``n_slots`` only apply to shm,
    ``max_size_bytes`` only to faster_fifo (its circular buffer must hold the messages)."""
    if impl == "shm":
        from unienv_mp._transport.shm_queue import ShmQueue
        return ShmQueue(maxsize, ctx=CTX, slot_size=slot_size, n_slots=n_slots)
    if impl == "mp":
        return CTX.Queue(maxsize)
    if impl == "faster_fifo":
        import faster_fifo
        if maxsize > 0:
            return faster_fifo.Queue(max_size_bytes=max_size_bytes, maxsize=maxsize)
        return faster_fifo.Queue(max_size_bytes=max_size_bytes)
    raise ValueError(impl)


def putter(q, impl):
    """``q.put`` that never gives up (faster_fifo's put times out after 10 s by default)."""
    if impl == "faster_fifo":
        return lambda obj, _put=q.put: _put(obj, True, 600.0)
    return q.put


def getter(q, impl):
    if impl == "faster_fifo":
        return lambda _get=q.get: _get(True, 600.0)
    return q.get


def close_queue(q, impl):
    """Release a queue in this process without waiting on unread data."""
    try:
        if impl == "shm":
            q.shutdown()  # (workers are gone) a feeder thread blocked on a full ring ends
        if impl in ("shm", "mp"):
            q.cancel_join_thread()
            q.close()
            q.join_thread()
        else:
            q.close()
    except Exception:  # already closed / detached: nothing left to release
        pass


# ---------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------

def _worker_main(conn, target, args):
    try:
        target(conn, *args)
    finally:
        conn.close()


class Worker:
    """A forked child running ``target(conn, *args)``; ``conn`` is its end of a Pipe.

    Convention: the child loops on ``conn.recv()``, stops on ``None``, and answers each
    order with ``conn.send(...)`` when the parent needs an acknowledgement."""

    def __init__(self, target, *args):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_worker_main, args=(child, target, args),
                                daemon=True, name=f"bench-{target.__name__}")
        self.proc.start()
        child.close()

    def order(self, msg):
        self.conn.send(msg)

    def ack(self, timeout=60.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.proc.name} did not answer within {timeout} s")
        return self.conn.recv()

    def stop(self, timeout=5.0):
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
        self.proc.close()


# ---------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------

def warmups(benchmark, n):
    """``n`` warm-up rounds, none when benchmarks are disabled (``--benchmark-disable``:
    every test then runs its round once, as a quick smoke test)."""
    return 0 if getattr(benchmark, "disabled", False) else n


def record_rates(benchmark, *, msgs_per_round, bytes_per_msg=None, round_trips=False,
                 label="msg", **extra):
    """Derive per-message figures from the mean (and best) round time into extra_info."""
    benchmark.extra_info["msgs_per_round"] = msgs_per_round
    benchmark.extra_info.update(extra)
    stats = getattr(benchmark, "stats", None)
    if stats is None or getattr(benchmark, "disabled", False):
        return
    mean, best = stats.stats.mean, stats.stats.min
    per, per_best = mean / msgs_per_round, best / msgs_per_round
    info = benchmark.extra_info
    unit = "round_trip" if round_trips else label
    plural = unit + ("es" if unit.endswith("ch") else "s")
    info[f"us_per_{unit}"] = round(per * 1e6, 3)
    info[f"us_per_{unit}_best"] = round(per_best * 1e6, 3)
    info[f"{plural}_per_s"] = round(1 / per)
    if bytes_per_msg:
        info["bytes_per_msg"] = bytes_per_msg
        info["MB_per_s"] = round(bytes_per_msg / per / 1e6, 1)
