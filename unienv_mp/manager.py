"""``unienv_mp.manager``, kept for code that imports the manager from here; it lives in
`unienv_mp._process.manager` (import it as ``from unienv_mp import
MultiProcessingSampleManager``)."""
from ._process.manager import (CLOSE_WAIT, RESULT_INLINE, TASK_CAPACITY, TASK_INLINE,
                               MultiProcessingSampleManager, ResultT, TaskInfoT)

__all__ = ["MultiProcessingSampleManager", "TaskInfoT", "ResultT", "TASK_CAPACITY",
           "TASK_INLINE", "RESULT_INLINE", "CLOSE_WAIT"]
