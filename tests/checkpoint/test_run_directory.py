"""Checkpoint bookkeeping without training: manifests, selection, retention, pre-flight, inspect.

Checkpoints here are stand-ins (a few files, a train_state.json, a manifest) so each test runs
in milliseconds; tests/training/test_checkpoint_runs.py and test_checkpoint_safety.py do the
same things to real training runs.
"""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from setdiff_megatron.checkpoint import publish as publish_module
from setdiff_megatron.checkpoint.identity import identity_difference, model_identity
from setdiff_megatron.checkpoint.manifest import verify, write_manifest
from setdiff_megatron.checkpoint.names import CHECKPOINTS, LATEST, TRAIN_STATE, find_checkpoints
from setdiff_megatron.checkpoint.publish import Retention, apply_retention
from setdiff_megatron.checkpoint.resolve import resume_target
from setdiff_megatron.checkpoint.state import Progress, TrainState, read_train_state, write_train_state
from setdiff_megatron.cli import main
from setdiff_megatron.errors import UserError
from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.training.preflight import check_run

TINY = str(Path(__file__).parents[2] / "recipes" / "tiny-cpu.yaml")
TOKENIZER = SimpleNamespace(vocab_size=2048, mask_id=3)
LAYOUT = {"tp": 1, "pp": 1, "vpp": None, "cp": 1, "ep": 1, "dp": 1, "world_size": 1, "distributed_optimizer": True}


def recipe_for(run_dir: Path, *overrides: str):
    return load_recipe(TINY, [f"checkpoint.dir={run_dir}", *overrides])


def identity_of(*model_overrides: str) -> dict:
    recipe = recipe_for(Path("."), *model_overrides)
    return model_identity(
        recipe.model.to_model_config(vocab_size=TOKENIZER.vocab_size, mask_token_id=TOKENIZER.mask_id)
    )


def fake_checkpoint(run_dir: Path, step: int, *model_overrides: str, run_id: str = "run-a") -> Path:
    """A published checkpoint as the trainer lays it out, minus the tensors' real contents."""
    recipe = recipe_for(run_dir, *model_overrides)
    path = run_dir / CHECKPOINTS / f"step_{step:08d}"
    (path / "tokenizer").mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(os.urandom(4096))
    (path / "tokenizer" / "tokenizer.json").write_text("{}")
    (path / "recipe.yaml").write_text(f"name: {recipe.name}\n")
    write_train_state(
        path,
        TrainState(
            progress=Progress(step, 8 * step),
            scheduler={},
            layout=LAYOUT,
            model=identity_of(*model_overrides),
            run_id=run_id,
            tokenizer={"vocab_size": TOKENIZER.vocab_size, "mask_id": TOKENIZER.mask_id},
        ),
    )
    write_manifest(path)
    (path.parent / LATEST).write_text(path.name + "\n")
    return path


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_names_a_truncated_or_tampered_file(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 2)
    assert verify(ckpt) is None
    shard = ckpt / "__0_0.distcp"
    original = shard.read_bytes()
    flip_a_byte(shard)  # same size: only the checksum sees it
    assert verify(ckpt, checksums=False) is None
    assert verify(ckpt) == f"{shard} does not match its sha256 in the manifest (damaged or modified)"
    truncate(shard)
    assert str(shard) in verify(ckpt) and "has 100 bytes" in verify(ckpt)
    shard.write_bytes(original)
    (ckpt / "manifest.json").unlink()
    assert "manifest.json is missing" in verify(ckpt)


def test_auto_resume_skips_broken_and_foreign_checkpoints(tmp_path, capsys):
    fake_checkpoint(tmp_path, 2)
    good = fake_checkpoint(tmp_path, 4)
    truncate(fake_checkpoint(tmp_path, 6) / "__0_0.distcp")
    fake_checkpoint(tmp_path, 8, "model.hidden_size=64")
    (tmp_path / "checkpoints" / "step_00000010.tmp").mkdir()  # an interrupted save
    assert resume_target(tmp_path, "auto", identity_of()).path == good
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "step_00000008/train_state.json is for another model: hidden_size 64 there" in out[0]
    assert "step_00000006/__0_0.distcp has 100 bytes" in out[1]


def test_a_run_dir_of_another_model_is_refused_and_a_bad_explicit_path_named(tmp_path):
    fake_checkpoint(tmp_path, 8, "model.hidden_size=64")
    model = identity_of()
    with pytest.raises(UserError, match="holds checkpoints, and none can be resumed") as err:
        resume_target(tmp_path, "auto", model)
    assert "step_00000008: " in str(err.value) and "is for another model: hidden_size 64 there, 128 here" in str(
        err.value
    )
    assert "checkpoint.allow_model_change=true" in str(err.value)
    broken = fake_checkpoint(tmp_path, 9)
    flip_a_byte(broken / "train_state.json")
    with pytest.raises(UserError) as err:
        resume_target(tmp_path, str(broken), model)
    assert f"cannot load {broken}: {broken / 'train_state.json'} does not match its sha256" in str(err.value)
    assert "\n" not in str(err.value)


def test_every_checkpoint_unusable_stops_with_one_line_naming_each(tmp_path):
    """The issue-19 case: every train_state.json damaged, the weights intact."""
    for step in (150, 300):
        ckpt = fake_checkpoint(tmp_path, step)
        (ckpt / TRAIN_STATE).write_text("{not json")
        write_manifest(ckpt)  # a damage the manifest does not see: the file itself is unreadable
    with pytest.raises(UserError) as err:
        resume_target(tmp_path, "auto", identity_of())
    (line,) = str(err.value).splitlines()
    assert "none can be resumed (step_00000300: " in line and "train_state.json is damaged" in line
    assert line.index("step_00000300: ") < line.index("; step_00000150: ") < line.index("checkpoint.resume=none")


def test_resume_none_moves_every_checkpoint_aside(tmp_path, capsys):
    kept = [fake_checkpoint(tmp_path, step) for step in (2, 4)]
    truncate(kept[1] / "__0_0.distcp")
    before = {
        p.relative_to(kept[0].parent).parts[1:]: p.read_bytes() for c in kept for p in c.rglob("*") if p.is_file()
    }
    assert resume_target(tmp_path, "none", identity_of()) is None
    assert find_checkpoints(tmp_path / CHECKPOINTS) == []
    aside = sorted(p for p in (tmp_path / CHECKPOINTS).iterdir() if ".aside-" in p.name)
    assert [p.name.split(".")[0] for p in aside] == ["step_00000002", "step_00000004"]
    after = {p.relative_to(a).parts: p.read_bytes() for a in aside for p in a.rglob("*") if p.is_file()}
    assert sorted(after.values()) == sorted(before.values())  # every byte kept
    assert capsys.readouterr().out.count("(nothing deleted)") == 2


def test_a_damaged_train_state_is_one_line_naming_the_file(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 2)
    assert read_train_state(ckpt).progress == Progress(2, 16, 0)
    (ckpt / TRAIN_STATE).write_text("[]")
    with pytest.raises(UserError, match=r"train_state.json is damaged \(no JSON object\)"):
        read_train_state(ckpt)
    (ckpt / TRAIN_STATE).unlink()
    with pytest.raises(UserError, match="train_state.json is missing"):
        read_train_state(ckpt)


def test_retention_removes_only_this_runs_valid_older_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    foreign = fake_checkpoint(tmp_path, 3, run_id="run-b")
    broken = fake_checkpoint(tmp_path, 1)
    truncate(broken / "__0_0.distcp")
    root = tmp_path / "checkpoints"
    # keep_last_n=1 keeps step 8 (the newest valid); 6 is a multiple of 3; 4 and 2 go. Another
    # run's checkpoint and an invalid one are never touched.
    removed = apply_retention(root, "run-a", Retention(keep_last_n=1, keep_every_n_steps=3))
    assert sorted(p.name for p in removed) == ["step_00000002", "step_00000004"]
    assert [p.name for p in find_checkpoints(root)] == ["step_00000008", "step_00000006", foreign.name, broken.name]


def test_check_run_refuses_an_unwritable_or_full_checkpoint_dir(tmp_path, monkeypatch):
    check_run(recipe_for(tmp_path / "run"), "r.yaml")
    assert (tmp_path / "run").is_dir() and not list((tmp_path / "run").iterdir())
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"checkpoint.dir .*/file/run is not writable: Not a directory"):
        check_run(recipe_for(tmp_path / "file" / "run"), "r.yaml")
    monkeypatch.setattr(publish_module.shutil, "disk_usage", lambda _: SimpleNamespace(free=2**20))
    with pytest.raises(UserError, match=r"has 0.00 GiB free; a checkpoint of this model needs about 0.0[1-9] GiB"):
        check_run(recipe_for(tmp_path / "run"), "r.yaml")


def test_checkpoint_inspect_command(tmp_path, capsys):
    fake_checkpoint(tmp_path, 2)
    truncate(fake_checkpoint(tmp_path, 4) / "__0_0.distcp")
    (tmp_path / "checkpoints" / "step_00000006.tmp").mkdir()
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step_00000004  INVALID: ") and "__0_0.distcp has 100 bytes" in lines[0]
    assert lines[0].endswith("<- latest")
    assert lines[1] == (
        "step_00000002  valid  | step 2, recipe tiny-cpu, tp 1 pp 1 vpp 1 dp 1, distributed "
        "optimizer, tokenizer vocab 2048 mask id 3"
    )
    assert lines[2].startswith("step_00000006.tmp  partial save")
    assert main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"setdiff: error: no checkpoints under {tmp_path / 'nothing'}"


def test_a_model_field_added_later_counts_as_its_default(tmp_path):
    """A checkpoint saved before ModelConfig gained a field (qkv_bias) is the same model when this
    run uses the field's default, and another model when it does not."""
    saved = {"hidden_size": 64}
    assert identity_difference(saved, {"hidden_size": 64, "qkv_bias": False}) is None
    assert "qkv_bias False there, True here" in identity_difference(saved, {"hidden_size": 64, "qkv_bias": True})
