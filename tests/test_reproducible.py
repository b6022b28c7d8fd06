"""The stream of batches is a function of the seed and the batch's number alone, whatever the
workers do, and a sampler's position can be saved and loaded (state_dict)."""
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from unienv_data.samplers import StepSampler

import _data
from _data import indices_of, replay_buffer
from conftest import wait_until
from test_interrupts import interrupt_at, interrupted, line_of, positions, reference
from unienv_mp import MultiprocessingSampler, WorkerError
from unienv_mp._sampling.streams import base_seed, chunk_seed, stream_key

HERE = os.path.dirname(os.path.abspath(__file__))


def take(m, n, method="sample"):
    """The row indices of the next ``n`` batches of ``method`` (the rows' other values are
    random: a buffer made in another process holds other ones)."""
    fn = getattr(m, method)
    return [indices_of(fn()) for _ in range(n)]


# -- the seeds --------------------------------------------------------------------------

def test_chunk_seeds_of_a_stream_are_distinct_32_bit_numbers():
    # torch's CPU generator keeps only a seed's low 32 bits: seeds must differ there.
    for key in (0, 1234567, stream_key(base_seed(StepSampler(replay_buffer(10), 4, seed=0)),
                                       "sample"), 2**64 - 1):
        seeds = [chunk_seed(key, c) for c in range(200_000)]
        assert all(0 <= s < 2**32 for s in seeds)
        assert len(set(seeds)) == len(seeds)
        # a bijection of the chunk number modulo 2**32: chunk 2**32 + c is chunk c again
        assert chunk_seed(key, 2**32 + 7) == seeds[7]
    # neighbouring chunks' seeds differ in about half their bits
    key = stream_key(1, "sample")
    flips = [bin(chunk_seed(key, c) ^ chunk_seed(key, c + 1)).count("1") for c in range(4096)]
    assert 15 < sum(flips) / len(flips) < 17
    keys = {stream_key(base, m) for base in (0, 1, 2**64 - 1) for m in ("sample", "sample_flat")}
    assert len(keys) == 6


def test_chunks_far_apart_in_a_long_stream_draw_different_indices():
    # With 63-bit seeds cut to 32 bits by torch, chunks 93322 and 120606 of this stream
    # drew the same rows.
    rb = replay_buffer(1000)
    key = stream_key(base_seed(StepSampler(rb, 32, seed=0)), "sample")
    a, b = (StepSampler(rb, 32, seed=chunk_seed(key, c)) for c in (93322, 120606))
    assert not torch.equal(a.sample_index(), b.sample_index())


def test_the_base_seed_reads_the_rng_without_drawing_from_it():
    rb = replay_buffer(50)
    a, b, c = (StepSampler(rb, 4, seed=s) for s in (3, 3, 4))
    state = a.data_rng.get_state().clone()
    assert base_seed(a) == base_seed(b) != base_seed(c)
    assert torch.equal(a.data_rng.get_state(), state)
    c.manual_seed(3)
    assert base_seed(c) == base_seed(a)
    b.sample_index()
    assert base_seed(b) != base_seed(a)


# -- the same stream whatever the workers -------------------------------------------------

STREAM_CONFIGS = [dict(n_workers=2, n_buffers=3), dict(n_workers=4, n_buffers=8),
                  dict(n_workers=4, n_buffers=1, direct_gather=False),
                  dict(n_workers=2, n_buffers=8, direct_gather=False)]


def test_the_stream_is_the_same_for_any_workers_buffers_and_path():
    rb = replay_buffer(300)

    def stream(**kwargs):
        with MultiprocessingSampler(StepSampler(rb, 6, seed=11), ctx="fork", **kwargs) as m:
            return take(m, 100), take(m, 100, "sample_flat")

    reference = stream(n_workers=1)
    assert len({tuple(b) for b in reference[0]}) == 100   # (distinct batches)
    for config in STREAM_CONFIGS:
        assert stream(**config) == reference, config


def test_the_stream_is_the_same_under_every_start_method(ctx):
    rb = replay_buffer(120)
    got = []
    for c in ("fork", ctx):
        with MultiprocessingSampler(StepSampler(rb, 6, seed=2), n_workers=2, ctx=c) as m:
            got.append((take(m, 20), take(m, 20, "sample_flat")))
    assert got[0] == got[1]


def test_streams_of_different_methods_do_not_depend_on_their_interleaving():
    rb = replay_buffer(200)
    with MultiprocessingSampler(StepSampler(rb, 5, seed=1), n_workers=2, ctx="fork") as m:
        alone = take(m, 30)
    with MultiprocessingSampler(StepSampler(rb, 5, seed=1), n_workers=3, ctx="fork") as m:
        mixed = []
        for i in range(30):
            mixed += take(m, 1)
            if i % 3 == 0:
                m.sample_flat()
                m.sample_index()
    assert mixed == alone


def test_a_worker_sigkilled_mid_stream_changes_nothing():
    rb = replay_buffer(300)
    with MultiprocessingSampler(StepSampler(rb, 4, seed=5), n_workers=3, n_buffers=6,
                                ctx="fork", batches_per_task=2) as m:
        undisturbed = take(m, 60)
    with MultiprocessingSampler(StepSampler(rb, 4, seed=5), n_workers=3, n_buffers=6,
                                ctx="fork", batches_per_task=2) as m:
        got = take(m, 20)
        m._pools.sample.start_all()   # (a new pool starts one worker first)
        got += take(m, 10)
        killed = []
        for victim in (1, 0):   # with work in flight on it
            proc = m._pools.sample.workers[victim]
            killed.append(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            assert wait_until(lambda: not proc.is_alive())
            got += take(m, 15)
        assert not set(killed) & {p.pid for p in m._pools.sample.workers}   # replaced
    assert got == undisturbed


def test_in_order_false_hands_out_the_same_batches():
    """Out of order, the batches handed out are those of the chunks the position says were
    handed out (the first ``n`` of a partial one)."""
    rb = replay_buffer(200)
    k = 3
    reference = {}
    with MultiprocessingSampler(StepSampler(rb, 5, seed=8), n_workers=1, ctx="fork",
                                batches_per_task=k) as m:
        stream = take(m, 60)
        for c in range(20):
            reference[c] = stream[c * k:(c + 1) * k]
    with MultiprocessingSampler(_VariablyLate(rb, 5, seed=8), n_workers=3, ctx="fork",
                                batches_per_task=k, in_order=False) as m:
        got = take(m, 31)
        pos = m.state_dict()["streams"]["sample"]
    handed = [c for c in range(pos["low"])] + pos["done"]
    expected = [b for c in handed for b in reference[c]]
    for c, n in pos["partial"].items():
        expected += reference[c][:n]
    assert sorted(got) == sorted(expected)
    assert got != expected   # (they did come out of order)


class _VariablyLate(StepSampler):
    """Each batch takes 0 to 20 ms, by its first index."""

    def sample_index(self):
        import time
        idx = super().sample_index()
        time.sleep(int(idx[0]) % 5 * 0.005)
        return idx


# -- positions that survive interruptions --------------------------------------------------

class _SlowOnce(StepSampler):
    """Its 4th sample_index() takes 2 s (a worker that is late once)."""

    def __init__(self, data, batch_size, seed=None):
        super().__init__(data, batch_size, seed=seed)
        self.calls = 0

    def sample_index(self):
        self.calls += 1
        if self.calls == 4:
            import time
            time.sleep(2)
        return super().sample_index()


def test_a_timeout_does_not_move_the_position():
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 4, seed=3), n_workers=1, ctx="fork",
                                batches_per_task=1) as m:
        undisturbed = take(m, 8)
    with MultiprocessingSampler(_SlowOnce(rb, 4, seed=3), n_workers=1, n_buffers=1,
                                ctx="fork", batches_per_task=1, timeout=0.5,
                                direct_gather=False) as m:
        got = []
        while len(got) < 8:
            try:
                got += take(m, 1)
            except TimeoutError:
                pass
    assert got == undisturbed


class _FailsOnSmallRows(StepSampler):
    """Raises when a batch holds a row below 10 (a function of its indices alone)."""

    def sample_index(self):
        idx = super().sample_index()
        if int(idx.min()) < 10:
            raise KeyError(f"row {int(idx.min())}")
        return idx


def test_a_chunk_that_raises_is_skipped_and_the_stream_goes_on():
    rb = replay_buffer(60)
    k = 3
    base = base_seed(StepSampler(rb, 5, seed=4))
    expected = []
    key = stream_key(base, "sample")
    for c in range(12):
        chunk = [StepSampler(rb, 5, seed=chunk_seed(key, c * k + i)).sample_index().tolist()
                 for i in range(k)]
        if any(min(b) < 10 for b in chunk):
            expected.append("error")         # one error, the rest of the chunk skipped
        else:
            expected += chunk
    assert "error" in expected
    with MultiprocessingSampler(_FailsOnSmallRows(rb, 5, seed=4), n_workers=2, ctx="fork",
                                batches_per_task=k) as m:
        got = []
        while len(got) < len(expected):
            try:
                got += take(m, 1)
            except WorkerError:
                got.append("error")
    assert got == expected


# -- state_dict / load_state_dict -----------------------------------------------------------

_RESUME = textwrap.dedent("""
    import pickle, sys
    sys.path.insert(0, {here!r})
    from unienv_data.samplers import StepSampler
    from _data import indices_of, replay_buffer
    from test_reproducible import take
    from unienv_mp import MultiprocessingSampler

    with open({path!r}, "rb") as f:
        state = pickle.load(f)
    rb = replay_buffer(300)
    out = {{}}
    with MultiprocessingSampler(StepSampler(rb, 6, seed=999), n_workers=3, n_buffers=5,
                                ctx="fork", direct_gather=False) as m:
        m.load_state_dict(state)
        {body}
    with open({path!r} + ".out", "wb") as f:
        pickle.dump(out, f)
""")


def _in_another_process(tmp_path, state, body):
    path = str(tmp_path / "state.pkl")
    with open(path, "wb") as f:
        pickle.dump(state, f)
    script = _RESUME.format(here=HERE, path=path, body=body)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=HERE)
    with open(path + ".out", "rb") as f:
        return pickle.load(f)


def test_a_state_loaded_in_another_process_goes_on_with_the_same_batches(tmp_path):
    rb = replay_buffer(300)
    with MultiprocessingSampler(StepSampler(rb, 6, seed=21), n_workers=2, ctx="fork") as m:
        take(m, 37)
        take(m, 5, "sample_flat")
        state = m.state_dict()
        assert len(pickle.dumps(state)) < 20_000   # small: positions, seeds, RNG states
        expected = (take(m, 50), take(m, 50, "sample_flat"))
    got = _in_another_process(
        tmp_path, state,
        'out["sample"] = take(m, 50); out["sample_flat"] = take(m, 50, "sample_flat")')
    assert (got["sample"], got["sample_flat"]) == expected


def test_a_state_taken_mid_epoch_resumes_the_rest_of_that_epoch(tmp_path):
    rb = replay_buffer(300)   # 50 batches of 6
    with MultiprocessingSampler(StepSampler(rb, 6, seed=21), n_workers=2, ctx="fork") as m:
        take(m, 10)
        epoch = m.epoch_iter()
        first = [indices_of(next(epoch)) for _ in range(7)]
        state = m.state_dict()
        rest = [indices_of(b) for b in epoch]
        following = [indices_of(b) for b in m.epoch_iter()]
        after = take(m, 10)
    assert sorted(i for b in first + rest for i in b) == list(range(300))
    got = _in_another_process(
        tmp_path, state,
        'out["rest"] = [indices_of(b) for b in m.epoch_iter()]\n'
        '    out["following"] = [indices_of(b) for b in m.epoch_iter()]\n'
        '    out["after"] = take(m, 10)')
    assert got["rest"] == rest
    assert got["following"] == following
    assert got["after"] == after


def _epoch_sampler(seed=0):
    return MultiprocessingSampler(StepSampler(replay_buffer(100), 8, seed=seed), n_workers=2,
                                  ctx="fork")


def test_a_state_holds_every_epoch_being_iterated_in_the_order_they_started():
    """Epochs of both kinds open at once, and one opened and dropped meanwhile: the
    state holds each open one, and the next iterators of each kind resume them."""
    with _epoch_sampler() as m:
        a = m.epoch_iter()
        first_a = [indices_of(next(a)) for _ in range(3)]
        peek = m.epoch_iter()
        next(peek)
        del peek                          # (an iterator dropped: its epoch is over)
        b = m.epoch_iter()
        first_b = [indices_of(next(b)) for _ in range(5)]
        c = m.epoch_flat_iter()
        next(c)
        state = m.state_dict()
        assert [(e["getter"], e["low"]) for e in state["epochs"]] == [
            ("get_at", 3), ("get_at", 5), ("get_flattened_at", 1)]
        rest_a = [indices_of(x) for x in a]
        rest_b = [indices_of(x) for x in b]
        rest_c = len(list(c))
        following = [indices_of(x) for x in m.epoch_iter()]
    assert sorted(i for x in first_a + rest_a for i in x) == list(range(100))
    assert sorted(i for x in first_b + rest_b for i in x) == list(range(100))
    with _epoch_sampler(seed=5) as m:
        m.load_state_dict(pickle.loads(pickle.dumps(state)))
        assert [indices_of(x) for x in m.epoch_iter()] == rest_a
        assert len(list(m.epoch_flat_iter())) == rest_c == 12
        assert [indices_of(x) for x in m.epoch_iter()] == rest_b
        assert [indices_of(x) for x in m.epoch_iter()] == following


def test_a_load_that_fails_leaves_the_sampler_as_it_was():
    with _epoch_sampler(seed=1) as source:
        take(source, 3)
        state = source.state_dict()
    with _epoch_sampler(seed=0) as m:
        expected = take(m, 6)
    with _epoch_sampler(seed=0) as m:
        take(m, 2)
        for broken in ({**state, "rngs": None}, {**state, "rngs": {"rng": "not a generator"}},
                       {**state, "base_seed": "x"}, {**state, "streams": None}):
            with pytest.raises(ValueError, match="not a whole state_dict"):
                m.load_state_dict(broken)
        assert take(m, 4) == expected[2:]


def _broken_state(state, kind):
    import copy
    s = copy.deepcopy(state)
    stream = s["streams"]["sample"]
    if kind == "no configuration":
        del s["configuration"]
    elif kind == "configuration None":
        s["configuration"] = None
    elif kind == "chunks a list":
        s["configuration"]["chunks"] = []
    elif kind == "base seed inf":
        s["base_seed"] = float("inf")
    elif kind == "base seed 2.5":
        s["base_seed"] = 2.5
    elif kind == "base seed negative":
        s["base_seed"] = -1
    elif kind == "data_rng garbage":
        s["rngs"]["data_rng"]["state"] = torch.zeros(3, dtype=torch.uint8)
    elif kind == "data_rng None":
        s["rngs"]["data_rng"] = None
    elif kind.startswith("k "):
        stream["k"] = {"k 0": 0, "k -1": -1, "k nan": float("nan"), "k 3": 3,
                       "k True": True}[kind]
    elif kind == "low negative":
        stream["low"] = -5
    elif kind == "low huge":
        stream["low"] = 10 ** 30
    elif kind == "partial past k":
        stream["partial"] = {stream["low"]: 999}
    elif kind == "partial negative":
        stream["partial"] = {stream["low"]: -3}
    elif kind == "done far ahead":
        stream["done"] = [10 ** 7]
    elif kind == "unknown stream":
        s["streams"]["bogus"] = dict(stream)
    elif kind == "getter a list":
        s["epochs"][0]["getter"] = []
    elif kind == "order a numpy array":
        s["epochs"][0]["order"] = s["epochs"][0]["order"].numpy()
    elif kind == "order of uint8":
        s["epochs"][0]["order"] = s["epochs"][0]["order"].to(torch.uint8)
    else:
        raise AssertionError(kind)
    return s


@pytest.mark.parametrize("kind", [
    "no configuration", "configuration None", "chunks a list", "base seed inf",
    "base seed 2.5", "base seed negative", "data_rng garbage", "data_rng None", "k 0",
    "k -1", "k nan", "k 3", "k True", "low negative", "low huge", "partial past k",
    "partial negative", "done far ahead", "unknown stream", "getter a list",
    "order a numpy array", "order of uint8"])
def test_a_broken_state_is_a_value_error_and_changes_nothing(kind):
    """Whatever is wrong in a state, and wherever: ValueError, and the sampler goes on
    as if the load had never been tried."""
    with _epoch_sampler(seed=1) as source:
        take(source, 3)
        it = source.epoch_iter()
        next(it)
        state = source.state_dict()
        it.close()
    with _epoch_sampler(seed=0) as m:
        expected = take(m, 6)
    with _epoch_sampler(seed=0) as m:
        take(m, 2)
        with pytest.raises(ValueError):
            m.load_state_dict(_broken_state(state, kind))
        assert take(m, 4) == expected[2:]
        assert m.state_dict()["epochs"] == []


def _mangled(epoch, kind):
    e = dict(epoch)
    order = e["order"]
    if kind == "order repeats a row":
        e["order"] = torch.zeros_like(order)
    elif kind == "order out of range":
        e["order"] = order + 1
    elif kind == "order of floats":
        e["order"] = order.double()
    elif kind == "order as a list":
        e["order"] = order.tolist()
    elif kind == "order too short":
        e["order"] = order[:-1]
    elif kind == "low below zero":
        e["low"] = -3
    elif kind == "low as text":
        e["low"] = "3"
    elif kind == "low past the end":
        e["low"] = 14
    elif kind == "done past the end":
        e["done"] = [20]
    elif kind == "another batch size":
        e["batch_size"] = 4
    elif kind == "another getter":
        e["getter"] = "get_nothing_at"
    return e


@pytest.mark.parametrize("kind", [
    "order repeats a row", "order out of range", "order of floats", "order as a list",
    "order too short", "low below zero", "low as text", "low past the end",
    "done past the end", "another batch size", "another getter"])
def test_a_state_with_an_epoch_this_sampler_cannot_be_in_is_refused(kind):
    with _epoch_sampler() as m:
        it = m.epoch_iter()
        next(it)
        state = m.state_dict()
        it.close()
    state["epochs"] = [_mangled(state["epochs"][0], kind)]
    with _epoch_sampler() as m:
        with pytest.raises(ValueError, match="the state's epoch"):
            m.load_state_dict(state)
        assert sorted(i for x in m.epoch_iter() for i in indices_of(x)) == list(range(100))
        assert m.state_dict()["epochs"] == []


def test_a_state_keeps_every_stream_position_across_manual_seed_and_partial_chunks():
    rb = replay_buffer(200)
    with MultiprocessingSampler(StepSampler(rb, 5, seed=1), n_workers=2, ctx="fork") as m:
        m.manual_seed(77)
        take(m, 13)                      # a partial chunk (8 to a task by default)
        state = m.state_dict()
        expected = take(m, 20)
    assert state["streams"]["sample"]["partial"] == {1: 5}
    with MultiprocessingSampler(StepSampler(rb, 5, seed=3), n_workers=4, ctx="fork",
                                n_buffers=2) as m:
        take(m, 4)                       # requested ahead and handed out: both replaced
        m.load_state_dict(state)
        assert take(m, 20) == expected


def test_a_state_of_another_configuration_is_refused():
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 5, seed=1), n_workers=1, ctx="fork") as m:
        take(m, 3)
        state = m.state_dict()

    def refused(sampler, match, **kwargs):
        with MultiprocessingSampler(sampler, n_workers=1, ctx="fork", **kwargs) as other:
            with pytest.raises(ValueError, match=match):
                other.load_state_dict(state)

    refused(StepSampler(rb, 6, seed=1), "batch_size is 5 in the state, 6 here")
    refused(StepSampler(replay_buffer(90), 5, seed=1), "data_length is 100 in the state, 90")
    refused(StepSampler(replay_buffer(100, img=(1, 2, 2)), 5, seed=1), "structure")
    refused(StepSampler(rb, 5, seed=1), "8 batches per task in the state, 2 here",
            batches_per_task=2)
    refused(_data.SlowSampler(rb, 5, seed=1), "sampler is")
    with MultiprocessingSampler(StepSampler(rb, 5), n_workers=1, ctx="fork") as other:
        with pytest.raises(ValueError, match="not a state_dict") as refusal:
            other.load_state_dict({"streams": {}})
        # (a plain ValueError, as the docs say: no private class in the traceback)
        assert type(refusal.value) is ValueError
        with pytest.raises(ValueError, match="version"):
            other.load_state_dict({**state, "version": 99})
        other.load_state_dict(state)     # and the matching one loads


# -- state_dict and load_state_dict: states taken at awkward moments --------------------

def test_a_state_taken_after_close_keeps_the_position():
    """A checkpoint written after the training loop's ``with`` block: the state must say
    where the streams were (or state_dict must refuse, as sampling calls do after
    close()), not silently restart them."""
    expected = reference(20)
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2, ctx="fork") as m:
        take(m, 10)
    try:
        state = m.state_dict()
    except RuntimeError:
        return                                  # refusing is fine too
    with MultiprocessingSampler(StepSampler(rb, 8, seed=0), n_workers=2, ctx="fork") as m:
        m.load_state_dict(state)
        got = take(m, 10)
    where = positions(got, expected)
    assert where == list(range(10, 20)), f"stream positions handed out: {where}"


def test_a_state_taken_after_an_epoch_failed_to_start_continues_as_the_sampler_does():
    """A Ctrl-C while an epoch over unshared data starts its workers (hundreds of ms):
    the epoch generator is over, and the sampler's next epoch_iter() draws a new
    permutation.  A state taken then must continue the same way, not resume the dead
    epoch (it stayed open: the failure came before the ``try``)."""
    rb = replay_buffer(60)
    with MultiprocessingSampler(StepSampler(rb, 6, seed=3), n_workers=2, ctx="fork") as m:
        from unienv_mp._sampling.pools import Pools
        starting = Pools.epoch_manager
        with interrupt_at(starting, line_of(starting, "manager, copy = self._new(new_manager)")) as i:
            assert interrupted(next, m.epoch_iter())
        assert i.fired
        state = m.state_dict()
        following = [indices_of(b) for b in m.epoch_iter()]
    with MultiprocessingSampler(StepSampler(rb, 6, seed=9), n_workers=2, ctx="fork") as m:
        m.load_state_dict(state)
        resumed = [indices_of(b) for b in m.epoch_iter()]
    assert resumed == following, f"the state holds {len(state['epochs'])} epoch in progress"


def test_a_state_of_another_batches_per_task_is_refused_for_streams_not_started_yet():
    """batches_per_task is part of the configuration a state fits, but only the streams
    the state has positions for are compared: a stream started after loading follows
    this sampler's k, and its batches differ from the original's."""
    rb = replay_buffer(100, img=(3, 128, 128))   # sample(): 4 batches to a task, flat: 1
    with MultiprocessingSampler(StepSampler(rb, 5, seed=1), n_workers=1, ctx="fork") as m:
        assert m.chunk_size("sample") == 4 and m.chunk_size("sample_flat") == 1
        take(m, 3)
        state = m.state_dict()
        flat = [indices_of(m.sample_flat(), img=(3, 128, 128)) for _ in range(4)]
    with MultiprocessingSampler(StepSampler(rb, 5, seed=1), n_workers=1, ctx="fork",
                                batches_per_task=4) as m:
        try:
            m.load_state_dict(state)
        except ValueError as e:
            assert "sample_flat() makes 1 batches per task in the state, 4 here" in str(e)
            return
        got = [indices_of(m.sample_flat(), img=(3, 128, 128)) for _ in range(4)]
    assert got == flat, "loaded without a word, and sample_flat() gives other batches"


@pytest.mark.parametrize("state", [None, "state.pt", [("format", 1)]])
def test_a_state_that_is_not_a_dict_is_refused_with_value_error(state):
    """_state.check says what is wrong with a non-dict; load_state_dict must get there."""
    rb = replay_buffer(100)
    with MultiprocessingSampler(StepSampler(rb, 5, seed=1), n_workers=1, ctx="fork") as m:
        with pytest.raises(ValueError, match="not a state_dict"):
            m.load_state_dict(state)


class SeedRefused(StepSampler):
    def manual_seed(self, seed):
        raise ValueError("this sampler cannot be seeded")


def test_a_sampler_whose_seeding_raises_gives_worker_errors_and_goes_on():
    """The worker seeds the wrapped sampler for each chunk: a manual_seed that raises is
    that chunk's error, as any error of the wrapped sampler."""
    rb = replay_buffer(100)
    with MultiprocessingSampler(SeedRefused(rb, 4, seed=0), n_workers=1, ctx="fork") as m:
        for _ in range(2):
            with pytest.raises(WorkerError) as info:
                m.sample()
            assert info.value.exc_type == "builtins.ValueError"
            assert "this sampler cannot be seeded" in info.value.exc_message


def test_a_state_saved_by_an_older_layout_of_the_package_loads_and_goes_on_the_same():
    """tests/fixtures/saved_state.pkl was written by unienv_mp 0.1, whose modules sat at the
    package's root (its torch.Generator pickled as ``unienv_mp._state._TorchGenerator``),
    with the batches that followed it then."""
    path = os.path.join(os.path.dirname(__file__), "fixtures", "saved_state.pkl")
    with open(path, "rb") as f:
        saved = pickle.load(f)
    assert "unienv_mp._state" in open(path, "rb").read().decode("latin-1")
    with MultiprocessingSampler(StepSampler(replay_buffer(300), 6, seed=21), n_workers=2,
                                ctx="fork") as m:
        m.load_state_dict(saved["state"])
        assert [indices_of(b) for b in m.epoch_iter()] == saved["rest"]
        assert [indices_of(m.sample()) for _ in range(10)] == saved["sample"]
        assert [indices_of(m.sample_flat()) for _ in range(3)] == saved["sample_flat"]
        # and a state saved now names no class of the package
        again = pickle.dumps(m.state_dict())
    assert b"unienv_mp._" not in again
