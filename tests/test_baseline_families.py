"""The paper's baselines, MDLM and BD3-LM (recipe method.family), through every entry point: a short
`setdiff train` whose validation loss falls, then `setdiff sample`, `setdiff serve` and the Hugging
Face export's own generate() decoding with the family's decoder and policy (blocks, threshold
0.9), each giving what the decoder gives on the loaded model, and a round trip back through
`convert from-hf` that keeps the family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from setdiff_megatron.distributed.runtime import Ranks
from setdiff_megatron.inference.prompts import encode_prompt, read_prompts
from setdiff_megatron.inference.sampling_model import load_sampling_model
from setdiff_megatron.sources.read import read_source
from tests.cli_runs import setdiff
from tests.hf.clean_env import run_clean

pytestmark = pytest.mark.multiproc

REPO = Path(__file__).resolve().parents[1]
FAMILIES = {"mdlm": [], "bd3lm": ["method.block_size=4"]}
PROMPT = "def main("
NEW = 12


class _FamilyRuns(dict):
    """16 steps of the tiny recipe as a baseline, one process, trained when a test first asks for
    the family (the slow run asks for MDLM alone)."""

    def __init__(self, base: Path, data: Path):
        super().__init__()
        self.base, self.data = base, data

    def __missing__(self, family: str) -> Path:
        run = self.base / family
        setdiff(
            "train",
            "recipes/tiny-cpu.yaml",
            f"method.family={family}",
            *FAMILIES[family],
            f"checkpoint.dir={run}",
            f"data.cache_dir={self.data}",
            "launch.nproc_per_node=1",
            "parallel.global_batch_size=8",
            "train.steps=16",
            "eval.interval=8",
            "checkpoint.interval=16",
            "log.tensorboard=false",
        )
        self[family] = run
        return run


@pytest.fixture(scope="session")
def family_runs(tmp_path_factory) -> dict[str, Path]:
    return _FamilyRuns(tmp_path_factory.mktemp("families"), tmp_path_factory.getbasetemp() / "checkpoint-tests-data")


def _direct(run: Path, prompt: str) -> tuple[str, dict]:
    """The family's decoder on the loaded model, at its policy: the reference every entry point must give."""
    sm = load_sampling_model(run, Ranks(), device="cpu")
    cfg = sm.decoding.with_settings({"max_new_tokens": NEW, "eos_token_ids": (sm.tokenizer.eos_id,)})
    row = sm.sampler().generate([sm.prompt_format().prompt(sm.tokenizer.encode(prompt)).tolist()], cfg).rows[0]
    return sm.tokenizer.decode(row.completion, skip_special_tokens=True), {"steps": row.steps, "nfe": row.nfe}


@pytest.mark.parametrize("family", FAMILIES)
def test_training_lowers_the_validation_loss(family_runs, family):
    rows = [json.loads(line) for line in (family_runs[family] / "logs" / "metrics.jsonl").read_text().splitlines()]
    valid = [r["valid/loss"] for r in rows if "valid/loss" in r]
    assert len(valid) == 3 and valid[-1] < valid[0] - 0.3, valid
    source = read_source(family_runs[family], weights=False)
    assert source.family == family and source.decoding.threshold == 0.9
    assert source.decoding.block_size == (4 if family == "bd3lm" else 32)


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_decodes_with_the_familys_decoder_and_policy(family_runs, family, tmp_path):
    run = family_runs[family]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": PROMPT}) + "\n")
    setdiff("sample", str(run), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"),
             "--max-new-tokens", str(NEW), "--no-progress")  # fmt: skip
    (row,) = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    text, counts = _direct(run, PROMPT)
    assert row["completion"] == text and (row["steps"], row["nfe"]) == (counts["steps"], counts["nfe"])
    job = json.loads((tmp_path / "o.jsonl.job.json").read_text())
    assert job["decoding"]["block_size"] == (4 if family == "bd3lm" else 32)
    assert job["decoding"]["cache_infill_input"] is False  # nothing to infill: recorded off


def test_sample_infills_bd3lm_with_the_cached_input_of_its_policy(family_runs, tmp_path):
    run = family_runs["bd3lm"]
    (tmp_path / "p.jsonl").write_text(json.dumps({"segments": [PROMPT, 6, "):\n    return x"]}) + "\n")
    setdiff("sample", str(run), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl"),
             "--max-new-tokens", "0", "--no-progress")  # fmt: skip
    (row,) = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert json.loads((tmp_path / "o.jsonl.job.json").read_text())["decoding"]["cache_infill_input"] is True
    sm = load_sampling_model(run, Ranks(), device="cpu")
    (record,) = read_prompts(tmp_path / "p.jsonl")
    ids = encode_prompt(record, sm.tokenizer, sm.prompt_format())
    direct = sm.sampler().generate([ids], sm.decoding.with_settings({"max_new_tokens": 0})).rows[0]
    assert sm.decoding.cache_infill_input and row["steps"] == direct.steps and row["nfe"] == direct.nfe
    fill = [direct.tokens[i] for i, t in enumerate(ids) if t == sm.tokenizer.mask_id]
    assert row["infills"] == [sm.tokenizer.decode(fill)]


def test_sample_records_cache_infill_input_off_where_it_cannot_act(family_runs, tmp_path):
    """MDLM sees both sides anyway: `--cache-infill-input` is recorded off, so the job matches (and
    resumes) one saved without it instead of refusing it as another decoding."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"segments": [PROMPT, 6, "):\n    return x"]}) + "\n")
    args = ["sample", str(family_runs["mdlm"]), "--prompts", str(tmp_path / "p.jsonl"),
            "--out", str(tmp_path / "o.jsonl"), "--max-new-tokens", "0", "--no-progress"]  # fmt: skip
    setdiff(*args, "--no-cache-infill-input")
    saved = (tmp_path / "o.jsonl").read_bytes()
    assert "1 already written" in setdiff(*args, "--cache-infill-input").stderr  # the same job: resumed
    assert (tmp_path / "o.jsonl").read_bytes() == saved
    assert json.loads((tmp_path / "o.jsonl.job.json").read_text())["decoding"]["cache_infill_input"] is False


@pytest.mark.parametrize("family", FAMILIES)
def test_serve_decodes_with_the_familys_decoder(family_runs, family):
    pytest.importorskip("openai", reason="the serving tests use the openai client (part of the dev extra)")
    from setdiff_megatron.serving.live_server import LiveServer

    live = LiveServer(family_runs[family], model_name="m")
    try:
        r = live.client.completions.create(model="m", prompt=PROMPT, max_tokens=NEW, temperature=0)
    finally:
        live.stop()
    assert r.choices[0].text == _direct(family_runs[family], PROMPT)[0]


# MDLM's export runs with the slow tests (CI runs both): the default suite's time goes to BD3-LM's.
@pytest.mark.parametrize("family", [pytest.param("mdlm", marks=pytest.mark.slow), "bd3lm"])
def test_the_hf_export_generates_as_the_family_and_imports_back(family_runs, family, clean_site, tmp_path):
    run = family_runs[family]
    setdiff("convert", "to-hf", str(run), str(tmp_path / "hf"), "--check")  # the family's logits, equal
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["family"] == family and config.get("block_size") == (4 if family == "bd3lm" else None)
    # An export written before cache_infill_input and align_inputs_to_blocks existed: both entry points
    # read the family's own policy.
    shutil.copytree(tmp_path / "hf", tmp_path / "old")
    generation = json.loads((tmp_path / "old" / "generation_config.json").read_text())
    assert generation.pop("cache_infill_input") is (family == "bd3lm")
    assert generation.pop("align_inputs_to_blocks") is False  # the paper's throughput scripts' placement
    assert generation.pop("block_size") == generation.pop("window") == (4 if family == "bd3lm" else 32)
    (tmp_path / "old" / "generation_config.json").write_text(json.dumps(generation))
    policy = read_source(tmp_path / "hf", weights=False).decoding
    assert read_source(tmp_path / "old", weights=False).decoding == policy
    (tmp_path / "old" / "generation_config.json").rename(tmp_path / "generation_config.json")
    bare = read_source(tmp_path / "old", weights=False).decoding  # no generation config: the family's policy
    keys = ("block_size", "window", "threshold", "cache_infill_input", "align_inputs_to_blocks")
    assert [getattr(bare, k) for k in keys] == [getattr(policy, k) for k in keys]
    (tmp_path / "generation_config.json").rename(tmp_path / "old" / "generation_config.json")
    sm = load_sampling_model(run, Ranks(), device="cpu")
    ids = sm.prompt_format().prompt(sm.tokenizer.encode(PROMPT)).tolist()
    script = f"""
import json
from dataclasses import asdict
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r}, trust_remote_code=True)
row = model.generate([{ids!r}], max_new_tokens={NEW}, return_dict_in_generate=True).rows[0]
old = AutoModelForCausalLM.from_pretrained({str(tmp_path / "old")!r}, trust_remote_code=True)
same = asdict(old.decoding_config()) == asdict(model.decoding_config())  # each export's own classes
print(json.dumps({{"tokens": row.tokens, "steps": row.steps, "same": same}}))
"""
    result = run_clean(script, clean_site, tmp_path / "clean")
    assert result["same"]
    cfg = sm.decoding.with_settings({"max_new_tokens": NEW, "eos_token_ids": (sm.tokenizer.eos_id,)})
    row = sm.sampler().generate([ids], cfg).rows[0]
    assert (result["tokens"], result["steps"]) == (row.tokens, row.steps)
    setdiff("convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "back"))
    back = read_source(tmp_path / "back", weights=False)
    assert back.family == family and back.decoding == read_source(run, weights=False).decoding


def test_likelihood_of_a_baseline_is_refused_in_one_line(family_runs, tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "x = 1"}) + "\n")
    proc = setdiff("eval", "likelihood", str(family_runs["bd3lm"]), "--data", str(tmp_path / "d.jsonl"),
                    "--out", str(tmp_path / "out"), check=False)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is a bd3lm model" in proc.stderr, proc.stderr
