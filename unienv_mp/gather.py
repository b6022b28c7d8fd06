"""``unienv_mp.gather``, kept for code that imports the direct gather from here; it lives
in :mod:`unienv_mp._direct` (an internal subpackage: its names may change)."""
from ._direct.gather import (DIRECT_METHODS, Gatherer, NotDirect, PlannedBatch, check,
                             row_nbytes, sampled_rows)

__all__ = ["NotDirect", "check", "row_nbytes", "sampled_rows", "Gatherer", "DIRECT_METHODS",
           "PlannedBatch"]
