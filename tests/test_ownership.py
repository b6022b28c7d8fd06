"""Objects own their state: no module of the package reads or writes a private attribute
(``x._name``, not a dunder) of an object other than ``self``, ``cls`` or ``super()`` (or,
by its class's name, a private function of a class defined in the same module).  A part that needs its
owner's state is handed it (a value, a callable), or calls a public method.

The exceptions are the boundaries with code that is not ours, listed in ``ALLOWED`` with
their reason: the standard library, torch, and UniEnv's private names that the direct
gather must read (all of them in ``unienv_mp/_direct/unienv.py`` and ``windows.py``)."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "unienv_mp"

# (module, expression) -> why it must stay
ALLOWED = {
    # The standard library.
    ("_os.py", "os._exit"): "ends a forked child without running the parent's exit code",
    ("_process/worker.py", "os._exit"): "ends a worker without running the parent's exit code",
    ("_process/snapshot.py", "os._exit"): "ends a forked child without the parent's exit code",
    ("_os.py", "_mp_process._children"):
        "multiprocessing's list of children, the only place a Process it started is known",
    ("_process/snapshot.py", "forkserver._forkserver"):
        "multiprocessing's fork server: its inherited descriptors, as its own children get",
    ("_process/snapshot.py", "forkserver._forkserver._inherited_fds"):
        "multiprocessing's fork server: its inherited descriptors, as its own children get",
    ("_process/snapshot.py", "process.current_process()._inheriting"):
        "set while a Process bootstraps in a child, as multiprocessing's own popen does",
    ("_process/snapshot.py", "proc._bootstrap"):
        "runs a Process in a forked child, as multiprocessing's popen_fork does",
    ("_process/transfer.py", "ForkingPickler._extra_reducers"):
        "multiprocessing's reducers (shared tensors'), which the transfer pickler extends",
    ("_transport/shm_queue.py", "_mputil._exiting"):
        "whether the interpreter is exiting, as multiprocessing.Queue's feeder asks",
    # torch.
    ("_device/keep.py", "torch._C"): "torch's host allocator hooks live only in torch._C",
    ("_device/keep.py", "s._cdata"): "the storage's allocation, torch's key for a kept block",
    ("_sampling/fingerprint.py", "t._version"):
        "torch's write counter of a tensor: how a write through torch is seen",
    ("_sampling/fingerprint.py", "obj._version"):
        "torch's write counter of a tensor: how a write through torch is seen",
    # UniEnv: the private names its data structures hold the layout in.
    ("_direct/unienv.py", "rb._logical_to_physical_index"): "UniEnv's ring index map",
    ("_direct/unienv.py", "obj._batched_space"): "UniEnv's batched space of a storage",
    ("_direct/unienv.py", "storage._batched_instance_space"): "UniEnv's batched space",
    ("_direct/unienv.py", "view._idx_zero"): "UniEnv's first index of a view",
    ("_direct/unienv.py", "SliceStackedBatch._valid_mask_function_episodeid_key"):
        "UniEnv's default mask functions, told apart from a user's",
    ("_direct/unienv.py", "SliceStackedBatch._valid_mask_function_episode_end_key"):
        "UniEnv's default mask functions, told apart from a user's",
    ("windows.py", "SliceStackedBatch._valid_mask_function_episodeid_key"):
        "UniEnv's default mask functions, which a WindowedBatch's mask takes as UniEnv does",
    ("windows.py", "SliceStackedBatch._valid_mask_function_episode_end_key"):
        "UniEnv's default mask functions, which a WindowedBatch's mask takes as UniEnv does",
    ("_direct/unienv.py", "storage._get_leaves"):
        "UniEnv's HDF5 storage's leaf datasets, opened as its own reads open them",
    ("_direct/unienv.py", "storage._filename"): "the file an HDF5 storage reads",
    ("_direct/unienv.py", "storage._cache_path"):
        "the folder an image or npz storage keeps one file per row in",
    ("_direct/unienv.py", "storage._read_only"):
        "whether a parquet storage's pieces are all on disk (a writable one holds some)",
    ("_direct/unienv.py", "storage._piece_path"): "the files a parquet storage reads",
    ("_direct/unienv.py", "storage._num_pieces"): "the files a parquet storage reads",
    ("_direct/unienv.py", "storage._storage_dir"): "the folder of a parquet storage",
    ("_direct/unienv.py", "storage._index_to_piece_mapping"):
        "which piece of a parquet storage holds each row, as its own get maps them",
    ("_direct/unienv.py", "storage._load_piece_table"):
        "the Arrow table of a parquet piece, from the cache its own get reads",
    ("_direct/unienv.py", "storage._read_only_piece_column_values"):
        "a parquet piece's column as its own get reads it (the exact fallback)",
    ("_sampling/fingerprint.py", "rbm._LocalRingState"):
        "UniEnv's in-memory ring state class, whose counters say the data changed",
}


def _private(attr):
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def foreign_private(source):
    """``(line, expression)`` of every private attribute of an object other than
    ``self``/``cls`` (or a class of the same module, by its name) in ``source``."""
    tree = ast.parse(source)
    own_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ({"self", "cls"} | own_classes):
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
                and value.func.id == "super":
            continue   # (the object's own, as its base class defines it)
        out.append((node.lineno, ast.unparse(node)))
    return out


def violations():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        for line, expr in foreign_private(path.read_text()):
            if (module, expr) not in ALLOWED:
                found.append(f"{module}:{line}: {expr}")
    return found


def test_no_module_reaches_a_private_attribute_of_another_object():
    assert violations() == []


def test_every_allowed_exception_is_still_needed():
    used = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        used |= {(module, expr) for _, expr in foreign_private(path.read_text())}
    assert sorted(set(ALLOWED) - used) == []


@pytest.mark.parametrize("source, found", [
    ("def f(s):\n    return s._lock\n", [(2, "s._lock")]),
    ("def f(s):\n    s._lock = 1\n", [(2, "s._lock")]),
    ("class A:\n    def f(self):\n        return self.owner._make()\n",
     [(3, "self.owner._make")]),
    ("class A:\n    def f(self):\n        return self._x, self.__dict__, cls._y\n", []),
    ("class A:\n    def f(self):\n        return A._g\n", []),
    ("class A(B):\n    def f(self):\n        return super()._g()\n", []),
    ("import os\nos._exit(0)\n", [(2, "os._exit")]),
])
def test_the_rule_finds_what_it_should(source, found):
    assert foreign_private(source) == found


# A subclass in the package uses what its base class (in another module) offers publicly:
# the hooks of SamplerBase, not its private attributes.
SUBCLASSES = {"ray/sampler.py": "_sampling/sampler.py"}


def _privates_on_self(tree):
    """``(read, written)``: the private attributes read and written on ``self`` in
    ``tree``, and the private methods it defines (as written)."""
    read, written = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
            written.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self" and _private(node.attr):
            (written if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return read, written


def base_privates_reached(sub_source, base_source):
    """The private attributes of ``base_source``'s classes (those they set on ``self`` or
    define) that ``sub_source``'s classes read or write on ``self``."""
    base_read, base_written = _privates_on_self(ast.parse(base_source))
    sub_read, sub_written = _privates_on_self(ast.parse(sub_source))
    return sorted((sub_read | sub_written) & base_written)


def test_a_subclass_uses_only_the_public_hooks_of_its_base():
    for sub, base in SUBCLASSES.items():
        reached = base_privates_reached((PACKAGE / sub).read_text(),
                                        (PACKAGE / base).read_text())
        assert reached == [], f"{sub} reaches private attributes of {base}: {reached}"


def test_the_subclass_rule_finds_what_it_should():
    base = "class B:\n    def __init__(self):\n        self._lock = 1\n    def _hook(self):\n        pass\n"
    assert base_privates_reached("class S(B):\n    def f(self):\n        return self._lock\n",
                                 base) == ["_lock"]
    assert base_privates_reached("class S(B):\n    def f(self):\n        self._hook()\n",
                                 base) == ["_hook"]
    assert base_privates_reached("class S(B):\n    def f(self):\n        self._lock = 2\n",
                                 base) == ["_lock"]
    assert base_privates_reached("class S(B):\n    def f(self):\n        self._own = 2\n"
                                 "        return self._own\n", base) == []
