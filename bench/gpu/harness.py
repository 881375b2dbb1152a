"""Sections with a time budget, timestamped progress, and a JSON file rewritten after every section.

Lifecycle: `Report(path)` starts an empty result; `report.section(name, budget_s, fn)` runs `fn()`
under a SIGALRM deadline, stores its dict (or the error and traceback) under `name`, rewrites the
JSON at once, and never raises, so the next section still runs. `log()` prints with the elapsed time
and the UTC clock, flushed, so a killed run's log tells how far it got.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

_START = time.monotonic()
_LABELS = {"ok": "OK  ", "skip": "SKIP", "timeout": "FAIL(timeout)", "error": "FAIL"}


def log(message: str) -> None:
    stamp = datetime.now(UTC).strftime("%H:%M:%S")
    print(f"[{stamp} +{time.monotonic() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


class SectionTimeout(Exception):
    """A section ran past its budget."""


class Skip(Exception):
    """A section does not apply here (e.g. no CUDA); recorded as status "skip" with the reason."""


@contextmanager
def deadline(seconds: float):
    """Raise SectionTimeout in the main thread after `seconds` (a blocking C call ends first)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _expired(signum, frame):
        raise SectionTimeout(f"ran past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def out_dir(explicit: str | None = None) -> Path:
    """--out, else $OUT (set on the device machine), else ./gpu_out."""
    path = Path(explicit or os.environ.get("OUT") or "gpu_out")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Report:
    def __init__(self, path: Path, header: dict | None = None):
        self.path = path
        self.data: dict = dict(header or {})
        self.data.setdefault("sections", {})
        self.flush()

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.flush()

    def section(self, name: str, budget_s: float, fn: Callable[[], dict]) -> dict:
        log(f"section {name}: start (budget {budget_s:.0f} s)")
        t0 = time.monotonic()
        try:
            with deadline(budget_s):
                result = {"status": "ok", **(fn() or {})}
        except Skip as exc:
            result = {"status": "skip", "reason": str(exc)}
        except SectionTimeout as exc:
            result = {"status": "timeout", "error": str(exc)}
        except Exception as exc:  # a section's failure is a result, not the end of the run
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
        result["seconds"] = round(time.monotonic() - t0, 2)
        self.data["sections"][name] = result
        self.flush()
        detail = result.get("error") or result.get("reason")
        log(f"{_LABELS[result['status']]} {name} in {result['seconds']} s" + (f": {detail}" if detail else ""))
        return result

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)
