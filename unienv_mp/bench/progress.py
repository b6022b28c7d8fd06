"""What the main job says while it works, on stderr (``Progress``).  tqdm is optional:
it is imported only where a terminal would show its bars, and a line per row replaces
them without it."""
import sys
import time


class Progress:
    """What the main job says while it works, on stderr: a bar per row where stderr is a
    terminal (and tqdm is installed), else a line as each row starts and one as it
    finishes (a CI log, ``| tee``, a notebook); nothing at all when not ``enabled``
    (``--no-progress``, ``--json``)."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.tqdm = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.tqdm = tqdm
            except ImportError:
                pass

    def bar(self, total, desc, unit):
        if not self.enabled:
            return _NoBar()
        if self.tqdm is None:
            return _LineBar(desc)
        return self.tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr,
                         bar_format="{desc:<44} {bar} {percentage:3.0f}%")

    def timing(self, desc):
        """A bar for one measurement: ``(advance(fraction done), close())``."""
        bar = self.bar(100, desc, "%")
        last = [0]

        def advance(fraction):
            step = int(fraction * 100)
            if step > last[0]:
                bar.update(step - last[0])
                last[0] = step
        return advance, bar.close


class _LineBar:
    """A line when it starts, one when it is closed (with the seconds between)."""

    def __init__(self, desc):
        self.desc = desc
        self.start = time.perf_counter()
        print(f"{desc} ...", file=sys.stderr, flush=True)

    def update(self, n=1):
        pass

    def close(self):
        print(f"{self.desc}: done in {time.perf_counter() - self.start:.1f} s",
              file=sys.stderr, flush=True)


class _NoBar:
    n = 0

    def update(self, n=1):
        pass

    def close(self):
        pass
