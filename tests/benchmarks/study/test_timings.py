"""Which invocation of the study measured each speed (run.invocation_of): a rerun that reuses a
finished job keeps the invocation that measured it, a job decoded again gets the new one, and a
job stopped before it could record its speeds is credited to the invocation that was running."""

from __future__ import annotations

import json
import os

from benchmarks.study.run import INVOCATIONS, invocation_of, new_invocation


def _at(path, seconds: float) -> None:
    os.utime(path, (seconds, seconds))


def test_each_speed_keeps_the_invocation_that_measured_it(tmp_path):
    timed = tmp_path / "eval" / "m" / "generations.jsonl"
    timed.parent.mkdir(parents=True)
    timed.write_text('{"busy_seconds": 1.0}\n')
    _at(timed, 1_000)  # written before any invocation on record
    first = new_invocation(tmp_path)
    assert invocation_of(tmp_path, timed).startswith("unrecorded (written 1970-01-01T00:16:40Z)")

    timed.write_text('{"busy_seconds": 2.0}\n')  # decoded again by this invocation
    assert invocation_of(tmp_path, timed) == first

    # Two invocations later the file is written again with the same content (a job that found its
    # work done): it keeps the invocation that measured it.
    log = tmp_path / INVOCATIONS
    records = [json.loads(line) for line in log.read_text().splitlines()]
    log.write_text(json.dumps(records[0] | {"start": 2_000}) + "\n")
    later = {"id": "2030-01-01T00:00:00Z", "start": 3_000}
    with open(log, "a") as stream:
        stream.write(json.dumps(later) + "\n")
    timed.write_text('{"busy_seconds": 2.0}\n')
    _at(timed, 3_500)
    assert invocation_of(tmp_path, timed) == first

    # New content written while the later invocation ran, never recorded by it (stopped): its.
    timed.write_text('{"busy_seconds": 3.0}\n')
    _at(timed, 3_500)
    assert invocation_of(tmp_path, timed) == later["id"]
