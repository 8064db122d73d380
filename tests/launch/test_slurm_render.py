"""Rendering and checking SLURM jobs without a cluster: `setdiff launch --slurm --dry-run`, the
cluster file, the one-line errors, and the slurm/ templates staying equal to the renderer."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from setdiff_megatron.cli import main
from setdiff_megatron.launch.sbatch import Resources, render_array, templates
from setdiff_megatron.launch.slurm import submit_sharded

REPO = Path(__file__).parents[2]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
OWT = REPO / "recipes" / "owt-110m.yaml"


def dry_run(capsys, *args: str) -> str:
    assert main(["launch", *args, "--slurm", "--dry-run"]) == 0
    return capsys.readouterr().out


def error(capsys, *args: str) -> str:
    assert main(["launch", *args, "--slurm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def bash_syntax_ok(script: str) -> None:
    out = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def cluster_file(tmp_path: Path, **settings) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def test_tiny_cpu_renders_srun_tasks_on_cpus_with_signal_and_requeue(capsys, tmp_path):
    script = dry_run(capsys, str(TINY), f"checkpoint.dir={tmp_path}/run", "train.steps=20")
    bash_syntax_ok(script)
    for line in (
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --time=01:00:00",
        f"#SBATCH --output={tmp_path}/run/slurm/%x-%j.out",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
        "export CUDA_VISIBLE_DEVICES=''",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f"RECIPE={TINY}",
        f"OVERRIDES=(checkpoint.dir={tmp_path}/run train.steps=20)",
        'scontrol requeue "$SLURM_JOB_ID"',
        'kill -USR1 "$pid"',
    ):
        assert line in script, line
    assert "--gpus-per-node" not in script and "NCCL" not in script
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_gpu_recipe_takes_cluster_settings_and_the_recipe_wins(capsys, tmp_path, monkeypatch):
    path = cluster_file(
        tmp_path,
        partition="gpu",
        account="proj",
        gpus_per_node=8,
        cpus_per_task=12,
        setup=["module load cuda/12.4"],
        env={"NCCL_SOCKET_IFNAME": "ib0"},
        sbatch_args=["--exclusive"],
        srun_args=["--cpu-bind=none"],
    )
    monkeypatch.setenv("SETDIFF_CLUSTER_FILE", str(path))
    script = dry_run(capsys, str(OWT), "launch.slurm.partition=big", "launch.slurm.setup=[source venv/bin/activate]")
    bash_syntax_ok(script)
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=12",
        "#SBATCH --time=48:00:00",
        "#SBATCH --partition=big",
        "#SBATCH --account=proj",
        "#SBATCH --exclusive",
        "module load cuda/12.4\nsource venv/bin/activate",
        "export NCCL_SOCKET_IFNAME=ib0",
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "srun --kill-on-bad-exit=1 --label --cpu-bind=none",
    ):
        assert line in script, line
    assert f"cluster file: {path}" in script


def test_torchrun_launcher_runs_one_task_per_node_and_maps_its_exit_code(capsys, tmp_path):
    script = dry_run(
        capsys,
        str(TINY),
        f"checkpoint.dir={tmp_path}",
        "launch.slurm.launcher=torchrun",
        "launch.slurm.cpus_per_task=1",
        "launch.max_restarts=2",
    )
    bash_syntax_ok(script)
    assert "#SBATCH --ntasks-per-node=1" in script and "#SBATCH --cpus-per-task=2" in script
    assert "torchrun --nnodes=$SLURM_NNODES --nproc_per_node=2 --max-restarts=2 --rdzv_id=$SLURM_JOB_ID" in script
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script  # or restarted workers hang at rendezvous
    assert f"[ -f {tmp_path}/preempted.json ] && code=75" in script


def test_cluster_file_from_the_default_location(capsys, tmp_path, monkeypatch):
    (tmp_path / "setdiff").mkdir()
    cluster_file(tmp_path / "setdiff", partition="cpu", gpus_per_node=0, gpu_request="gres")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    script = dry_run(capsys, str(TINY), "launch.device=auto", "launch.slurm.requeue=false")
    assert "#SBATCH --partition=cpu" in script and "--gres" not in script  # auto + gpus_per_node 0: cpu
    assert "--requeue" not in script and "scontrol requeue" not in script


def test_restarts_without_torchrun_are_one_line(capsys, tmp_path):
    err = error(capsys, str(TINY), f"checkpoint.dir={tmp_path}/run", "launch.max_restarts=1")
    assert "launch.max_restarts = 1 needs launch.slurm.launcher: torchrun" in err


def test_sbatch_missing_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    err = error(capsys, str(TINY), f"checkpoint.dir={tmp_path}/run")
    assert "sbatch not found" in err


def test_more_gpus_than_a_node_has_is_one_line(capsys, tmp_path):
    path = cluster_file(tmp_path, gpus_per_node=4, max_nodes=1)
    err = error(capsys, str(OWT), f"launch.slurm.cluster_file={path}")
    assert "launch.nproc_per_node: 8 GPUs per node asked" in err and "has 4" in err
    err = error(capsys, str(OWT), f"launch.slurm.cluster_file={path}", "launch.nproc_per_node=4")
    assert "launch.nnodes: 2 nodes asked" in err and "at most 1" in err


@pytest.mark.parametrize("how", ["recipe", "env"])
def test_missing_cluster_file_is_one_line(capsys, tmp_path, monkeypatch, how):
    missing = tmp_path / "nope.yaml"
    if how == "env":
        monkeypatch.setenv("SETDIFF_CLUSTER_FILE", str(missing))
        assert f"SETDIFF_CLUSTER_FILE={missing}: no such file" in error(capsys, str(TINY))
    else:
        assert f"launch.slurm.cluster_file: {missing} does not exist" in error(
            capsys, str(TINY), f"launch.slurm.cluster_file={missing}"
        )


def test_bad_cluster_file_is_one_line(capsys, tmp_path):
    path = cluster_file(tmp_path, partiton="gpu")
    assert "partiton: unknown key" in error(capsys, str(TINY), f"launch.slurm.cluster_file={path}")


def test_array_command_placeholders(tmp_path):
    script = render_array(
        Resources(job_name="s", array="0-3"), ["run", "--shard={shard}", "a b", "{num_shards}"], num_shards=4
    )
    bash_syntax_ok(script)
    assert "run --shard=\"$SLURM_ARRAY_TASK_ID\" 'a b' 4" in script
    jobs = submit_sharded(
        "work --shard {shard} --of {num_shards}", "work", num_shards=3, work_dir=tmp_path, max_parallel=2, dry_run=True
    )
    assert "#SBATCH --array=0-2%2" in jobs.array.text
    assert 'work --shard "$SLURM_ARRAY_TASK_ID" --of 3' in jobs.array.text
    assert jobs.merge.text.rstrip().endswith("work") and jobs.array_id is None


def test_slurm_templates_match_the_renderer():
    for name, text in templates().items():
        bash_syntax_ok(text)
        assert (REPO / "slurm" / name).read_text() == text, (
            f"slurm/{name} is stale: python -m setdiff_megatron.launch.sbatch slurm/"
        )
    bash_syntax_ok((REPO / "slurm" / "sample.sbatch").read_text())
