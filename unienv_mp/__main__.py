"""``python -m unienv_mp``: the main job, the benchmark harness of ``unienv_mp.bench``
(``python -m unienv_mp --help`` lists its options)."""
import sys

from .bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
