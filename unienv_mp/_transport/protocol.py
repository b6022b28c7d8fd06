"""The wire format of both transports: what goes into their shared segments and ring entries.

Both transports speak in *tagged entries* (`RingBuffer.push_tagged`): a header of
``ENTRY_HEADER`` bytes (``tag`` u32, ``aux`` u32, ``value`` u64), then a payload.  The tag
says where the bytes of the message are and what kind of message it is::

    tag = where | kind << 8          (see tag() and untag())

    where   AT_INLINE   the payload is the message
            AT_SLOT     the message is in a slot (the payload, if any, describes it)
            AT_SPILL    the message is in a one-off segment the payload describes

    kind    queue entries:   ENC_BYTES, ENC_PICKLE, ENC_CODEC   (how it is encoded)
            task entries:    ENC_PICKLE, ENC_CODEC (how the work info is encoded), OP_STOP
            result entries:  ST_OK, ST_ERROR, ST_FATAL           (how the task ended)

**ShmQueue** (`unienv_mp._transport.shm_queue`): one segment holds a header (``QUEUE_HEADER``), the
message ring, the free ring of slot numbers and the slots.  A message entry is
``(tag(enc, where), slot, nbytes, payload)``.  A spill's payload is ``QUEUE_SPILL_DESC``;
the spill segment holds ``QUEUE_SPILL_ACK``, set by the receiver once it has mapped it,
and the data from ``QUEUE_SPILL_DATA`` on.

**Manager and workers** (`unienv_mp._process.manager`, `unienv_mp._process.worker`): each worker
owns one segment, created by the parent::

    0          header (WORKER_HEADER)
    STATS_AT   the worker's counters (unienv_mp.stats: written by the worker alone)
    RINGS_AT   task ring     parent -> worker   (single producer, single consumer)
    ...        result ring   worker -> parent   (single producer, single consumer)

A task entry is ``(tag(enc, where), slot, ticket, payload)``: run the target on the work
info and write the result into the worker's slot number ``slot``.  The payload ends with
``TASK_CHECK``, a CRC-32 of the tag, slot, ticket and the rest of the payload
(`task_check`): a worker that finds it wrong exits with ``_os.EXIT_TASK_REWRITTEN``
rather than run a task that something in it rewrote in its ring.  The work info is a
pickle (``ENC_PICKLE``, inline: the small immutable items of `is_simple`, such as a
sampler's ``(method, key, first, k)``) or encoded with the slot codec (``ENC_CODEC``, arrays
zero-copy), inline or in a spill segment of the parent's (payload: ``TASK_SPILL_DESC``).  A
result entry is ``(tag(status, where), slot, ticket, payload)``: the encoded result inline,
or ``SLOT_DESC``, the slot segment it was written into (the worker creates and grows its own
slots; the parent maps each through ``/proc/<worker>/fd`` the first time it sees it).  With
``ST_ERROR`` (and ``ST_FATAL``: the worker could not start and exits) the result is the
error description made by `unienv_mp.errors.error_payload`.  A work function may return a
`SlotWriter`, which writes its result into the slot itself.
"""
import struct
import zlib

from .ring import ENTRY_HEADER  # the size of a tagged entry's header is the ring's

# where the bytes of a message are (low byte of the tag)
AT_INLINE = 1
AT_SLOT = 2
AT_SPILL = 3


def tag(kind, where):
    """The tag of an entry of ``kind`` whose bytes are ``where``."""
    return where | kind << 8


def untag(t):
    """``(kind, where)`` of a tag."""
    return t >> 8, t & 0xFF


# -- ShmQueue ------------------------------------------------------------------------------

QUEUE_MAGIC = 0x51504D55  # b"UMPQ"
QUEUE_VERSION = 1
QUEUE_HEADER = struct.Struct("<IIQQQQQQQ")  # magic, version, capacity, n_slots, slot_size,
#                                             inline_size, msg_off, free_off, slots_off
QUEUE_SPILL_DESC = struct.Struct("<qiQQ")   # pid, fd, inode, size
QUEUE_SPILL_ACK = struct.Struct("<I")       # at 0 in a spill segment: 1 once mapped
QUEUE_SPILL_DATA = 64                       # where the data starts in a spill segment

# kinds of queue entries: how the message is encoded
ENC_BYTES = 1
ENC_PICKLE = 2
ENC_CODEC = 3

# -- manager and workers -------------------------------------------------------------------

WORKER_MAGIC = 0x4B524F57  # b"WORK"
WORKER_VERSION = 6
WORKER_HEADER = struct.Struct("<IIQQQQQQ")  # magic, version, task_off, task_cap, task_entry,
#                                             result_off, result_cap, result_entry
STATS_AT = 64
RINGS_AT = 1024   # (the counter block, stats.COUNTERS 8-byte words, ends before)

# kinds of task entries: ENC_PICKLE and ENC_CODEC (run the target on the work info so
# encoded), and
OP_STOP = 16
# kinds of result entries
ST_OK = 1
ST_ERROR = 2     # the target raised; the result is an error description
ST_FATAL = 3     # the worker could not start; it exits after sending this

#: (generation, fd, inode, size, nbytes) of a worker's slot segment holding a result
SLOT_DESC = struct.Struct("<IiQQQ")
#: (pid, fd, inode, size, nbytes) of a parent's spill segment holding a task's work info
TASK_SPILL_DESC = struct.Struct("<qiQQQ")
#: The check at the end of a task entry's payload (see task_check).
TASK_CHECK = struct.Struct("<I")
_TASK_HEAD = struct.Struct("<IIQ")


def task_check(tag, slot, ticket, body):
    """The CRC-32 of a task entry whose payload, less its check, is ``body``.  For a
    sampler's task (a 30-byte pickle), 0.4 us to make and pack, 0.7 us to check, measured
    on the project's 2-core machine while it was busy: against a task's tens of
    microseconds at least."""
    return zlib.crc32(body, zlib.crc32(_TASK_HEAD.pack(tag, slot, ticket)))


class SlotWriter:
    """A result that writes itself into the worker's memory, instead of being encoded by
    the codec: what a work function returns to gather a batch straight into a slot (see
    `unienv_mp._direct.gather`).

    ``nbytes``: the bytes it needs.  ``write_into(buffer, cache)`` writes a complete slot
    encoding (as `_codec.write` would) at the start of ``buffer``, a writable buffer of at
    least ``nbytes``; ``cache`` is a dict that lives as long as that buffer does, for
    whatever the writer keeps per buffer (views of it, typically).
    """
    __slots__ = ()
    nbytes = 0

    def write_into(self, buffer, cache):
        raise NotImplementedError


#: The types of the work items that travel pickled (see is_simple).
SIMPLE_TYPES = (str, int, bool, type(None))


def is_simple(work):
    """True for work items that are small, immutable and cheap to recognise (an item of
    ``SIMPLE_TYPES``, or a tuple of them): they travel as pickles, which cost less to make
    and read than the slot codec's frame."""
    t = type(work)
    return t in SIMPLE_TYPES or (t is tuple and all(type(x) in SIMPLE_TYPES for x in work))
