"""Preprocessing: exact round trips for every input format, reruns, bad input, no partial outputs."""

import gzip
import json
import os

import pytest

from setdiff_megatron.data.indexed import MANIFEST_SUFFIX, open_indexed, read_manifest
from setdiff_megatron.data.preprocess import PreprocessOptions, preprocess
from setdiff_megatron.data.preprocess_cli import preprocess_main
from setdiff_megatron.data.tokenizers import load_tokenizer
from setdiff_megatron.errors import UserError
from tests.data.corpora import DOCUMENTS, write_jsonl

QUIET = PreprocessOptions(workers=1, progress=False)


def documents_back(prefix, tokenizer):
    dataset = open_indexed(prefix)
    assert all(dataset[i][-1] == tokenizer.eos_id for i in range(len(dataset)))
    return [tokenizer.decode(dataset[i][:-1]) for i in range(len(dataset))]


def test_jsonl_round_trip_with_worker_processes(bpe_tokenizer, tmp_path):
    docs = DOCUMENTS * 40  # several batches
    src = write_jsonl(tmp_path / "corpus.jsonl", docs)
    options = PreprocessOptions(workers=2, batch_bytes=2048, progress=False)
    (manifest,) = preprocess([src], tmp_path / "out", bpe_tokenizer, options)
    assert documents_back(tmp_path / "out" / "corpus", bpe_tokenizer) == docs
    assert manifest["documents"] == len(docs)
    assert manifest["tokens"] == sum(len(bpe_tokenizer.encode(d)) + 1 for d in docs)
    assert manifest["tokenizer"]["sha256"] == bpe_tokenizer.sha256
    assert manifest["dtype"] == "uint16"
    # the tokenizer that made the tokens is stored beside them
    assert load_tokenizer(tmp_path / "out" / "tokenizer").sha256 == bpe_tokenizer.sha256


def test_gpt2_tokenizer_round_trip_over_text_parquet_and_datasets(gpt2_dir, tmp_path):
    tok = load_tokenizer(gpt2_dir)
    paragraphs = [d.replace("\r\n", "\n").replace("\n\n", "\n") for d in DOCUMENTS]
    paragraphs = [p.strip("\n") for p in paragraphs]  # a paragraph cannot hold blank lines
    (tmp_path / "para.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    with gzip.open(tmp_path / "lines.txt.gz", "wt", encoding="utf-8") as stream:
        stream.write("\n".join(d for d in DOCUMENTS if "\n" not in d) + "\n")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"content": DOCUMENTS}), tmp_path / "table.parquet", row_group_size=3)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": DOCUMENTS}).save_to_disk(str(tmp_path / "saved"))

    out = tmp_path / "out"
    preprocess([tmp_path / "para.txt"], out, tok, QUIET)
    by_line = PreprocessOptions(workers=1, progress=False, text_unit="line")
    preprocess([tmp_path / "lines.txt.gz"], out, tok, by_line)
    content = PreprocessOptions(workers=1, progress=False, text_field="content")
    preprocess([tmp_path / "table.parquet"], out, tok, content)
    preprocess([tmp_path / "saved"], out, tok, QUIET)
    assert documents_back(out / "para", tok) == paragraphs
    assert documents_back(out / "lines", tok) == [d for d in DOCUMENTS if "\n" not in d]
    assert documents_back(out / "table", tok) == DOCUMENTS
    assert documents_back(out / "saved", tok) == DOCUMENTS


def test_rerun_skips_finished_outputs_and_rebuilds_changed_ones(bpe_tokenizer, tmp_path, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCUMENTS)
    out = tmp_path / "out"
    preprocess([src], out, bpe_tokenizer, QUIET)
    stamp = os.stat(out / "c.bin").st_mtime_ns
    preprocess([src], out, bpe_tokenizer, PreprocessOptions(workers=1))
    assert "up to date" in capsys.readouterr().err
    assert os.stat(out / "c.bin").st_mtime_ns == stamp
    write_jsonl(src, DOCUMENTS[:3])
    (manifest,) = preprocess([src], out, bpe_tokenizer, QUIET)
    assert manifest["documents"] == 3 and documents_back(out / "c", bpe_tokenizer) == DOCUMENTS[:3]


def test_interrupted_outputs_are_never_taken_for_finished(bpe_tokenizer, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", DOCUMENTS)
    out = tmp_path / "out"
    preprocess([src], out, bpe_tokenizer, QUIET)
    # A run killed after renaming the pair but before writing the manifest:
    (out / f"c{MANIFEST_SUFFIX}").unlink()
    (out / "c.bin.partial").write_bytes(b"junk")
    assert read_manifest(out / "c") is None
    with pytest.raises(UserError, match="not a finished"):
        open_indexed(out / "c")
    (manifest,) = preprocess([src], out, bpe_tokenizer, QUIET)
    assert manifest["documents"] == len(DOCUMENTS)
    # A truncated .bin (e.g. a crash during copying) no longer matches its manifest.
    with open(out / "c.bin", "r+b") as stream:
        stream.truncate(10)
    assert read_manifest(out / "c") is None


def run_main(argv, capsys, workers=1):
    capsys.readouterr()  # drop what the test's own setup printed
    code = preprocess_main([*argv, "--quiet", "--workers", str(workers)])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\nnot json\n{"other": 1}\n{"text": 5}\n{"text": "also fine"}\n')
    return path


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_lines_stop_with_file_and_line(workers, bpe_tokenizer, tmp_path, capsys):
    bpe_tokenizer.save(tmp_path / "tok")
    out = tmp_path / "out"
    args = [
        "--input",
        str(bad_jsonl(tmp_path)),
        "--output-dir",
        str(out),
        "--tokenizer",
        str(tmp_path / "tok"),
    ]
    code, err = run_main(args, capsys, workers)
    assert code == 2 and len(err) == 1
    assert f"{tmp_path / 'bad.jsonl'}:2: not valid JSON" in err[0]
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer"]  # nothing partial left


def test_bad_lines_skip_reports_each_and_counts(bpe_tokenizer, tmp_path, capsys):
    out = tmp_path / "out"
    options = PreprocessOptions(workers=1, progress=True, on_bad_line="skip")
    (manifest,) = preprocess([bad_jsonl(tmp_path)], out, bpe_tokenizer, options)
    err = capsys.readouterr().err
    assert "bad.jsonl:2: not valid JSON" in err
    assert "bad.jsonl:3: no 'text' field" in err
    assert "bad.jsonl:4: field 'text' is not a string" in err
    assert manifest["skipped_bad_records"] == 3
    assert documents_back(out / "bad", bpe_tokenizer) == ["fine", "also fine"]


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "input file not found"),
        ("empty", "no documents found"),
        ("unwritable", "cannot write to output directory"),
        ("no_mask", "no usable MASK token"),
        ("dataset_dict", "is a DatasetDict"),
        ("unknown", "unknown input type"),
    ],
)
def test_bad_inputs_give_one_line_and_exit_code_2(case, message, bpe_tokenizer, gpt2_dir, tmp_path, capsys):
    bpe_tokenizer.save(tmp_path / "tok")
    src, out, tok = write_jsonl(tmp_path / "ok.jsonl", DOCUMENTS), tmp_path / "out", tmp_path / "tok"
    extra = []
    if case == "missing":
        src = tmp_path / "absent.jsonl"
    elif case == "empty":
        src = tmp_path / "empty.jsonl"
        src.write_text("\n\n" + json.dumps({"text": ""}) + "\n")
    elif case == "unwritable":
        (tmp_path / "afile").write_text("")
        out = tmp_path / "afile" / "out"  # a directory below a regular file (root can't write there either)
    elif case == "no_mask":
        tok, extra = gpt2_dir, ["--no-new-tokens"]
    elif case == "dataset_dict":
        datasets = pytest.importorskip("datasets")
        split = datasets.Dataset.from_dict({"text": ["a"]})
        datasets.DatasetDict({"train": split}).save_to_disk(str(tmp_path / "dd"))
        src = tmp_path / "dd"
    elif case == "unknown":
        src = tmp_path / "corpus.csv"
        src.write_text("a,b\n")
    argv = ["--input", str(src), "--output-dir", str(out), "--tokenizer", str(tok), *extra]
    code, err = run_main(argv, capsys)
    assert code == 2 and len(err) == 1 and message in err[0], err
    if out.is_dir():
        leftovers = {p.name for p in out.iterdir()} - {"tokenizer"}
        assert not leftovers


def test_outputs_of_different_tokenizers_do_not_mix(bpe_tokenizer, gpt2_dir, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", DOCUMENTS)
    preprocess([src], tmp_path / "out", bpe_tokenizer, QUIET)
    with pytest.raises(UserError, match="different tokenizer"):
        preprocess([src], tmp_path / "out", load_tokenizer(gpt2_dir), QUIET)


def test_tools_script_runs_from_a_checkout(bpe_tokenizer, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    bpe_tokenizer.save(tmp_path / "tok")
    script = Path(__file__).parents[2] / "tools" / "preprocess_data.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--input",
            str(tmp_path / "absent.jsonl"),
            "--output-dir",
            str(tmp_path / "o"),
            "--tokenizer",
            str(tmp_path / "tok"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.strip().endswith("absent.jsonl")
