"""Attributes a sampler passes on to one of its parts, declared in one line each:
`forwarded` (a property that reads, and may set, an attribute of a part, e.g. the wrapped
sampler's spaces, backend, device, data and random number generators) and `passed_on` (a
method that calls the wrapped sampler's, e.g. ``get_at``)."""

__all__ = ["forwarded", "passed_on"]


class forwarded:
    """A property whose value is the attribute ``name`` of the owner's attribute
    ``part``: ``backend = forwarded("sampler", "backend", "The compute backend.")`` reads
    ``self.sampler.backend``; ``settable=True`` sets it too."""

    def __init__(self, part, name, doc=None, settable=False):
        self.part = part
        self.name = name
        self.settable = settable
        self.__doc__ = doc

    def __set_name__(self, owner, attr):
        self.attr = attr

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj, value):
        if not self.settable:
            raise AttributeError(f"property {self.attr!r} of {type(obj).__name__!r} "
                                 f"object has no setter")
        setattr(getattr(obj, self.part), self.name, value)


def passed_on(name, doc):
    """A method ``name(self, idx)`` that returns ``self.sampler.<name>(idx)``."""
    def method(self, idx):
        return getattr(self.sampler, name)(idx)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = doc
    return method
