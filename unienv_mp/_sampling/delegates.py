"""What a sampler whose batches are made by workers takes from the sampler it wraps, in the
training process: its spaces, backend, device, data and random number generators, and its
``get*_at`` methods, called here (epochs call them in the workers).

:class:`Delegates` is a base class of :class:`unienv_mp._sampling.sampler.SamplerBase`; the wrapped
sampler is its ``sampler`` attribute.
"""

__all__ = ["Delegates"]


class Delegates:
    """The wrapped sampler's properties and ``get*_at`` methods, as its own."""

    @property
    def sampled_space(self):
        """The wrapped sampler's batch space."""
        return self.sampler.sampled_space

    @property
    def sampled_metadata_space(self):
        """The wrapped sampler's batch metadata space (or None)."""
        return self.sampler.sampled_metadata_space

    @property
    def backend(self):
        """The wrapped sampler's compute backend."""
        return self.sampler.backend

    @property
    def device(self):
        """The wrapped sampler's device (always the CPU here)."""
        return self.sampler.device

    @property
    def data(self):
        """The wrapped sampler's data (e.g. the ReplayBuffer)."""
        return self.sampler.data

    @property
    def rng(self):
        """The wrapped sampler's RNG in this process.  The ``sample*`` streams' seed is
        read from its state when this sampler is made and by :meth:`manual_seed`; setting
        it does not change the streams."""
        return self.sampler.rng

    @rng.setter
    def rng(self, rng):
        self.sampler.rng = rng

    @property
    def data_rng(self):
        """The wrapped sampler's data RNG in this process: epoch permutations are drawn
        from it.  The ``sample*`` streams' seed is read from its state when this sampler
        is made and by :meth:`manual_seed`; setting it does not change the streams."""
        return self.sampler.data_rng

    @data_rng.setter
    def data_rng(self, data_rng):
        self.sampler.data_rng = data_rng

    def get_at(self, idx):
        """``get_at`` of the wrapped sampler, in this process."""
        return self.sampler.get_at(idx)

    def get_at_with_metadata(self, idx):
        """``get_at_with_metadata`` of the wrapped sampler, in this process."""
        return self.sampler.get_at_with_metadata(idx)

    def get_flattened_at(self, idx):
        """``get_flattened_at`` of the wrapped sampler, in this process."""
        return self.sampler.get_flattened_at(idx)

    def get_flattened_at_with_metadata(self, idx):
        """``get_flattened_at_with_metadata`` of the wrapped sampler, in this process."""
        return self.sampler.get_flattened_at_with_metadata(idx)
