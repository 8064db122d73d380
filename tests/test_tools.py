"""tools/: the Megatron-LM style entry scripts are the `setdiff` subcommands, argument for
argument: the same help, and the same outputs on the session's tiny run."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_runs import cli

TOOLS = Path(__file__).parents[1] / "tools"
SCRIPTS = {
    "convert_checkpoint.py": "convert",
    "sample.py": "sample",
    "serve.py": "serve",
    "evaluate.py": "eval",
    "preprocess_data.py": "preprocess",
}


def tool(script: str) -> list[str]:
    return [sys.executable, str(TOOLS / script)]


def run(command: list[str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_is_the_subcommands(script):
    out = run(tool(script), "--help")
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


@pytest.mark.multiproc
@pytest.mark.slow  # 34 s; the subcommands run in their own tests
def test_one_run_each_equals_the_subcommand(trained_run, tmp_path):
    for name, argv in (("tool", tool("convert_checkpoint.py")), ("cli", cli("convert"))):
        out = run(argv, "to-hf", str(trained_run), str(tmp_path / f"hf-{name}"), "--check")
        assert out.returncode == 0, out.stderr[-2000:]
    assert digests(tmp_path / "hf-tool") == digests(tmp_path / "hf-cli")

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f(x):\\n"}\n{"segments": ["class A:\\n    ", 4, "\\n"]}\n')
    for name, argv in (("tool", tool("sample.py")), ("cli", cli("sample"))):
        out = run(
            argv,
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
    for name, argv in (("tool", tool("evaluate.py")), ("cli", cli("eval"))):
        out = run(
            argv,
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


FAKE_SETDIFF = """#!/usr/bin/env bash
# A stand-in `setdiff`: records its arguments; `train RECIPE checkpoint.dir=RUN` makes RUN;
# `convert to-hf RUN OUT ...` writes an export's files and, like the real one, refuses an existing
# OUT without --overwrite.
echo "$*" >> "$SETDIFF_CALLS"
if [ "$1" = train ]; then mkdir -p "${3#checkpoint.dir=}/checkpoints"; fi
if [ "$1" = convert ]; then
  out=$4
  if [ -e "$out" ] && [[ " $* " != *" --overwrite "* ]]; then echo "exists" >&2; exit 2; fi
  rm -rf "$out" && mkdir -p "$out"
  printf '# export\\n\\n## Training recipe\\n\\nthe recipe\\n' > "$out/README.md"
  echo weights > "$out/model.safetensors"
  touch "$out/modeling_setdiff.py" "$out/configuration_setdiff.py"
fi
"""


def build_base(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """tools/build_reasoning_ar_base.sh with a stand-in `setdiff` first on PATH: (the process, the
    setdiff command lines it ran)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "setdiff").write_text(FAKE_SETDIFF)
    (bin_dir / "setdiff").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SETDIFF_CALLS": str(calls)}
    proc = subprocess.run(
        [str(TOOLS / "build_reasoning_ar_base.sh"), *args], capture_output=True, text=True, env=env, timeout=60
    )
    lines = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return proc, lines


def test_the_base_is_built_from_a_new_run_and_replaces_only_an_earlier_build(tmp_path):
    """Never a resumed run (it would export old weights), never an OUT this script did not write."""
    out, run_dir = tmp_path / "base", tmp_path / "run"
    proc, calls = build_base(tmp_path, str(out), str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        f"train recipes/study/adapted/ar-base.yaml checkpoint.dir={run_dir}",
        f"convert to-hf {run_dir} {out} --dtype bf16",
    ]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "SHA256SUMS", "model.safetensors"]
    assert out.joinpath("README.md").read_text().startswith("# reasoning-ar-base\n")

    proc, calls = build_base(tmp_path, str(out), str(run_dir))  # the same run directory again
    assert proc.returncode == 2 and not calls and f"{run_dir} exists" in proc.stderr

    rebuilt = tmp_path / "run2"
    proc, calls = build_base(tmp_path, str(out), str(rebuilt))  # OUT holds an earlier build: replaced
    assert proc.returncode == 0 and calls[-1] == f"convert to-hf {rebuilt} {out} --dtype bf16 --overwrite"

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("keep me")
    proc, calls = build_base(tmp_path, str(foreign), str(tmp_path / "run3"))
    assert proc.returncode == 2 and not calls and "is not an earlier build of this script" in proc.stderr
    assert [p.name for p in foreign.iterdir()] == ["keep.txt"] and not (tmp_path / "run3").exists()
