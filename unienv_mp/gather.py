"""``unienv_mp.gather``, kept for code that imports the direct gather from here; it lives
in `unienv_mp._direct` (an internal subpackage: its names may change)."""
from ._direct.base import DIRECT_METHODS, NotDirect, PlannedBatch, sampled_rows
from ._direct.gather import Gatherer, check, row_nbytes

__all__ = ["NotDirect", "check", "row_nbytes", "sampled_rows", "Gatherer", "DIRECT_METHODS",
           "PlannedBatch"]
