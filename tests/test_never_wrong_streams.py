"""Never silently wrong: the stream of a seed depends on the seed, not on a
default the user never chose.  ``batches_per_task`` does not change which batches come,
so two samplers over two views of one buffer (frame stacks and action chunks, as the
docs pair them), seeded alike, draw the same steps; a state saved by unienv_mp 0.1 still
resumes exactly."""
import os
import pickle

import torch
from unienv_data.batches.framestack_batch import FrameStackedBatch
from unienv_data.batches.slicestack_batch import SliceStackedBatch
from unienv_data.samplers import StepSampler

import _data
import _step_rows as sr
from unienv_mp import MultiprocessingSampler

CHUNKS = (None, 1, 3, 8)   # (None: the default)


def _streams(rb, method, n, batch=8, seed=3):
    """The first ``n`` batches of ``method``'s stream for each ``batches_per_task`` of
    CHUNKS, over ``rb``, seeded alike."""
    out = {}
    for k in CHUNKS:
        with MultiprocessingSampler(StepSampler(rb, batch, seed=seed), n_workers=2,
                                    ctx="fork", batches_per_task=k) as m:
            out[k] = [sr.clone(getattr(m, method)()) for _ in range(n)]
    return out


def test_sample_index_does_not_depend_on_batches_per_task():
    streams = _streams(sr.buffer(500), "sample_index", 24)
    default = streams[None]
    for k in CHUNKS[1:]:
        differ = [j for j, (a, b) in enumerate(zip(default, streams[k]))
                  if not torch.equal(a, b)]
        assert not differ, (f"sample_index() batches {differ} of 24 differ between the "
                            f"default and batches_per_task={k}")


def test_sample_does_not_depend_on_batches_per_task():
    streams = _streams(sr.buffer(500), "sample", 24)
    default = [sr.steps_of(b) for b in streams[None]]
    for k in CHUNKS[1:]:
        steps = [sr.steps_of(b) for b in streams[k]]
        differ = [j for j, (a, b) in enumerate(zip(default, steps)) if a != b]
        assert not differ, (f"sample() batches {differ} of 24 draw other steps with "
                            f"batches_per_task={k} than with the default")


def test_frame_stacks_and_action_chunks_paired_by_seed_draw_the_same_steps():
    """As the docs and the diffusion-policy example pair them: observations (frame stacks
    with images, large rows) from one sampler, action chunks (small rows) from another,
    over one buffer, with the same seed, batch size and default options."""
    rb = sr.buffer(400, img=(3, 64, 64))
    mask = SliceStackedBatch.get_valid_mask_function_with_episodeid_key("episode")
    frames = FrameStackedBatch(rb, 1, get_valid_mask_function=mask)   # steps t-1, t
    chunks = SliceStackedBatch(rb, torch.arange(16),
                               get_valid_mask_function=mask).get_column(["action"])
    with MultiprocessingSampler(StepSampler(frames, 32, seed=7), n_workers=2) as obs, \
            MultiprocessingSampler(StepSampler(chunks, 32, seed=7), n_workers=2) as act:
        apart = 0
        for _ in range(20):
            o, a = obs.sample(), act.sample()
            steps = o["step"][:, -1]                    # (the frame of offset 0)
            first = (-a[:, 0, 0] - 0.5).to(torch.int64)  # (the action of offset 0)
            apart += int((steps != first).sum())
        assert apart == 0, (f"{apart} of {20 * 32} observation / action rows are from "
                            f"different steps")


def test_a_state_saved_by_unienv_mp_0_1_still_resumes_exactly():
    """The chunk sizes a saved state recorded are those it resumes with, whatever the
    defaults are now."""
    path = os.path.join(os.path.dirname(__file__), "fixtures", "saved_state.pkl")
    with open(path, "rb") as f:
        saved = pickle.load(f)
    with MultiprocessingSampler(StepSampler(_data.replay_buffer(300), 6, seed=21),
                                n_workers=2, ctx="fork") as m:
        m.load_state_dict(saved["state"])
        assert [_data.indices_of(b) for b in m.epoch_iter()] == saved["rest"]
        assert [_data.indices_of(m.sample()) for _ in range(10)] == saved["sample"]
        assert [_data.indices_of(m.sample_flat()) for _ in range(3)] == saved["sample_flat"]
