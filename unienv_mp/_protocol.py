"""What the manager and its workers say to each other: the layout of a worker's shared
segment and the tagged entries on its two rings.

Each worker owns one segment, created by the parent:

    0     header (struct _HEADER)
    64    task ring     parent -> worker   (single producer, single consumer)
    ...   result ring   worker -> parent   (single producer, single consumer)

A task entry is ``push_tagged(op | where << 8, slot, ticket, payload)``: run the target on
the work info (encoded with the slot codec inline, or in a one-off "spill" segment of the
parent's), and write the result into the worker's slot number ``slot``.  A result entry is
``push_tagged(status | where << 8, slot, ticket, payload)``: the encoded result inline, or a
description of the slot segment it was written into (the worker creates and grows its own
slots; the parent maps them through /proc/<worker>/fd the first time it sees each one).
"""
import struct

MAGIC = 0x4B524F57  # b"WORK"
VERSION = 1
HEADER = struct.Struct("<IIQQQQQQ")  # magic, version, task_off, task_cap, task_entry,
#                                      result_off, result_cap, result_entry
RINGS_AT = 64

# task ops
OP_RUN = 1
OP_STOP = 2
# result statuses
ST_OK = 1
ST_ERROR = 2     # the target raised; the payload is an encoded _ErrorInfo
ST_FATAL = 3     # the worker could not start (init failed); it exits after sending this
# where the bytes are (second byte of the tag)
AT_INLINE = 1
AT_SLOT = 2
AT_SPILL = 3

# (generation, fd, inode, size, nbytes) of a worker slot segment holding a result
SLOT_DESC = struct.Struct("<IiQQQ")
# (pid, fd, inode, size, nbytes) of a parent spill segment holding a task's work info
SPILL_DESC = struct.Struct("<qiQQQ")


def tag(kind, where):
    return kind | (where << 8)


def untag(t):
    return t & 0xFF, t >> 8
