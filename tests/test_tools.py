"""tools/: the Megatron-LM style entry scripts are the `setdiff` subcommands, argument for
argument: the same help, and the same outputs on the session's tiny run."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).parents[1] / "tools"
SCRIPTS = {
    "convert_checkpoint.py": "convert",
    "sample.py": "sample",
    "serve.py": "serve",
    "evaluate.py": "eval",
    "preprocess_data.py": "preprocess",
}


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_is_the_subcommands(script):
    out = run(str(TOOLS / script), "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"usage: setdiff {SCRIPTS[script]}"), out.stdout[:200]


def digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "README.md"
    }


def records(path: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in ("seconds", "busy_seconds")}
        for line in path.read_text().splitlines()
    ]


@pytest.mark.slow  # 34 s; the subcommands run in their own tests
def test_one_run_each_equals_the_subcommand(trained_run, tmp_path):
    cli = ["-m", "setdiff_megatron.cli"]
    for name, argv in (("tool", [str(TOOLS / "convert_checkpoint.py")]), ("cli", [*cli, "convert"])):
        out = run(*argv, "to-hf", str(trained_run), str(tmp_path / f"hf-{name}"), "--check")
        assert out.returncode == 0, out.stderr[-2000:]
    assert digests(tmp_path / "hf-tool") == digests(tmp_path / "hf-cli")

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):\\n"}\n{"segments": ["class A:\\n    ", 4, "\\n"]}\n')
    for name, argv in (("tool", [str(TOOLS / "sample.py")]), ("cli", [*cli, "sample"])):
        out = run(
            *argv,
            str(trained_run),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / f"{name}.jsonl"),
            "--max-new-tokens",
            "8",
            "--window",
            "4",
            "--no-progress",
        )
        assert out.returncode == 0, out.stderr[-2000:]
    assert (
        records(tmp_path / "tool.jsonl") == records(tmp_path / "cli.jsonl")
        and len(records(tmp_path / "cli.jsonl")) == 2
    )

    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "import os\\nprint(os.sep)\\n"}\n{"text": "x = [1, 2, 3]\\n"}\n')
    summaries = {}
    for name, argv in (("tool", [str(TOOLS / "evaluate.py")]), ("cli", [*cli, "eval"])):
        out = run(
            *argv,
            "likelihood",
            str(trained_run),
            "--data",
            str(docs),
            "--out",
            str(tmp_path / f"nll-{name}"),
            "--order",
            "left_to_right",
            "--no-progress",
        )
        assert out.returncode == 0, out.stderr[-2000:]
        summaries[name] = json.loads((tmp_path / f"nll-{name}" / "likelihood.json").read_text())
    for summary in summaries.values():
        summary.pop("source", None)
    assert summaries["tool"] == summaries["cli"] and summaries["cli"]["num_windows"] == 2
