"""A sharded job on a real cluster: an array of 2 shards, then a merge job that starts only after
both succeeded (--dependency=afterok), produces the same file as one local run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from setdiff_megatron.launch.slurm import submit_sharded
from tests.launch.slurm_jobs import cancel, finished, wait_until

pytestmark = pytest.mark.slurm

WORKER = Path(__file__).with_name("slurm_shard_worker.py")


def test_array_of_two_shards_then_merge_equals_a_local_run(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n" for i in range(7)))
    local = tmp_path / "local.jsonl"
    subprocess.run([sys.executable, str(WORKER), "--prompts", str(prompts), "--out", str(local)], check=True)

    out = tmp_path / "out.jsonl"
    base = [sys.executable, str(WORKER), "--prompts", str(prompts), "--out", str(out)]
    jobs = submit_sharded(
        [*base, "--shard", "{shard}", "--num-shards", "{num_shards}"],
        base,
        num_shards=2,
        work_dir=tmp_path,
        job_name="shards",
    )
    try:
        merge = wait_until(
            jobs.merge_id,
            finished,
            timeout=240,
            what="finished",
            log=tmp_path / "slurm" / f"shards-merge-{jobs.merge_id}.out",
        )
        shards = [wait_until(f"{jobs.array_id}_{i}", finished, timeout=30, what="finished") for i in range(2)]
    finally:
        cancel(jobs.array_id)
        cancel(jobs.merge_id)
    assert [s["JobState"] for s in shards] == ["COMPLETED", "COMPLETED"]
    assert (merge["JobState"], merge["ExitCode"]) == ("COMPLETED", "0:0")
    assert merge["Dependency"] == "(null)"  # it waited for the array; the dependency is met
    # Each shard wrote its own part; the merge found them all, so it computed nothing itself.
    assert sorted(p.name for p in tmp_path.glob("out.jsonl.part-*")) == [
        "out.jsonl.part-0-of-2",
        "out.jsonl.part-1-of-2",
    ]
    assert out.read_bytes() == local.read_bytes()
    for i in range(2):
        log = (tmp_path / "slurm" / f"shards-{jobs.array_id}_{i}.out").read_text()
        assert f"setdiff: shard {i} of 2" in log
