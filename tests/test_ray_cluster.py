"""RaySampler on a simulated cluster of three nodes (ray.cluster_utils.Cluster): the
training process on the head node, the actors on the two others, so that every batch is
made in another node's object store and crosses to the head's; one of those nodes lost
mid-stream."""
import os

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' "
                                        "(CI installs it)")
from ray.cluster_utils import Cluster  # noqa: E402

from _data import indices_of, mapping_of, replay_buffer  # noqa: E402
from unienv_data.samplers import StepSampler  # noqa: E402

from unienv_mp import MultiprocessingSampler  # noqa: E402
from unienv_mp.ray import RaySampler  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
#: actors ask for this resource, which only the two worker nodes have
FAR = {"resources": {"far": 1}}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes = [c.add_node(num_cpus=2, resources={"far": 2}) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": TESTS}})
    c.wait_for_nodes()
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def where(sampler):
    return [ray.get(a.where.remote())[0] for a in sampler.workers]


def factory():
    import _data as d
    import torch
    from unienv_data.samplers import StepSampler as S
    torch.manual_seed(0)   # (the same rows as the test's buffer)
    return S(d.replay_buffer(90), 6, seed=8)


def test_batches_made_on_other_nodes_are_the_multiprocessing_samplers(cluster):
    torch.manual_seed(0)
    rb = replay_buffer(90)
    head = ray.get_runtime_context().get_node_id()
    with MultiprocessingSampler(StepSampler(rb, 6, seed=8), n_workers=2, ctx="fork") as m:
        want = [m.sample() for _ in range(20)]
        want_epoch = [indices_of(b) for b in m.epoch_iter()]
    for kwargs in (dict(sampler=StepSampler(rb, 6, seed=8)), dict(sampler_factory=factory)):
        with RaySampler(n_workers=2, actor_options=FAR, **kwargs) as r:
            assert head not in where(r)
            for a, b in zip(want, (r.sample() for _ in range(20))):
                assert list(a) == list(b)
                for k in a:
                    assert b[k].dtype == a[k].dtype and torch.equal(a[k], b[k])
            # (from another node: a read-only view of this node's object store)
            assert "plasma" in mapping_of(r.sample()["state"].data_ptr())
            epoch = [indices_of(b) for b in r.epoch_iter()]
            assert epoch == want_epoch
            assert r.stats().machine_idle_fraction is None   # (other nodes: not measured)
            assert sorted(i for b in epoch for i in b) == list(range(90))


def test_a_node_lost_mid_stream_changes_nothing(cluster):
    c, nodes = cluster
    rb = replay_buffer(90)
    with RaySampler(StepSampler(rb, 6, seed=3), n_workers=2, batches_per_task=1,
                    actor_options=FAR) as r:
        want = [indices_of(r.sample()) for _ in range(300)]
    with RaySampler(StepSampler(rb, 6, seed=3), n_workers=2, batches_per_task=1,
                    actor_options=FAR) as r:
        got = [indices_of(r.sample()) for _ in range(10)]
        lost = next(n for n in nodes if n.node_id == where(r)[0])
        c.remove_node(lost)
        # (more than the batches requested ahead, 64 by default: the lost node's actor
        # is asked for some of them)
        got += [indices_of(r.sample()) for _ in range(290)]
        assert lost.node_id not in where(r)
        assert r.stats().workers[0].respawns >= 1
    assert got == want
