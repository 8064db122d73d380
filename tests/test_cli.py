"""The `setdiff` command as a new user meets it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from setdiff_megatron import __version__
from setdiff_megatron.cli import SUBCOMMANDS
from setdiff_megatron.distributed.runtime import init_process_group
from setdiff_megatron.errors import ERROR_DIR_ENV, UserError, handed_over, report
from setdiff_megatron.launch.local_launch import run_workers
from tests.cli_runs import setdiff

ROOT = Path(__file__).parents[1]


@pytest.mark.multiproc
def test_version_and_help():
    out = setdiff("--version")
    assert out.returncode == 0 and __version__ in out.stdout
    out = setdiff("--help")
    assert out.returncode == 0 and all(name in out.stdout for name in SUBCOMMANDS)


def test_a_subcommand_builds_its_own_options_alone():
    """`setdiff train` (and each rank it starts) parses with the train options alone: none of the
    sampler's, the evaluation jobs' or dynamo's modules are imported for the others' options."""
    code = (
        "import sys; from setdiff_megatron.cli import build_parser; "
        "args = build_parser('train').parse_args(['train', 'r.yaml', 'a=1']); "
        "assert (args.recipe, args.overrides) == ('r.yaml', ['a=1']); "
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'setdiff_megatron.sampling', "
        "'setdiff_megatron.evaluation', 'setdiff_megatron.inference'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.multiproc
def test_train_needs_a_recipe(capsys):
    out = setdiff("train", check=False)
    assert out.returncode == 2
    assert (
        out.stderr == "setdiff train: error: the following arguments are required: recipe; see setdiff train --help\n"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["sample", "run", "--prompts", "p", "--out", "o", "--compile", "bogus"],
            "setdiff sample: error: argument --compile: invalid choice: 'bogus' (choose from 'off', 'auto', 'on')",
        ),
        (
            ["convert", "to-hf", "run", "out", "--layout", "bogus"],
            "setdiff convert to-hf: error: argument --layout: invalid choice: 'bogus' (choose from 'setdiff', 'setdlm')",
        ),
        (
            ["sample", "run", "--prompts", "p", "--out", "o", "--nproc", "two"],
            "setdiff sample: error: argument --nproc: expected an integer, got 'two'",
        ),
        (["serve", "run", "--port", "http"], "setdiff serve: error: argument --port: expected an integer, got 'http'"),
        (
            ["preprocess", "--output-dir", "o", "--workers", "x"],
            "setdiff preprocess: error: argument --workers: expected an integer, got 'x'",
        ),
        (
            ["eval", "bogus"],
            "setdiff eval: error: argument JOB: invalid choice: 'bogus' (choose from 'likelihood', 'infill', 'generate', 'sweep', 'lm-eval')",
        ),
    ],
    ids=["sample choice", "convert choice", "sample int", "serve int", "preprocess int", "eval job"],
)
def test_a_usage_error_is_one_line_naming_the_flag_and_what_it_takes(argv, message, capsys):
    """Not argparse's usage block above it (a 15-line one for `sample`)."""
    from setdiff_megatron.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    prog = message.partition(": error:")[0]
    assert exit_.value.code == 2 and capsys.readouterr().err == f"{message}; see {prog} --help\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["-m", "benchmarks.study", "--seeds", "1,x"],
            "python -m benchmarks.study: error: argument --seeds: expected distinct non-negative integers "
            "separated by commas, e.g. 1,2,3; got '1,x'; see python -m benchmarks.study --help",
        ),
        (
            [str(ROOT / "tools" / "sample.py"), "run", "--prompts", "p", "--out", "o", "--batch-size", "wide"],
            "setdiff sample: error: argument --batch-size: expected an integer, got 'wide'; see setdiff sample --help",
        ),
    ],
    ids=["python -m", "tools/"],
)
def test_module_and_tool_entry_points_say_so_in_one_line_too(argv, message):
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and out.stderr == message + "\n"


def test_a_rule_checked_after_parsing_is_one_line(capsys):
    from benchmarks.study.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--steps", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and ": error: --steps must be >= 1; got 0; see " in err


def test_a_launch_reports_the_user_error_of_the_lowest_rank_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    for rank, text in ((1, "rank 1 says"), (0, "rank 0 says")):
        monkeypatch.setenv("RANK", str(rank))
        assert report(UserError(text)) == 2
    assert capsys.readouterr() == ("", "")  # a worker leaves its message to the launcher
    assert handed_over(tmp_path) == "rank 0 says" and sorted(p.name for p in tmp_path.iterdir()) == [
        "rank-000000",
        "rank-000001",
    ]
    monkeypatch.delenv(ERROR_DIR_ENV)
    assert report(UserError("alone")) == 2 and capsys.readouterr().err == "setdiff: error: alone\n"


@pytest.mark.multiproc
def test_a_user_error_of_one_rank_reaches_the_person_once(capfd):
    """Rank 1's message, raised by the launcher, and not a line more: not from rank 0, whose
    barrier lost its peer, and not from torchrun about its failed workers."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with pytest.raises(UserError, match="^only rank 1 knows$"):
        run_workers(2, [], env, module="tests.distributed.user_error_worker")
    assert capfd.readouterr() == ("", "")


@pytest.mark.parametrize("port", ["0", "65536", "http", ""])
def test_a_master_port_that_is_not_a_port_is_one_line(port, monkeypatch):
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=f"^MASTER_PORT='{port}' is not a TCP port"):
        init_process_group()


@pytest.mark.multiproc
def test_a_two_process_run_log_starts_with_our_own_lines(trained_launch):
    """No megatron-core warning about Transformer Engine and Apex, no torchrun banner about
    OMP_NUM_THREADS: the data preparation's lines first on stderr, the steps' on stdout."""
    _, out = trained_launch
    assert "Transformer Engine and Apex" not in out.stdout + out.stderr and "OMP_NUM_THREADS" not in out.stderr
    assert out.stderr.startswith("train: ") and out.stdout.startswith("step 0/20 | valid loss ")
