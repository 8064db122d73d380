"""Checkpoint bookkeeping without training: manifests, selection, pre-flight, inspect, signals.

Checkpoints here are stand-ins (a few files, a train_state.json, a manifest) so each test runs
in milliseconds; test_checkpoint_runs.py does the same things to real training runs.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from setdiff_megatron.cli import main
from setdiff_megatron.errors import UserError
from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.training import checkpointing, signals

TINY = str(Path(__file__).parents[2] / "recipes" / "tiny-cpu.yaml")
TOKENIZER = SimpleNamespace(vocab_size=2048, mask_id=3)


def recipe_for(run_dir: Path, *overrides: str):
    return load_recipe(TINY, [f"checkpoint.dir={run_dir}", *overrides])


def fake_checkpoint(run_dir: Path, step: int, *model_overrides: str) -> Path:
    """A published checkpoint as `save` lays it out, minus the tensors' real contents."""
    recipe = recipe_for(run_dir, *model_overrides)
    path = run_dir / checkpointing.CHECKPOINTS / f"step_{step:08d}"
    (path / "tokenizer").mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(os.urandom(4096))
    (path / "tokenizer" / "tokenizer.json").write_text("{}")
    (path / "recipe.yaml").write_text(f"name: {recipe.name}\n")
    state = {"step": step, "consumed_samples": 8 * step, "skipped_steps": 0, "scheduler": {},
             "layout": checkpointing.layout(recipe), "model": checkpointing._model_identity(recipe, TOKENIZER),
             "tokenizer": {"vocab_size": TOKENIZER.vocab_size, "mask_id": TOKENIZER.mask_id}}
    (path / checkpointing.TRAIN_STATE).write_text(json.dumps(state))
    checkpointing._write_manifest(path)
    (path.parent / checkpointing.LATEST).write_text(path.name + "\n")
    return path


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_names_a_truncated_or_tampered_file(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 2)
    assert checkpointing.verify(ckpt) is None
    shard = ckpt / "__0_0.distcp"
    original = shard.read_bytes()
    flip_a_byte(shard)  # same size: only the checksum sees it
    assert checkpointing.verify(ckpt, checksums=False) is None
    assert checkpointing.verify(ckpt) == f"{shard} does not match its sha256 in the manifest (corrupted or modified)"
    truncate(shard)
    assert str(shard) in checkpointing.verify(ckpt) and "has 100 bytes" in checkpointing.verify(ckpt)
    shard.write_bytes(original)
    (ckpt / "manifest.json").unlink()
    assert "manifest.json is missing" in checkpointing.verify(ckpt)


def test_auto_resume_skips_broken_and_foreign_checkpoints(tmp_path, capsys):
    fake_checkpoint(tmp_path, 2)
    good = fake_checkpoint(tmp_path, 4)
    truncate(fake_checkpoint(tmp_path, 6) / "__0_0.distcp")
    fake_checkpoint(tmp_path, 8, "model.hidden_size=64")
    (tmp_path / "checkpoints" / "step_00000010.tmp").mkdir()  # an interrupted save
    recipe = recipe_for(tmp_path)
    assert checkpointing._resume_target(recipe, checkpointing._model_identity(recipe, TOKENIZER)) == good
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "step_00000008/train_state.json is for another model: hidden_size 64 there" in out[0]
    assert "step_00000006/__0_0.distcp has 100 bytes" in out[1]


def test_a_run_dir_of_another_model_is_refused_and_a_bad_explicit_path_named(tmp_path):
    fake_checkpoint(tmp_path, 8, "model.hidden_size=64")
    recipe = recipe_for(tmp_path)
    model = checkpointing._model_identity(recipe, TOKENIZER)
    with pytest.raises(UserError, match="holds checkpoints of another model .*hidden_size 64 there, 128 here"):
        checkpointing._resume_target(recipe, model)
    broken = fake_checkpoint(tmp_path, 9)
    flip_a_byte(broken / "train_state.json")
    with pytest.raises(UserError) as err:
        checkpointing._resume_target(recipe_for(tmp_path, f"checkpoint.resume={broken}"), model)
    assert f"cannot load {broken}: {broken / 'train_state.json'} does not match its sha256" in str(err.value)
    assert "\n" not in str(err.value)


def test_retention_keeps_the_checkpoint_just_published(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    root = tmp_path / "checkpoints"
    # keep_last_n=1 keeps step 8 (newest); the re-published step 4 survives too; 2 goes, 6 is a multiple of 3
    checkpointing._apply_retention(recipe_for(tmp_path, "checkpoint.keep_last_n=1",
                                              "checkpoint.keep_every_n_steps=3"), root, keep=root / "step_00000004")
    assert [p.name for p in checkpointing.find_checkpoints(root)] == ["step_00000008", "step_00000006", "step_00000004"]


def test_preflight_refuses_an_unwritable_or_full_checkpoint_dir(tmp_path, monkeypatch):
    checkpointing.preflight(recipe_for(tmp_path / "run"))
    assert (tmp_path / "run").is_dir() and not list((tmp_path / "run").iterdir())
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"checkpoint.dir .*/file/run is not writable: Not a directory"):
        checkpointing.preflight(recipe_for(tmp_path / "file" / "run"))
    monkeypatch.setattr(checkpointing.shutil, "disk_usage", lambda _: SimpleNamespace(free=2**20))
    with pytest.raises(UserError, match=r"has 0.00 GiB free; a checkpoint of this model needs about 0.0[1-9] GiB"):
        checkpointing.preflight(recipe_for(tmp_path / "run"))


def test_checkpoint_inspect_command(tmp_path, capsys):
    fake_checkpoint(tmp_path, 2)
    truncate(fake_checkpoint(tmp_path, 4) / "__0_0.distcp")
    (tmp_path / "checkpoints" / "step_00000006.tmp").mkdir()
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step_00000004  INVALID: ") and "__0_0.distcp has 100 bytes" in lines[0]
    assert lines[0].endswith("<- latest")
    assert lines[1] == ("step_00000002  valid  | step 2, recipe tiny-cpu, tp 1 pp 1 vpp 1 dp 1, distributed "
                        "optimizer, tokenizer vocab 2048 mask id 3")
    assert lines[2].startswith("step_00000006.tmp  partial save")
    assert main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"setdiff: error: no checkpoints under {tmp_path / 'nothing'}"


@pytest.fixture
def restore_handlers():
    previous = {s: signal.getsignal(s) for s in signals.PREEMPTION_SIGNALS}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


def test_preemption_handler_records_and_restores(tmp_path, restore_handlers):
    before = signal.getsignal(signal.SIGTERM)
    with signals.PreemptionHandler(tmp_path) as quiet:
        assert not quiet.agreed()
    assert signal.getsignal(signal.SIGTERM) is before
    with signals.PreemptionHandler(tmp_path) as handler:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: still the first one on record
        assert handler.agreed() and handler.received is signal.SIGUSR1
        stop = handler.stop(7, tmp_path / "step_00000007")
    # the process is exiting with EXIT_REQUEUE now: later signals are ignored, not fatal
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert stop.exit_code == signals.EXIT_REQUEUE == 75 and "stopped at step 7 by SIGUSR1" in str(stop)
    assert json.loads((tmp_path / signals.PREEMPTED_FILE).read_text())["step"] == 7


def test_signals_stay_pending_during_a_save_and_child_processes_inherit_the_block(tmp_path, restore_handlers):
    probe = "import signal; print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))"
    with signals.PreemptionHandler(tmp_path) as handler:
        with signals.blocked():
            os.kill(os.getpid(), signal.SIGTERM)
            child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        assert handler.received is signal.SIGTERM
    blocked_in_child = json.loads(child.stdout)
    assert all(int(s) in blocked_in_child for s in signals.PREEMPTION_SIGNALS)


def test_supervised_launch_reports_a_preempted_worker_as_75(tmp_path, restore_handlers):
    def preempted_workers() -> int:
        os.kill(os.getpid(), signal.SIGTERM)  # the whole process group is signalled: the parent waits on
        (tmp_path / signals.PREEMPTED_FILE).write_text("{}")
        return 1  # what torchrun reports for any failed worker

    assert signals.supervise_launch(tmp_path, preempted_workers) == signals.EXIT_REQUEUE
    assert signals.supervise_launch(tmp_path, lambda: 1) == 1  # the earlier launch's record is gone


def test_a_model_field_added_later_counts_as_its_default(tmp_path):
    """A checkpoint saved before ModelConfig gained a field (qkv_bias) is the same model when this
    run uses the field's default, and another model when it does not."""
    (tmp_path / checkpointing.TRAIN_STATE).write_text(json.dumps({"model": {"hidden_size": 64}}))
    assert checkpointing._model_difference(tmp_path, {"hidden_size": 64, "qkv_bias": False}) is None
    assert "qkv_bias False there, True here" in checkpointing._model_difference(
        tmp_path, {"hidden_size": 64, "qkv_bias": True})
