"""A griffe extension for the API reference: a class attribute that is a function at run
time is shown as the method it is, and one that is a descriptor as a property; a method
that overrides a documented one without a docstring of its own shows the one it overrides.

The sampler makes some of its methods with a small factory (``sample =
_sampling("sample", doc)``) and its forwarding properties with a descriptor class
(``device = forwarded(doc)``), which a reader of the source sees as assignments. This
extension imports the class and puts, in place of such an attribute, a method with the
function's docstring and signature, or a property with the descriptor's docstring.
"""
import inspect

import griffe


class MethodsMadeByFactories(griffe.Extension):
    def on_class_members(self, *, cls, **kwargs):
        try:
            runtime = griffe.dynamic_import(cls.path)
        except ImportError:
            # (a class that cannot be imported here: RaySampler without Ray, which the docs
            # extra does not install; its overrides take the docstrings of the methods
            # they override, read from the source)
            _inherit_docstrings(cls)
            return
        for name, member in list(cls.members.items()):
            if member.is_alias or name.startswith("_"):
                continue
            if member.is_function and not member.docstring:
                doc = inspect.getdoc(getattr(runtime, name, None))
                if doc:
                    member.docstring = griffe.Docstring(doc, parent=member)
                continue
            if not member.is_attribute:
                continue
            value = inspect.getattr_static(runtime, name, None)
            if _is_descriptor(value):
                member.labels |= {"property"}
                member.value = None
                member.docstring = griffe.Docstring(inspect.cleandoc(value.__doc__),
                                                    parent=member)
                continue
            if not inspect.isfunction(value):
                continue
            parameters = griffe.Parameters(*(
                griffe.Parameter(p.name, kind=griffe.ParameterKind[p.kind.name.lower()],
                                 default=None if p.default is p.empty else repr(p.default))
                for p in inspect.signature(value).parameters.values()))
            method = griffe.Function(name, lineno=member.lineno, endlineno=member.endlineno,
                                     parameters=parameters)
            if value.__doc__:
                method.docstring = griffe.Docstring(inspect.cleandoc(value.__doc__),
                                                    parent=method)
            cls.set_member(name, method)


def _is_descriptor(value):
    """A property-like object of the package with a docstring of its own."""
    return (hasattr(type(value), "__get__") and not inspect.isfunction(value)
            and not isinstance(value, (property, staticmethod, classmethod))
            and type(value).__module__.startswith("unienv_mp")
            and bool(type(value).__doc__ != value.__doc__ and value.__doc__))


def _inherit_docstrings(cls):
    """Give each method of ``cls`` without a docstring that of the method it overrides in
    one of its bases, as read from the source."""
    try:
        bases = cls.mro()
    except Exception:   # (a base that cannot be resolved)
        return
    for name, member in list(cls.members.items()):
        if member.is_alias or name.startswith("_") or not member.is_function \
                or member.docstring:
            continue
        for base in bases:
            inherited = base.members.get(name)
            if inherited is not None and not inherited.is_alias and inherited.docstring:
                member.docstring = griffe.Docstring(inherited.docstring.value, parent=member)
                break
