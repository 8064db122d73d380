"""Prompt files and the resumable, sharded results store of sampling/evaluation jobs."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from setdiff_megatron.errors import UserError
from setdiff_megatron.inference.prompts import read_prompts
from setdiff_megatron.inference.results import ShardedResults
from setdiff_megatron.sampling.decoding import DecodingConfig, settings_off_default


def write(path, *lines: str):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_prompts_keep_order_extra_keys_and_spans(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"prompt": "a", "id": 7}', "", '{"segments": ["x", 3, "y"], "ref": "z"}')
    first, second = read_prompts(path)
    assert (first.index, first.line, first.segments, first.extra) == (0, 1, ("a",), {"id": 7})
    assert (second.index, second.line, second.segments, second.extra) == (1, 3, ("x", 3, "y"), {"ref": "z"})


@pytest.mark.parametrize(
    "line, fragment",
    [
        ('{"prompt": "a"', "p.jsonl:2: not valid JSON"),
        ('["a"]', "p.jsonl:2: expected a JSON object"),
        ('{"text": "a"}', "p.jsonl:2: give exactly one of 'prompt'"),
        ('{"prompt": "a", "segments": ["b"]}', "give exactly one of"),
        ('{"segments": ["a", 0]}', "span lengths >= 1"),
        ('{"segments": []}', "non-empty list"),
        ('{"prompt": 3}', "'prompt' must be a string"),
    ],
)
def test_malformed_prompt_lines_name_file_and_line(tmp_path, line, fragment):
    with pytest.raises(UserError, match=fragment):
        read_prompts(write(tmp_path / "p.jsonl", '{"prompt": "ok"}', line))


def test_empty_or_missing_prompt_file(tmp_path):
    with pytest.raises(UserError, match="holds no prompts"):
        read_prompts(write(tmp_path / "p.jsonl", "", "  "))
    with pytest.raises(UserError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl")


def test_results_resume_across_shardings_and_merge_in_order(tmp_path):
    out = tmp_path / "o.jsonl"
    results = ShardedResults(out, {"model": "m"})
    results.check_job()
    results.start()
    results.part("shard-1-of-2").write([{"index": 1, "v": "b"}, {"index": 3, "v": "d"}])
    assert results.done() == {1, 3}
    assert results.merge(4) == [0, 2] and not out.exists()
    # A rerun with one shard finishes the rest; the merge orders by index and removes the parts.
    results.part("shard-0-of-1").write([{"index": 2, "v": "c"}, {"index": 0, "v": "a"}])
    assert results.merge(4) == []
    assert [json.loads(line)["v"] for line in out.read_text().splitlines()] == ["a", "b", "c", "d"]
    assert not results.parts.exists() and results.done() == {0, 1, 2, 3}


def test_a_torn_last_line_is_dropped_and_cut_before_appending(tmp_path):
    results = ShardedResults(tmp_path / "o.jsonl", {})
    results.start()
    part = results.parts / "shard-0.jsonl"
    part.write_text('{"index": 0}\n{"index": 1, "v": "tr')  # killed mid-write
    assert results.done() == {0}
    results.part("shard-0").write([{"index": 1, "v": "whole"}])
    assert part.read_text().splitlines() == ['{"index": 0}', '{"index": 1, "v": "whole"}']


def test_other_settings_are_refused_and_foreign_files_kept(tmp_path):
    out = tmp_path / "o.jsonl"
    results = ShardedResults(out, {"window": 4})
    results.start()
    results.part("a").write([{"index": 0}])
    with pytest.raises(UserError, match="other settings .*window: 4 there, 8 here"):
        ShardedResults(out, {"window": 8}).check_job()
    foreign = write(tmp_path / "mine.jsonl", "keep me")
    with pytest.raises(UserError, match="not written by this kind of job"):
        ShardedResults(foreign, {}).check_job()
    assert foreign.read_text() == "keep me\n" and results.done() == {0}


def test_a_job_saved_before_a_decoding_setting_existed_resumes_at_its_default(tmp_path):
    out = tmp_path / "o.jsonl"
    before = {k: v for k, v in asdict(DecodingConfig(window=4)).items() if k != "cache_infill_input"}
    ShardedResults(out, {"decoding": before}).start()
    same = {"decoding": settings_off_default}
    ShardedResults(out, {"decoding": asdict(DecodingConfig(window=4))}, same).check_job()
    changed = asdict(DecodingConfig(window=4, cache_infill_input=True))
    with pytest.raises(UserError, match="other settings .*'cache_infill_input': True"):
        ShardedResults(out, {"decoding": changed}, same).check_job()


def test_a_peer_checking_while_the_first_process_starts_the_job_is_never_refused(tmp_path, monkeypatch):
    """Every process of a job calls check_job while the first one may be in `start`: after each
    file operation of `start`, a peer's check passes. The parts folder used to come before the job
    record, and a peer that looked in between exited with 'not written by this kind of job' (the
    flaky TP sampling test: rank 1, exit code 2)."""
    out, job = tmp_path / "o.jsonl", {"window": 4}
    first, peer = ShardedResults(out, job), ShardedResults(out, job)
    checked = []

    def then_check(method):
        def wrapped(path, *args, **kwargs):
            result = method(path, *args, **kwargs)
            peer.check_job()
            checked.append(method.__name__)
            return result

        return wrapped

    for name in ("mkdir", "replace", "write_text"):
        monkeypatch.setattr(Path, name, then_check(getattr(Path, name)))
    first.start()
    assert checked.count("mkdir") == 2 and "replace" in checked and first.parts.is_dir()
