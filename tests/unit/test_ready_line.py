"""The ready line: written in one piece, found in a line that other output shares."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from common.serving import parse_ready

REPO = Path(__file__).resolve().parents[2]

EVENT = {"event": "ready", "pid": 7, "grpc": "127.0.0.1:5000", "http": "127.0.0.1:5001"}


def test_parse_ready_reads_a_line_that_is_only_the_event():
    assert parse_ready(json.dumps(EVENT) + "\n") == EVENT


def test_parse_ready_ignores_text_before_and_after_the_event():
    line = "(DecodeWorker pid=12) INFO starting" + json.dumps(EVENT) + "(raylet) log line\n"
    assert parse_ready(line) == EVENT


def test_parse_ready_returns_none_for_other_lines():
    assert parse_ready('{"event": "streaming", "index": 0}\n') is None
    assert parse_ready("pdserve ready: grpc=127.0.0.1:5000\n") is None
    assert parse_ready(json.dumps(EVENT)[:-5] + "\n") is None  # cut short


def test_a_process_whose_stderr_shares_the_pipe_is_still_seen_ready():
    child = (
        "import sys\n"
        "from common.serving import announce_ready\n"
        "sys.stderr.write('a log line cut short, no newline yet: '); sys.stderr.flush()\n"
        "announce_ready(grpc='127.0.0.1:5000')\n"
        "sys.stderr.write('the rest of the log line\\n'); sys.stderr.flush()\n"
    )
    out = subprocess.run([sys.executable, "-u", "-c", child], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=60, check=True).stdout
    events = [event for event in map(parse_ready, out.splitlines()) if event is not None]
    assert len(events) == 1
    assert events[0]["grpc"] == "127.0.0.1:5000" and isinstance(events[0]["pid"], int)
