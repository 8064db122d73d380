"""Preprocessing streams: peak memory does not grow with the corpus, and progress is reported.

Memory is sampled every 20 ms with psutil: the growth of this process's RSS during the run (the
writer side) and the peak RSS of each worker process. Both bounds hold for 10 MB and 200 MB
inputs alike; megatron's index builder adds about 40 bytes per document, far below the bounds.
"""

import json
import threading
import time

import pytest

from setdiff_megatron.data.indexed import megatron_datasets
from setdiff_megatron.data.preprocess import PreprocessOptions, preprocess
from setdiff_megatron.data.tokenizers import train_byte_level_bpe
from tests.data.corpora import write_synthetic_jsonl

MAIN_GROWTH_BOUND_MB = 200
WORKER_BOUND_MB = 300


def preprocess_measured(megabytes, tmp_path, capsys):
    psutil = pytest.importorskip("psutil")
    source = write_synthetic_jsonl(tmp_path / "synthetic.jsonl", megabytes)
    sample = [json.loads(line)["text"] for _, line in zip(range(2000), source.open())]
    tokenizer = train_byte_level_bpe(sample, 1024)
    megatron_datasets("indexed_dataset")  # its import (about 100 MB) is not part of the growth
    me = psutil.Process()
    baseline = me.memory_info().rss
    peaks = {"main": baseline, "worker": 0}
    others: dict[int, tuple[int, str]] = {}
    done = threading.Event()
    # The workers are the spawned processes this process starts during the run, once they run
    # spawn_main. Not workers, named in the report and not bounded: a child caught between fork
    # and exec, which still shows this process's command and all its memory (CI once read 801 MB
    # so), the multiprocessing resource tracker, and processes earlier tests left running.
    earlier = {child.pid for child in me.children(recursive=True)}

    def sample_memory():
        while not done.is_set():
            peaks["main"] = max(peaks["main"], me.memory_info().rss)
            for child in me.children(recursive=True):
                if child.pid in earlier:
                    continue
                try:
                    rss, command = child.memory_info().rss, " ".join(child.cmdline())
                    if child.ppid() == me.pid and "spawn_main" in command:
                        peaks["worker"] = max(peaks["worker"], rss)
                    else:
                        others[child.pid] = (max(rss, others.get(child.pid, (0, ""))[0]), command[:120])
                except psutil.Error:
                    pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample_memory, daemon=True)
    sampler.start()
    start = time.perf_counter()
    try:
        (manifest,) = preprocess([source], tmp_path / "out", tokenizer, PreprocessOptions(workers=2))
    finally:
        done.set()
        sampler.join()
    seconds = time.perf_counter() - start
    growth_mb, worker_mb = (peaks["main"] - baseline) / 2**20, peaks["worker"] / 2**20
    progress = capsys.readouterr().err
    with capsys.disabled():
        print(
            f"\n{megabytes} MB JSONL: {manifest['documents']} documents, {manifest['tokens']} tokens, "
            f"{seconds:.1f}s; main RSS {baseline / 2**20:.0f} MB + {growth_mb:.0f} MB peak growth, "
            f"worker peak {worker_mb:.0f} MB"
            + "".join(f"; not a worker: pid {pid} {rss / 2**20:.0f} MB {cmd}" for pid, (rss, cmd) in others.items())
        )
    assert "doc/s" in progress and "tok/s" in progress and "% read" in progress, progress[-500:]
    assert growth_mb < MAIN_GROWTH_BOUND_MB, f"main process grew by {growth_mb:.0f} MB"
    assert 0 < worker_mb < WORKER_BOUND_MB, f"worker peak {worker_mb:.0f} MB"
    return manifest


def test_preprocessing_10mb_stays_under_the_memory_bound(tmp_path, capsys):
    assert preprocess_measured(10, tmp_path, capsys)["documents"] > 5_000


@pytest.mark.slow
def test_preprocessing_200mb_stays_under_the_same_bound(tmp_path, capsys):
    assert preprocess_measured(200, tmp_path, capsys)["documents"] > 100_000
