"""interleave.py - exhaustive interleaving checker, in pure Python, for the push / pop /
sleep / wake / shutdown protocol of csrc/umr_ring.c (UMR_VERSION 2: futex word with a
"someone may be asleep" flag, shutdown as a mark on head).

It is the same model as models/ring.pml (read that file's header for what is modelled,
what is abstracted and the memory-model assumption), written as explicit program-counter
machines so that it needs nothing but Python: every thread is a small machine whose
transitions each do exactly one access to shared memory (a load, a store, a CAS /
fetch-or / fetch-add, one futex operation) followed by the local computation up to its
next shared access.  The checker enumerates every interleaving of those transitions by
depth-first search over the whole state (shared memory + the kernel's futex queues +
every thread's registers + ghost variables), storing each state visited, and checks

  * no overwrite: a producer never writes a cell that holds an entry not yet released by
    its consumer (ghost `occ`), and a consumer reads the entry of its own position;
  * no duplicate, no loss (an entry is popped iff its push returned UMR_OK; without
    shutdown every entry is pushed), per-producer FIFO for every consumer;
  * claim() never takes its UMR_CORRUPT exit (the C comment: "a consistent ring cannot
    get here");
  * (a) no lost wake-up / no deadlock: a state where no thread can move must be one where
    every thread finished.  Such a state with a sleeper whose attempt would now succeed is
    reported as a lost wake-up; timeouts and poll intervals are disabled, so a sleeper
    only wakes through FUTEX_WAKE.

One exact reduction: the futex word is only ever compared for equality (FUTEX_WAIT's
compare, the notifier's CAS) with values read from it, and its counter bits only grow (no
2^31 wrap in the model), so the checker stores the counter as "equal to the word's now" or
"stale" in every register that holds a copy (`canonical`; test_model.py checks that the
plain encoding gives the same verdicts).

Broken variants (they must fail), numbered as in ring.pml: BROKEN=1 notifier loads the
word before its release store; 2 waiter takes `seen` from a load after its re-check;
3 waiter sleeps right after registering, without re-checking; 4 Vyukov's undoubled cell
sequence numbers; 5 waiter registers only once per blocking call; 6 notifier wakes one
sleeper (the lowest-numbered) instead of all.

Command line:  python3 models/interleave.py            (the default suite)
               python3 models/interleave.py --cap 1 --np 2 --nc 2 --ni 1 [--broken 1]
                                            [--shut] [--trace]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

# events
NE, NF = 0, 1                       # not_empty (consumers sleep), not_full (producers sleep)
# return codes
OK, FULL, EMPTY, CLOSED = 0, 1, 2, 3
MARK = 128                          # UMR_MARK (bit 63 of head in C)


@dataclass(frozen=True)
class Config:
    cap: int = 1
    items: tuple = (2,)             # entries pushed by each producer
    pops: tuple = (2,)              # entries popped by each consumer (ignored with shut)
    want: int = 1                   # 1: pop_wait, > 1: pop_many_wait(n = min(want, left))
    shut: bool = False              # a thread calls umr_ring_shutdown() at any moment;
                                    # consumers then pop until UMR_CLOSED
    broken: int = 0

    @property
    def np(self):
        return len(self.items)

    @property
    def nc(self):
        return len(self.pops)

    def name(self):
        s = f"cap={self.cap} P={list(self.items)} "
        s += f"C={list(self.pops)}" if not self.shut else f"C={self.nc}x(until closed)"
        if self.want > 1:
            s += f" want={self.want}"
        if self.shut:
            s += " shutdown"
        if self.broken:
            s += f" BROKEN={self.broken}"
        return s


class Violation(Exception):
    pass


@dataclass
class Result:
    config: Config
    states: int = 0
    transitions: int = 0
    error: str | None = None
    trace: list = field(default_factory=list)
    seconds: float = 0.0
    trace_fail: str | None = None

    def summary(self):
        out = (f"{self.config.name():48s} states={self.states:>8d} "
               f"transitions={self.transitions:>8d} errors={0 if self.error is None else 1}"
               f"  ({self.seconds:.1f}s)")
        if self.error:
            out += f"\n    -> {self.error}"
        return out


# ---- program counters ----
(DONE,
 P_HEAD, P_CELL, P_CAS, P_RECHK, P_PREW, P_PUB,
 C_HEAD, C_CELL, C_CAS, C_RECHK, C_PREW, C_CONS, C_EMPTY_HEAD, C_EMPTY_TAIL,
 N_LOAD, N_CAS, N_WAKE,
 W_REG, W_SEEN_LATE, W_FUTEX, W_WOKE,
 X_MARK, X_BUMP0, X_WAKE0, X_BUMP1, X_WAKE1) = range(27)

PC_TEXT = {
    P_HEAD: "claim: pos = head", C_HEAD: "claim: pos = tail",
    P_CELL: "claim: load cell seq", C_CELL: "claim: load cell seq",
    P_CAS: "claim: CAS head", C_CAS: "claim: CAS tail",
    P_RECHK: "claim: now = head", C_RECHK: "claim: now = tail",
    C_EMPTY_HEAD: "pop_empty: load head", C_EMPTY_TAIL: "pop_empty: load tail",
    P_PREW: "BROKEN: load not_empty word early", C_PREW: "BROKEN: load not_full word early",
    P_PUB: "publish: write entry, store seq = published",
    C_CONS: "consume: read entry, store seq = consumed",
    N_LOAD: "notify: fence X, w = word", N_CAS: "notify: CAS word w -> (w + 2) & ~1",
    N_WAKE: "notify: FUTEX_WAKE",
    W_REG: "prepare: seen = fetch_or(word, 1) | 1, fence Y",
    W_SEEN_LATE: "BROKEN: seen = word (after the re-check)",
    W_FUTEX: "umr_event_wait: FUTEX_WAIT(word, seen)",
    W_WOKE: "woken / EAGAIN; prepare: seen = fetch_or(word, 1) | 1",
    X_MARK: "shutdown: fetch_or(head, MARK)", X_BUMP0: "notify_all(not_empty): word += 2",
    X_WAKE0: "notify_all(not_empty): FUTEX_WAKE", X_BUMP1: "notify_all(not_full): word += 2",
    X_WAKE1: "notify_all(not_full): FUTEX_WAKE",
}

# ---- per-thread registers (offsets inside a thread's slice of the state) ----
(R_PC, R_POS, R_K, R_START, R_SEEN, R_W, R_RC, R_PHASE, R_N, R_DIFNEG, R_WANT, R_J,
 R_HD) = range(13)
NREG = 13

# ---- shared words ----
S_HEAD, S_TAIL, S_WORD, S_GOT, S_PUSHED = 0, 1, 2, 4, 5
NFIXED = 6


class Model:
    """State = one `bytes`: shared words, cells, ghosts, futex queues, thread registers."""

    def __init__(self, cfg: Config, canonical: bool = True):
        self.cfg = cfg
        self.canonical = canonical
        self.producers = range(cfg.np)
        self.consumers = range(cfg.np, cfg.np + cfg.nc)
        cap = cfg.cap
        self.nimax = max(cfg.items)
        self.total = sum(cfg.items)
        self.nthr = cfg.np + cfg.nc                       # threads that can sleep
        self.ncl = 1 if cfg.shut else 0                   # the closer
        self.o_cseq = NFIXED
        self.o_cval = self.o_cseq + cap
        self.o_cpos = self.o_cval + cap
        self.o_occ = self.o_cpos + cap
        self.o_last = self.o_occ + cap
        self.o_sleep = self.o_last + cfg.nc * cfg.np
        self.o_thr = self.o_sleep + self.nthr
        self.size = self.o_thr + (self.nthr + self.ncl) * NREG
        if cfg.broken == 4:
            self.seq = lambda p, ready: p + ready
            self.seq_done = lambda p: p + cap
        else:
            self.seq = lambda p, ready: 2 * p + ready
            self.seq_done = lambda p: 2 * (p + cap)
        assert cfg.shut or sum(cfg.pops) == self.total, "pushes and pops must balance"
        assert 2 * (self.total + 2 * cap) < MARK and cfg.np * self.nimax <= 8

    # -- helpers --
    def thr(self, t):
        return self.o_thr + t * NREG

    def initial(self):
        s = bytearray(self.size)
        for i in range(self.cfg.cap):
            s[self.o_cseq + i] = self.seq(i, 0)
        for t in range(self.nthr):
            self.begin_op(s, t)
        if self.cfg.shut:
            s[self.thr(self.nthr) + R_PC] = X_MARK
        if self.canonical:
            self.canon(s)
        return bytes(s)

    def is_producer(self, t):
        return t < self.cfg.np

    def begin_op(self, s, t):
        """Start the next blocking push / pop of thread t, or finish it."""
        b = self.thr(t)
        cfg = self.cfg
        if self.is_producer(t):
            if s[b + R_N] >= cfg.items[t]:
                s[b + R_PC] = DONE
                return
        else:
            left = cfg.pops[t - cfg.np] - s[b + R_N]
            if not cfg.shut and left <= 0:
                s[b + R_PC] = DONE
                return
            want = cfg.want if cfg.shut else min(cfg.want, left)
            s[b + R_WANT] = min(want, cfg.cap)      # claim() caps want at the capacity
        s[b + R_PHASE] = 0
        self.begin_attempt(s, t)

    def begin_attempt(self, s, t):
        b = self.thr(t)
        s[b + R_K] = 0
        s[b + R_PC] = P_HEAD if self.is_producer(t) else C_HEAD

    def after_attempt(self, s, t, rc):
        """wait_for(): what follows an attempt that returned rc."""
        b = self.thr(t)
        notyet = FULL if self.is_producer(t) else EMPTY
        for r in (R_K, R_START, R_POS, R_W, R_J, R_DIFNEG, R_HD):
            s[b + r] = 0
        if rc != notyet:
            s[b + R_RC] = rc
            self.end_op(s, t)
        elif s[b + R_PHASE] == 0:
            s[b + R_PHASE] = 1
            s[b + R_PC] = W_REG                       # first umr_event_prepare
        else:
            s[b + R_PC] = W_SEEN_LATE if self.cfg.broken == 2 else W_FUTEX

    def end_op(self, s, t):
        b = self.thr(t)
        rc = s[b + R_RC]
        s[b + R_RC] = s[b + R_SEEN] = s[b + R_PHASE] = 0
        if rc == CLOSED:
            s[b + R_PC] = DONE
            return
        if self.is_producer(t):
            s[b + R_N] += 1
        self.begin_op(s, t)

    def register(self, s, t, e):
        """umr_event_prepare: seen = fetch_or(word, 1) | 1 (BROKEN 2: result unused)."""
        w = s[S_WORD + e]
        if self.cfg.broken != 2:
            s[self.thr(t) + R_SEEN] = w | 1
        s[S_WORD + e] = w | 1

    def c_ready(self, s):
        tail, head = s[S_TAIL], s[S_HEAD]
        if head >= MARK and tail == head - MARK:
            return True                               # the pop would return UMR_CLOSED
        return s[self.o_cseq + tail % self.cfg.cap] == self.seq(tail, 1)

    def p_ready(self, s):
        head = s[S_HEAD]
        if head >= MARK:
            return True                               # the push would return UMR_CLOSED
        return s[self.o_cseq + head % self.cfg.cap] == self.seq(head, 0)

    # -- one transition of thread t from state st; None if t cannot move --
    def step(self, st, t):
        b = self.thr(t)
        pc = st[b + R_PC]
        if pc == DONE:
            return None
        if pc == W_WOKE and st[self.o_sleep + t] != 0:
            return None                               # asleep in FUTEX_WAIT
        s = bytearray(st)
        cfg = self.cfg
        cap = cfg.cap
        producer = t < cfg.np
        wait_ev = NF if producer else NE
        note_ev = NE if producer else NF              # the event this side notifies
        counter = S_HEAD if producer else S_TAIL
        ready = 0 if producer else 1
        CELL = P_CELL if producer else C_CELL

        # ---------------- claim() ----------------
        if pc in (P_HEAD, C_HEAD):                    # pos = counter (relaxed)
            pos = s[counter]
            s[b + R_POS] = pos
            s[b + R_K] = 0
            if pos >= MARK:
                self.after_attempt(s, t, CLOSED)      # only head carries the mark
            else:
                s[b + R_PC] = CELL
        elif pc in (P_CELL, C_CELL):                  # acquire load of cell (pos + k)
            pos, k = s[b + R_POS], s[b + R_K]
            want = 1 if producer else s[b + R_WANT]
            dif = s[self.o_cseq + (pos + k) % cap] - self.seq(pos + k, ready)
            if dif == 0:
                k += 1
                s[b + R_K] = k
                if k >= want:
                    s[b + R_PC] = P_CAS if producer else C_CAS
            elif k > 0:
                s[b + R_PC] = P_CAS if producer else C_CAS
            else:
                s[b + R_DIFNEG] = 1 if dif < 0 else 0
                s[b + R_PC] = P_RECHK if producer else C_RECHK
        elif pc in (P_CAS, C_CAS):                    # CAS(counter, pos -> pos + k)
            pos, k = s[b + R_POS], s[b + R_K]
            if s[counter] == pos:
                s[counter] = pos + k
                s[b + R_START] = pos
                s[b + R_J] = 0
                if cfg.broken == 1:
                    s[b + R_PC] = P_PREW if producer else C_PREW
                else:
                    s[b + R_PC] = P_PUB if producer else C_CONS
            else:                                     # failure reloads pos; `continue`
                pos = s[counter]
                s[b + R_POS] = pos
                s[b + R_K] = 0
                if pos >= MARK:
                    self.after_attempt(s, t, CLOSED)
                else:
                    s[b + R_PC] = CELL
        elif pc in (P_RECHK, C_RECHK):                # now = counter
            now, pos = s[counter], s[b + R_POS]
            if now == pos and s[b + R_DIFNEG]:        # full / empty
                if producer:
                    self.after_attempt(s, t, FULL)
                else:
                    s[b + R_PC] = C_EMPTY_HEAD
            elif now == pos:
                raise Violation(f"claim() reached UMR_CORRUPT: thread {t} saw the cell of "
                                f"position {pos} ahead of a counter that has not moved")
            else:
                s[b + R_POS] = now
                s[b + R_DIFNEG] = 0
                if now >= MARK:
                    self.after_attempt(s, t, CLOSED)
                else:
                    s[b + R_PC] = CELL
        elif pc == C_EMPTY_HEAD:                      # pop_empty(): head (acquire)
            hd = s[S_HEAD]
            if hd < MARK:
                self.after_attempt(s, t, EMPTY)
            else:
                s[b + R_HD] = hd
                s[b + R_PC] = C_EMPTY_TAIL
        elif pc == C_EMPTY_TAIL:                      # pop_empty(): tail (acquire)
            closed = s[S_TAIL] == s[b + R_HD] - MARK
            self.after_attempt(s, t, CLOSED if closed else EMPTY)

        # ---------------- publish / consume ----------------
        elif pc in (P_PREW, C_PREW):                  # BROKEN 1: word loaded too early
            s[b + R_W] = s[S_WORD + note_ev]
            s[b + R_PC] = P_PUB if producer else C_CONS
        elif pc == P_PUB:                             # memcpy + release store of seq
            start = s[b + R_START]
            c = start % cap
            if s[self.o_occ + c]:
                raise Violation(f"overwrite: producer {t} writes position {start} into cell "
                                f"{c}, which still holds the unread entry of position "
                                f"{s[self.o_cpos + c]}")
            v = t * self.nimax + s[b + R_N]
            s[self.o_occ + c] = 1
            s[self.o_cval + c] = v
            s[self.o_cpos + c] = start
            s[self.o_cseq + c] = self.seq(start, 1)
            s[S_PUSHED] |= 1 << v
            s[b + R_PC] = N_CAS if cfg.broken == 1 else N_LOAD
            if cfg.broken == 1 and not s[b + R_W] & 1:
                self.after_attempt(s, t, OK)
        elif pc == C_CONS:                            # read payload + release store of seq
            start, j, k = s[b + R_START], s[b + R_J], s[b + R_K]
            p = start + j
            c = p % cap
            if not s[self.o_occ + c] or s[self.o_cpos + c] != p:
                held = ("nothing" if not s[self.o_occ + c]
                        else "position %d" % s[self.o_cpos + c])
                raise Violation(f"consumer {t} reads position {p} from cell {c}, which "
                                f"holds {held}")
            v = s[self.o_cval + c]
            if s[S_GOT] >> v & 1:
                raise Violation(f"duplicate: item {v} popped twice")
            s[S_GOT] |= 1 << v
            cid = t - cfg.np
            li = self.o_last + cid * cfg.np + v // self.nimax
            if not v % self.nimax + 1 > s[li]:
                raise Violation(f"FIFO: consumer {cid} got item {v % self.nimax} of producer "
                                f"{v // self.nimax} after item {s[li] - 1}")
            s[li] = v % self.nimax + 1
            s[self.o_occ + c] = 0
            s[self.o_cseq + c] = self.seq_done(p)
            j += 1
            if j < k:
                s[b + R_J] = j
            else:
                s[b + R_N] += k                       # entries popped so far
                s[b + R_PC] = N_CAS if cfg.broken == 1 else N_LOAD
                if cfg.broken == 1 and not s[b + R_W] & 1:
                    self.after_attempt(s, t, OK)

        # ---------------- umr_event_notify(the other side's event) ----------------
        elif pc == N_LOAD:                            # fence X ; w = word (relaxed)
            w = s[S_WORD + note_ev]
            s[b + R_W] = w
            if w & 1:
                s[b + R_PC] = N_CAS
            else:
                self.after_attempt(s, t, OK)
        elif pc == N_CAS:                             # CAS(word, w -> (w + 2) & ~1)
            w = s[b + R_W]
            if s[S_WORD + note_ev] == w:
                s[S_WORD + note_ev] = (w + 2) & ~1
                s[b + R_PC] = N_WAKE
            else:
                w = s[S_WORD + note_ev]               # failure reloads w
                s[b + R_W] = w
                if not w & 1:
                    self.after_attempt(s, t, OK)
        elif pc == N_WAKE:                            # FUTEX_WAKE(INT_MAX)
            self.wake(s, note_ev)
            self.after_attempt(s, t, OK)

        # ---------------- wait_for() on this thread's event ----------------
        elif pc == W_REG:                             # first prepare
            self.register(s, t, wait_ev)
            if cfg.broken == 3:
                s[b + R_PC] = W_FUTEX                 # sleeps without re-checking
            else:
                self.begin_attempt(s, t)
        elif pc == W_SEEN_LATE:                       # BROKEN 2: seen read after re-check
            s[b + R_SEEN] = s[S_WORD + wait_ev]
            s[b + R_PC] = W_FUTEX
        elif pc == W_FUTEX:                           # FUTEX_WAIT(word, seen)
            if s[S_WORD + wait_ev] == s[b + R_SEEN]:
                s[self.o_sleep + t] = wait_ev + 1
            s[b + R_PC] = W_WOKE
        elif pc == W_WOKE:                            # returned; loop: prepare again
            if cfg.broken == 5:
                s[b + R_SEEN] = s[S_WORD + wait_ev]   # re-load, no re-registering
            else:
                self.register(s, t, wait_ev)
            self.begin_attempt(s, t)

        # ---------------- umr_ring_shutdown ----------------
        elif pc == X_MARK:
            s[S_HEAD] |= MARK
            s[b + R_PC] = X_BUMP0
        elif pc in (X_BUMP0, X_BUMP1):
            s[S_WORD + (NE if pc == X_BUMP0 else NF)] += 2
            s[b + R_PC] = pc + 1
        elif pc in (X_WAKE0, X_WAKE1):
            self.wake(s, NE if pc == X_WAKE0 else NF)
            s[b + R_PC] = X_BUMP1 if pc == X_WAKE0 else DONE
        else:                                         # pragma: no cover
            raise AssertionError(f"bad pc {pc}")
        if self.canonical:
            self.canon(s)
        return bytes(s)

    def canon(self, s):
        """Exact reduction (see the module docstring): keep bit 0 of every copy of a futex
        word, and replace its counter bits by 1 (equal to the word's now) or 0 (stale)."""
        for e in (NE, NF):
            cur = s[S_WORD + e] >> 1
            waiters = self.consumers if e == NE else self.producers
            notifiers = self.producers if e == NE else self.consumers
            for regs, r in ((waiters, R_SEEN), (notifiers, R_W)):
                for t in regs:
                    i = self.thr(t) + r
                    v = s[i]
                    s[i] = (2 if v >> 1 == cur else 0) | (v & 1)
            s[S_WORD + e] = 2 | (s[S_WORD + e] & 1)

    def wake(self, s, e):
        for i in range(self.nthr):
            if s[self.o_sleep + i] == e + 1:
                s[self.o_sleep + i] = 0
                if self.cfg.broken == 6:
                    return                            # broken: wakes one

    def check_final(self, s):
        """Called on a state where no thread can move."""
        cfg = self.cfg
        sleepers = [t for t in range(self.nthr) if s[self.o_sleep + t]]
        stuck = [t for t in range(self.nthr + self.ncl) if s[self.thr(t) + R_PC] != DONE]
        for t in sleepers:
            e = s[self.o_sleep + t] - 1
            can = self.c_ready(s) if e == NE else self.p_ready(s)
            who = "producer" if self.is_producer(t) else "consumer"
            if can:
                raise Violation(f"lost wake-up: {who} {t} sleeps forever on "
                                f"{'not_empty' if e == NE else 'not_full'} although its "
                                f"attempt would succeed (head={s[S_HEAD]} tail={s[S_TAIL]})")
        if stuck:
            raise Violation(f"deadlock: threads {stuck} never finish (sleeping: {sleepers})")
        allmask = 0
        for p, n in enumerate(cfg.items):
            for i in range(n):
                allmask |= 1 << (p * self.nimax + i)
        got, pushed = s[S_GOT], s[S_PUSHED]
        if got & ~pushed:
            raise Violation("popped an item whose push did not return UMR_OK")
        if pushed & ~got:
            raise Violation(f"loss: entries whose push returned UMR_OK were never popped "
                            f"(pushed {pushed:#x}, popped {got:#x})")
        if not cfg.shut:
            if pushed != allmask:
                raise Violation(f"loss: pushed {pushed:#x} of {allmask:#x}")
            if s[S_HEAD] != self.total or s[S_TAIL] != self.total:
                raise Violation("head / tail do not account for every entry")
        elif s[S_HEAD] < MARK or s[S_TAIL] != s[S_HEAD] - MARK:
            raise Violation("after shutdown, tail != head")

    def describe(self, st, t, nxt=None):
        """One line for the transition of thread t from state st (to nxt)."""
        b = self.thr(t)
        pc = st[b + R_PC]
        who = ("producer %d" % t if self.is_producer(t) else
               "consumer %d" % t if t < self.nthr else "closer")
        line = f"{who:10s} {PC_TEXT.get(pc, pc)}"
        if pc in (P_CELL, C_CELL):
            p = st[b + R_POS] + st[b + R_K]
            line += f" [pos {p}: seq {st[self.o_cseq + p % self.cfg.cap]}]"
        if pc in (P_CAS, C_CAS, P_RECHK, C_RECHK):
            line += f" [pos {st[b + R_POS]}]"
        if pc in (P_PUB, C_CONS):
            line += f" [pos {st[b + R_START] + st[b + R_J]}]"
        if nxt is not None:
            hd = nxt[S_HEAD]
            line += (f"   | head={hd & (MARK - 1)}{'+MARK' if hd >= MARK else ''} "
                     f"tail={nxt[S_TAIL]} "
                     f"cells={list(nxt[self.o_cseq:self.o_cseq + self.cfg.cap])} "
                     f"flags={[nxt[S_WORD + e] & 1 for e in (NE, NF)]} "
                     f"asleep={[i for i in range(self.nthr) if nxt[self.o_sleep + i]]}")
        return line


def explore(cfg: Config, max_states: int | None = None, canonical: bool = True) -> Result:
    """Depth-first search over every interleaving; stops at the first violation."""
    m = Model(cfg, canonical)
    res = Result(cfg)
    t0 = time.monotonic()
    init = m.initial()
    seen = {init}
    threads = range(m.nthr + m.ncl)
    step = m.step
    transitions = 0
    # path of frames [state, label of the transition into it, successors, next index]
    path = []

    def expand(st, label):
        """Push the frame of a newly reached state (or report it if it is a dead end)."""
        nonlocal transitions
        succ = []
        for t in threads:
            try:
                nxt = step(st, t)
            except Violation:
                path.append([st, label, [], 0])
                res.trace_fail = m.describe(st, t)
                raise
            if nxt is not None:
                succ.append((nxt, t))
        transitions += len(succ)
        path.append([st, label, succ, 0])
        if not succ:
            m.check_final(st)

    res.trace_fail = None
    try:
        expand(init, "initial")
        while path:
            frame = path[-1]
            succ, i = frame[2], frame[3]
            if i == len(succ):
                path.pop()
                continue
            frame[3] = i + 1
            nxt, t = succ[i]
            if nxt in seen:
                continue
            seen.add(nxt)
            expand(nxt, m.describe(frame[0], t))
            if max_states and len(seen) > max_states:
                raise RuntimeError(f"{cfg.name()}: more than {max_states} states")
    except Violation as exc:
        res.error = str(exc)
        res.trace = [f[1] for f in path[1:]]
        if res.trace_fail:
            res.trace.append(res.trace_fail + "   <-- violates")
        else:
            res.trace.append("(no thread can move)")
    res.states = len(seen)
    res.transitions = transitions
    res.seconds = time.monotonic() - t0
    return res


def shortest_trace(cfg: Config, canonical: bool = True) -> Result:
    """Breadth-first search: the shortest interleaving that violates a property."""
    m = Model(cfg, canonical)
    res = Result(cfg)
    t0 = time.monotonic()
    init = m.initial()
    parent = {init: None}
    frontier = [init]
    threads = range(m.nthr + m.ncl)
    transitions = 0

    def path_to(st):
        out = []
        while parent[st] is not None:
            prev, t = parent[st]
            out.append(m.describe(prev, t, st))
            st = prev
        return out[::-1]

    try:
        while frontier:
            nxt_frontier = []
            for st in frontier:
                moved = False
                for t in threads:
                    try:
                        nxt = m.step(st, t)
                    except Violation:
                        res.trace = path_to(st) + [m.describe(st, t) + "   <-- violates"]
                        raise
                    if nxt is None:
                        continue
                    moved = True
                    transitions += 1
                    if nxt not in parent:
                        parent[nxt] = (st, t)
                        nxt_frontier.append(nxt)
                if not moved:
                    try:
                        m.check_final(st)
                    except Violation:
                        res.trace = path_to(st) + ["(no thread can move)"]
                        raise
            frontier = nxt_frontier
    except Violation as exc:
        res.error = str(exc)
    res.states = len(parent)
    res.transitions = transitions
    res.seconds = time.monotonic() - t0
    return res


# The suite run by tests/test_model.py: every configuration must pass ...
CORRECT = [
    Config(cap=1, items=(3,), pops=(3,)),
    Config(cap=2, items=(3,), pops=(3,)),
    Config(cap=2, items=(3,), pops=(3,), want=2),
    Config(cap=1, items=(3,), pops=(2, 1)),
    Config(cap=2, items=(4,), pops=(2, 2)),
    Config(cap=1, items=(2, 1), pops=(3,)),
    Config(cap=2, items=(2, 2), pops=(4,)),
    Config(cap=2, items=(2, 1), pops=(3,), want=2),
    Config(cap=1, items=(1, 1), pops=(1, 1)),
    Config(cap=2, items=(1, 1), pops=(1, 1)),
    Config(cap=1, items=(2,), pops=(0,), shut=True),
    Config(cap=2, items=(2,), pops=(0,), shut=True),
    Config(cap=1, items=(1, 1), pops=(0,), shut=True),
    Config(cap=2, items=(1, 1), pops=(0,), shut=True),
    Config(cap=1, items=(1,), pops=(0, 0), shut=True),
]
# ... and every one of these must be caught (with the kind of violation given).
BROKEN = [
    (Config(cap=1, items=(2,), pops=(2,), broken=1), "lost wake-up"),
    (Config(cap=1, items=(2,), pops=(2,), broken=2), "lost wake-up"),
    (Config(cap=1, items=(2,), pops=(2,), broken=3), "lost wake-up"),
    (Config(cap=1, items=(2,), pops=(2,), broken=4), "overwrite"),
    (Config(cap=1, items=(2,), pops=(2,), broken=5), "lost wake-up"),
    (Config(cap=2, items=(1, 1), pops=(1, 1), broken=1), "lost wake-up"),
    (Config(cap=2, items=(1, 1), pops=(1, 1), broken=2), "lost wake-up"),
    (Config(cap=2, items=(1, 1), pops=(1, 1), broken=3), "lost wake-up"),
    (Config(cap=2, items=(1, 1), pops=(1, 1), broken=5), "lost wake-up"),
    (Config(cap=2, items=(1, 1), pops=(1, 1), broken=6), "lost wake-up"),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap", type=int)
    ap.add_argument("--np", type=int, default=1)
    ap.add_argument("--nc", type=int, default=1)
    ap.add_argument("--ni", type=int, default=2, help="items per producer")
    ap.add_argument("--want", type=int, default=1)
    ap.add_argument("--shut", action="store_true")
    ap.add_argument("--broken", type=int, default=0)
    ap.add_argument("--trace", action="store_true",
                    help="breadth-first: print the shortest trace of a violation")
    a = ap.parse_args(argv)
    if a.cap is None:
        failed = False
        for cfg in CORRECT:
            r = explore(cfg)
            print(r.summary())
            failed |= r.error is not None
        for cfg, expect in BROKEN:
            r = explore(cfg)
            caught = r.error is not None and expect in r.error
            print(r.summary() + ("" if caught else f"\n    -> NOT CAUGHT ({expect})"))
            failed |= not caught
        return 1 if failed else 0
    total = a.np * a.ni
    pops = (total,) if a.nc == 1 else (total - total // 2, total // 2)
    cfg = Config(cap=a.cap, items=(a.ni,) * a.np, pops=(0,) * a.nc if a.shut else pops,
                 want=a.want, shut=a.shut, broken=a.broken)
    r = shortest_trace(cfg) if a.trace else explore(cfg)
    print(r.summary())
    if r.error and a.trace:
        for i, line in enumerate(r.trace):
            print(f"  {i:3d}  {line}")
    return 1 if r.error else 0


if __name__ == "__main__":
    sys.exit(main())
