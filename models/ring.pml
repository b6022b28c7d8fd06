/*
 * ring.pml - Promela model of the push / pop / sleep / wake / shutdown protocol of
 * csrc/umr_ring.c: UMR_VERSION 2, futex word with a "someone may be asleep" flag, shutdown
 * as a mark on head.
 *
 *   ring     bounded MPMC, Vyukov's per-cell sequence numbers doubled: for position p the
 *            cell seq is 2p (free for p), 2p+1 (published), 2(p+cap) (consumed: free for
 *            p+cap); head / tail claimed by CAS after checking the cell (claim()).
 *   events   one 32-bit futex word per event: bit 0 "someone may be asleep", bits 1..31 a
 *            counter.  Waiter: loop { seen = fetch_or(word, 1) | 1 ; fence Y ; attempt ;
 *            futex_wait(word, seen) }.  Notifier, after its release store: fence X ;
 *            w = word ; while (w & 1) if CAS(word, w, (w + 2) & ~1) { FUTEX_WAKE(all) }.
 *   shutdown fetch_or(head, MARK) ; notify_all(not_empty) ; notify_all(not_full).  A claim
 *            of head that sees the mark returns UMR_CLOSED; a pop that finds nothing
 *            returns UMR_CLOSED only when head is marked and tail == head & ~MARK.
 *
 * Run through models/check.sh; parameters are preprocessor macros given to `spin -a`:
 *   CAP     ring capacity (1 or 2)
 *   NP, NC  producers, consumers (1 or 2 each)
 *   NI      items pushed by producer 0 (and by producer 1 unless NI1 is given)
 *   NPOP0   entries popped by consumer 0 (default: half, rounded up); consumer 1 pops the
 *           rest.  Pushes and pops balance, so every blocking call can eventually succeed.
 *   WANT    entries a consumer asks for per blocking pop: 1 = umr_ring_pop_wait,
 *           > 1 = umr_ring_pop_many_wait(n = min(WANT, what it still has to pop))
 *   SHUT    1: add a thread that calls umr_ring_shutdown() at an arbitrary moment;
 *           producers stop at UMR_CLOSED, consumers pop until UMR_CLOSED
 *   WEAKCAS 1: CASes may also fail spuriously (compare_exchange_weak).  Only for the
 *           non-progress-cycle check, to show that it does find cycles: the cycles it then
 *           finds are a CAS failing spuriously forever, which the model otherwise omits
 *   BROKEN  0: the protocol as written in the C code.  Deliberately broken variants that
 *           spin must reject:
 *           1  notifier loads the futex word before its publish / consume store is visible
 *              (fence X missing: the store->load reordering a store buffer allows)
 *           2  waiter takes `seen` from a load after its re-check, not from its fetch_or
 *           3  waiter sleeps right after registering, without re-checking its condition
 *           4  Vyukov's original, undoubled cell sequence numbers (free for p = p,
 *              published = p + 1, consumed = p + cap): with CAP == 1 "published for p"
 *              equals "free for p + 1" and a producer overwrites an unread entry
 *           5  waiter registers (sets bit 0) only once per blocking call, then after each
 *              sleep just re-loads the word: the flag cleared by a notify is not set again
 *           6  notifier wakes one sleeper (FUTEX_WAKE 1) instead of all
 *
 * ASSUMPTION (memory model).  Spin explores interleavings, i.e. sequentially consistent
 * executions: every shared-memory access of the C code is one atomic step here, in
 * program order.  The C code is not SC throughout (relaxed counter loads, acquire/release
 * cell sequence numbers), but the one place where the wake-up argument needs more than
 * acquire/release - the store(publish / consume) -> fence X -> load(word) of the notifier
 * against the RMW(fetch_or word) -> fence Y -> loads of the re-check of the waiter, the
 * "store buffering" pattern - is ordered by the two seq_cst fences (full_fence()), which
 * is what the SC model gives.  BROKEN=1 shows what happens without fence X.
 * Weak-memory behaviours of the relaxed / acquire loads beyond that pattern are not
 * explored here.
 *
 * Abstractions:
 *  - no deadlines, no poll interval (UMR_TIMEOUT / UMR_POLL never happen), no signals
 *    (UMR_INTR), no futex failure (UMR_SYSERR), no process death: a sleeper only wakes
 *    through FUTEX_WAKE, so a lost wake-up is a sleeper blocked forever, which the
 *    watchdog and spin's end-state check report;
 *  - the spin phase of wait_for() is omitted: it only repeats the first attempt;
 *  - CAS weak never fails spuriously (a spurious failure only re-runs the loop), except
 *    with WEAKCAS;
 *  - counters, cell sequence numbers and the futex word are bytes that never wrap (2^63 /
 *    2^64 / 2^31 in C); the shutdown mark is bit 7 of head (bit 63 in C);
 *  - the payload is one byte (the item id); memcpy + len store are folded into the step
 *    that publishes (release store of 2p+1), and the payload read into the step that
 *    releases the cell (store of 2(p+cap)).  No thread reads a cell's payload without
 *    owning it through the seq protocol, and the `occ` ghost spans from the producer's
 *    write to the consumer's release, so a write into a cell whose entry is still unread
 *    is caught all the same;
 *  - FUTEX_WAIT(word, seen) is one atomic step: if word == seen, enqueue (and block until
 *    a FUTEX_WAKE dequeues us) else return (EAGAIN) - the kernel's compare under the
 *    futex bucket lock.  FUTEX_WAKE(INT_MAX) is one atomic step that dequeues every
 *    sleeper of the word.  No spurious wake-ups (they only help).
 */

#ifndef CAP
#define CAP 2
#endif
#ifndef NP
#define NP 2
#endif
#ifndef NC
#define NC 2
#endif
#ifndef NI
#define NI 2
#endif
#ifndef NI1
#define NI1 NI                   /* items pushed by producer 1 (if NP == 2) */
#endif
#ifndef WANT
#define WANT 1
#endif
#ifndef SHUT
#define SHUT 0
#endif
#ifndef BROKEN
#define BROKEN 0
#endif
#ifndef WEAKCAS
#define WEAKCAS 0
#endif

#if NI > NI1
#define NIMAX NI
#else
#define NIMAX NI1
#endif
#define TOTAL (NI + (NP - 1) * NI1)     /* entries pushed in all (NP <= 2) */
#ifndef NPOP0
#define NPOP0 ((TOTAL + NC - 1) / NC)   /* entries popped by consumer 0; consumer 1 pops the
                                         * rest */
#endif
/* item ids: producer p's n-th item is p * NIMAX + n */

#define NTHR  (NP + NC)          /* threads that can sleep: producers 0..NP-1, consumers after */
#define NE 0                     /* not_empty: consumers sleep here, producers notify */
#define NF 1                     /* not_full:  producers sleep here, consumers notify */
#define MARK 128                 /* UMR_MARK: the shutdown mark in head */

#define OK     0
#define FULL   1
#define EMPTY  2
#define CLOSED 3

/* ---- shared memory ---- */
byte head, tail;                 /* positions ever claimed by producers / consumers */
byte cseq[CAP];                  /* cell seq numbers */
byte cval[CAP];                  /* payload: item id */
byte evword[2];                  /* futex words: bit 0 "may be asleep", bits 1.. counter */

/* ---- the kernel's futex queues ---- */
byte sleeping[NTHR];             /* 0 awake, 1 + e: queued on event e's word */
byte nsleep[2];                  /* how many are queued on each word */

/* ---- ghosts (not in the C code; only for the assertions) ---- */
bit  occ[CAP];                   /* written and not yet released by its consumer */
byte cpos[CAP];                  /* position whose producer wrote the payload */
bit  got[NP * NIMAX];            /* item popped (no duplicates, no loss) */
bit  pushed[NP * NIMAX];         /* push of item returned UMR_OK */
byte last[NC * NP];              /* per consumer, per producer: 1 + index of last item seen */

/* the cell sequence numbers: SEQ(p, 0) free for p, SEQ(p, 1) published, SEQ_DONE(p) */
#if BROKEN == 4
#define SEQ(p, ready) ((p) + (ready))
#define SEQ_DONE(p) ((p) + CAP)
#else
#define SEQ(p, ready) (2 * (p) + (ready))
#define SEQ_DONE(p) (2 * ((p) + CAP))
#endif

#define HPOS (head & (MARK - 1))
/* a consumer's attempt would now succeed (an entry, or UMR_CLOSED) */
#define C_READY (cseq[tail % CAP] == SEQ(tail, 1) || (head >= MARK && tail == HPOS))
/* a producer's attempt would now succeed (a free cell, or UMR_CLOSED) */
#define P_READY (head >= MARK || cseq[head % CAP] == SEQ(head, 0))

/* FUTEX_WAKE(word of e, INT_MAX): one atomic step, dequeues every sleeper of the word */
inline futex_wake(e) {
  d_step {
    i = 0;
    do
    :: i < NTHR ->
       if
       :: sleeping[i] == e + 1 ->
          sleeping[i] = 0; nsleep[e]--;
#if BROKEN == 6
          i = NTHR - 1                            /* broken: wakes one */
#else
          skip
#endif
       :: else -> skip
       fi;
       i++
    :: else -> break
    od;
    i = 0
  }
}

/* umr_event_prepare(e): seen = fetch_or(word, 1, acq_rel) | 1 ; fence Y (SC here) */
inline prepare(e) {
  atomic {
#if BROKEN != 2
    seen = evword[e] | 1;
#endif
    evword[e] = evword[e] | 1
  }
}

/* umr_event_wait(e, seen) = FUTEX_WAIT(word, seen), no timeout; then wait_for() loops and
 * registers again (prepare).  The return from the sleep touches no shared memory, so it is
 * folded into the fetch_or that follows it (other threads still run between the wake-up
 * and that fetch_or: the wake is the waker's step). */
inline sleep_then_register(e) {
  atomic {
    if
    :: evword[e] == seen -> sleeping[me] = e + 1; nsleep[e]++
    :: else -> skip                               /* EAGAIN: the word changed */
    fi
  };
  atomic {
    sleeping[me] == 0;                            /* asleep until woken: NOT an end state */
#if BROKEN == 5
    seen = evword[e]                              /* broken: re-load, no re-registering */
#else
    prepare(e)
#endif
  }
}

/* umr_event_notify(e), after the release store that made the condition true.  With
 * BROKEN == 1, `w` was loaded before that store (see the callers). */
inline notify(e) {
  /* full_fence(): fence X - SC in this model */
#if BROKEN != 1
  w = evword[e];                                  /* relaxed load */
#endif
  do
  :: (w & 1) ->
     atomic {                                     /* CAS weak(word, w -> (w + 2) & ~1) */
       if
       :: evword[e] == w -> evword[e] = (w + 2) & 254; casok = 1
       :: else -> w = evword[e]                   /* failure reloads w */
#if WEAKCAS
       :: evword[e] == w -> skip                  /* spurious failure */
#endif
       fi
     };
     if
     :: casok -> casok = 0; futex_wake(e); break
     :: else -> skip
     fi
  :: else -> break
  od;
  w = 0
}

/* umr_event_notify_all(e): fetch_add(word, 2) ; FUTEX_WAKE(all) */
inline notify_all(e) {
  evword[e] = evword[e] + 2;
  futex_wake(e)
}

/* claim(r, counter, want, ready, &start): on return k = number claimed; k == 0 means
 * "not ready" (full / empty), or UMR_CLOSED if `shut` is set (a producer saw the mark).
 * k == 0 on entry.  Each step does one shared access (a counter load, a cell seq load,
 * the CAS). */
inline claim(counter, ready, wantv) {
  pos = counter;                                  /* relaxed load */
  do
  :: pos >= MARK -> shut = 1; break               /* return UMR_CLOSED */
  :: else ->
     atomic {                                     /* acquire load of cell (pos + k) */
       dif = cseq[(pos + k) % CAP] - SEQ(pos + k, ready);
       if
       :: dif == 0 -> k++
       :: else -> skip
       fi
     };
     if
     :: dif == 0 && k < wantv -> skip             /* check the next cell */
     :: (dif == 0 && k == wantv) || (dif != 0 && k > 0) ->
        atomic {                                  /* CAS weak(counter, pos -> pos + k) */
          if
          :: counter == pos -> counter = pos + k; casok = 1
          :: else -> pos = counter; k = 0         /* failure reloads pos; `continue` */
#if WEAKCAS
          :: counter == pos -> k = 0              /* spurious failure */
#endif
          fi
        };
        if
        :: casok -> start = pos; casok = 0; break
        :: else -> skip
        fi
     :: dif != 0 && k == 0 ->
        atomic {                                  /* now = counter (relaxed) */
          if
          :: dif < 0 && counter == pos -> casok = 1   /* return 0: full / empty */
          :: dif > 0 && counter == pos ->
             assert(false)                        /* UMR_CORRUPT: "a consistent ring
                                                   * cannot get here" */
          :: else -> pos = counter                /* pos = now; loop */
          fi
        };
        if
        :: casok -> casok = 0; break
        :: else -> skip
        fi
     fi
  od;
  pos = 0; dif = 0
}

/* umr_ring_try_push (len check omitted) of item v -> rc */
inline try_push(v) {
  claim(head, 0, 1);
  if
  :: k > 0 ->
#if BROKEN == 1
     w = evword[NE];                              /* word load hoisted above the publish */
#endif
     atomic {                                     /* publish(): memcpy, len, release store */
       c = start % CAP;
       assert(!occ[c]);                           /* (b) no overwrite of an unread entry */
       occ[c] = 1; cval[c] = v; cpos[c] = start;
       cseq[c] = SEQ(start, 1);
       pushed[v] = 1;                             /* ghost: this push returns UMR_OK */
       c = 0
     };
     notify(NE);
     rc = OK
  :: k == 0 && shut -> rc = CLOSED
  :: else -> rc = FULL
  fi;
  k = 0; start = 0; shut = 0
}

/* umr_ring_try_pop / umr_ring_try_pop_many(n = wantv) -> rc; entries checked on the way */
inline try_pop(wantv) {
  claim(tail, 1, wantv);
  if
  :: k > 0 ->
#if BROKEN == 1
     w = evword[NF];                              /* word load hoisted above the release */
#endif
     do
     :: j < k ->
        atomic {                                  /* consume(): read len + payload, then
                                                   * the release store of 2 (p + cap) */
          c = (start + j) % CAP;
          assert(occ[c] && cpos[c] == start + j); /* reads the entry of its position */
          v = cval[c];
          assert(!got[v]);                        /* no duplicate */
          got[v] = 1;
          assert(v % NIMAX + 1 > last[cid * NP + v / NIMAX]);  /* per-producer FIFO */
          last[cid * NP + v / NIMAX] = v % NIMAX + 1;
          occ[c] = 0;
          cseq[c] = SEQ_DONE(start + j);
          v = 0; c = 0
        };
        j++
     :: else -> break
     od;
     npopped = npopped + k;
     notify(NF);
     rc = OK
  :: else ->                                      /* pop_empty() */
     hd = head;                                   /* acquire load */
     if
     :: hd < MARK -> rc = EMPTY
     :: else ->
        atomic {                                  /* acquire load of tail */
          if
          :: tail == hd - MARK -> rc = CLOSED
          :: else -> rc = EMPTY
          fi
        }
     fi;
     hd = 0
  fi;
  j = 0; k = 0; start = 0
}

/* wait_for(attempt, ev = e, not_yet), no deadline, no poll, spin phase omitted:
 *     rc = attempt(); if (rc != not_yet) return rc;
 *     for (;;) { seen = prepare(e); rc = attempt(); if (rc != not_yet) break;
 *                futex_wait(e, seen); }
 * written as one loop so that the attempt appears once (phase 1: has registered). */
#if BROKEN == 2
#define SLEEP(e) seen = evword[e]; sleep_then_register(e)   /* seen read after re-check */
#else
#define SLEEP(e) sleep_then_register(e)
#endif
#if BROKEN == 3
#define FIRST_REGISTER(e) prepare(e); sleep_then_register(e) /* no re-check before sleep */
#else
#define FIRST_REGISTER(e) prepare(e)
#endif

#define WAIT_FOR(ATTEMPT, e, NOTYET)                                          \
  phase = 0;                                                                  \
  do                                                                          \
  :: ATTEMPT;                                                                 \
     if                                                                       \
     :: rc != NOTYET -> break                                                 \
     :: rc == NOTYET && phase == 0 -> FIRST_REGISTER(e); phase = 1            \
     :: rc == NOTYET && phase == 1 -> SLEEP(e)                                \
     fi                                                                       \
  od;                                                                         \
  phase = 0; seen = 0

proctype producer(byte me; byte nitems) {
  byte pos, k, start, c, seen, w, i, rc, n;
  short dif;
  bit casok, phase, shut;
  do
  :: n < nitems ->
     WAIT_FOR(try_push(me * NIMAX + n), NF, FULL);
     if
     :: rc == OK -> n++; rc = 0
     :: else -> break                             /* UMR_CLOSED */
     fi
  :: else -> break
  od
}

proctype consumer(byte me; byte cid; byte npop) {
  byte pos, k, start, c, seen, w, i, j, rc, v, npopped, want, hd;
  short dif;
  bit casok, phase, shut;
  do
#if SHUT
  :: true ->                                      /* pop until UMR_CLOSED */
     want = WANT;
#else
  :: npopped < npop ->
     want = (WANT < npop - npopped -> WANT : npop - npopped);
#endif
     want = (want < CAP -> want : CAP);           /* claim() caps want at capacity */
     WAIT_FOR(try_pop(want), NE, EMPTY);
     if
     :: rc == OK -> rc = 0; want = 0
     :: else -> break                             /* UMR_CLOSED */
     fi
#if !SHUT
  :: else -> break
#endif
  od
}

/* umr_ring_shutdown(), at any moment */
proctype closer() {
  byte i;
  head = head | MARK;                             /* fetch_or(head, MARK, seq_cst) */
  notify_all(NE);
  notify_all(NF)
}

/* Runs only when no other statement can execute: the system is finished or stuck. */
proctype watchdog() {
  byte i;
  timeout ->
  /* (a) a lost wake-up: somebody sleeps although its attempt would now succeed */
  assert(!(nsleep[NE] > 0 && C_READY));
  assert(!(nsleep[NF] > 0 && P_READY));
  /* nobody is stuck at all (the only blocking statement of a thread is the futex sleep,
   * so "stuck" means "asleep"); spin's end-state check also requires every thread to
   * have run to its end */
  assert(nsleep[NE] == 0 && nsleep[NF] == 0);
  /* no loss: an entry is popped iff its push returned UMR_OK; without shutdown every
   * entry was pushed (with it: "no entry whose push succeeded is ever stranded") */
  i = 0;
  do
  :: i < NP * NIMAX ->
     assert(pushed[i] == got[i]);
#if !SHUT
     assert(pushed[i] == (i % NIMAX < (i / NIMAX == 0 -> NI : NI1)));
#endif
     i++
  :: else -> break
  od;
#if SHUT
  assert(head >= MARK && tail == HPOS)
#else
  assert(head == TOTAL && tail == TOTAL)
#endif
}

init {
  byte i;
  atomic {
    i = 0;
    do
    :: i < CAP -> cseq[i] = SEQ(i, 0); i++
    :: else -> break
    od;
    i = 0;
    do
    :: i < NP -> run producer(i, (i == 0 -> NI : NI1)); i++
    :: else -> break
    od;
    i = 0;
    do
    :: i < NC -> run consumer(NP + i, i, (i == 0 -> NPOP0 : TOTAL - NPOP0)); i++
    :: else -> break
    od;
#if SHUT
    run closer();
#endif
    run watchdog();
    i = 0
  }
}
