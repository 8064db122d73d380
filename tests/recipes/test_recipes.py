"""Recipes: every shipped recipe validates; malformed ones fail with one line and exit code 2."""

from pathlib import Path

import pytest
import yaml

from setdiff_megatron.cli import main
from setdiff_megatron.recipes import Recipe, RecipeError, load_recipe, save_resolved_recipe, validate_recipe
from tests.cli_runs import setdiff

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml")) + sorted(
    p for p in (Path(__file__).parents[2] / "recipes" / "study").rglob("*.yaml") if p.name not in ("data.yaml",)
)
TINY = Path(__file__).parents[2] / "recipes" / "tiny-cpu.yaml"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    # Paper-scale recipes name GPUs and data that are not on this machine: check the recipe itself.
    assert validate_recipe(recipe, has_gpu=True, check_paths=False) == []
    if recipe.launch.device == "cpu" and recipe.model.init_from is None:  # else it needs a model made first
        assert validate_recipe(recipe) == []


REFERENCE_TRAINING = {  # ref-baselines.md §5.1 and the reference's composer configs
    "gsm8k-qwen3-1.7b.yaml": ((0.9, 0.98), 1e-5),
    "cnndm-qwen3-shaped.yaml": ((0.9, 0.98), 1e-5),
    "lm1b.yaml": ((0.9, 0.999), 0.0),
    "owt-110m.yaml": ((0.9, 0.999), 0.0),
    "owt-110m-d4.yaml": ((0.9, 0.999), 0.0),
    "owt-110m-d16.yaml": ((0.9, 0.999), 0.0),
}


@pytest.mark.parametrize("name", REFERENCE_TRAINING)
def test_paper_recipes_train_with_the_references_semantics(name):
    """Loss per row, composer's DecoupledAdamW with the reference's betas, eps and weight decay,
    clipping at 1 and an EMA of 0.9999; the small recipes keep megatron's defaults."""
    t = load_recipe(TINY.parent / name).train
    betas, weight_decay = REFERENCE_TRAINING[name]
    assert (t.loss_normalization, t.optimizer, t.ema_decay) == ("per_row", "decoupled_adamw", 0.9999)
    assert (t.betas, t.eps, t.weight_decay, t.clip_grad) == (betas, 1e-8, weight_decay, 1.0)
    for small in ("tiny-cpu.yaml", "tiny-reasoning.yaml", "tiny-moe-cpu.yaml"):
        t = load_recipe(TINY.parent / small).train
        assert (t.loss_normalization, t.optimizer, t.ema_decay) == ("per_token", "adamw", None)


def test_inheritance_and_overrides_resolve_as_documented(tmp_path, monkeypatch):
    d4 = load_recipe(RECIPES[0].parent / "owt-110m-d4.yaml")
    base = load_recipe(RECIPES[0].parent / "owt-110m.yaml")
    assert d4.method.d == 4 and base.method.d == 8
    assert d4.model == base.model and d4.parallel == base.parallel  # everything else inherited
    monkeypatch.setenv("DATA_DIR", "/data/x")
    r = load_recipe(
        RECIPES[0].parent / "owt-110m-d4.yaml", ["train.lr=1e-4", "parallel.tp=2", "method.keep_clean_bos=false"]
    )
    assert r.train.lr == 1e-4 and r.parallel.tp == 2 and r.method.keep_clean_bos is False
    assert r.data.datasets[0].path == "/data/x/owt/openwebtext_text_document"
    # The resolved recipe saved next to a run reloads to the same object.
    saved = save_resolved_recipe(r, tmp_path)
    assert load_recipe(saved) == r


def test_list_base_merges_left_to_right(tmp_path):
    (tmp_path / "a.yaml").write_text("train: {lr: 0.1, steps: 5}\n")
    (tmp_path / "b.yaml").write_text("train: {lr: 0.2}\n")
    (tmp_path / "c.yaml").write_text("base: [a.yaml, b.yaml]\nname: c\n")
    r = load_recipe(tmp_path / "c.yaml")
    assert (r.train.lr, r.train.steps, r.name) == (0.2, 5, "c")


def write(tmp_path, text: str, name="r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# (recipe text or None for tiny-cpu, overrides, expected fragment of the one-line message)
MALFORMED = [
    (None, ["train.lrr=3"], "train.lrr: unknown key; did you mean 'lr'?"),
    (None, ["model.hiden_size=64"], "did you mean 'hidden_size'"),
    (None, ["paralel.tp=2"], "paralel: unknown key; did you mean 'parallel'"),
    (None, ["data.datasets=[{path: stdlib, wieght: 2}]"], "data.datasets.0.wieght: unknown key"),
    (None, ["train.lr=fast"], "train.lr: Input should be a valid number"),
    (None, ["train.lr=-1"], "train.lr: Input should be greater than 0"),
    (None, ["parallel.tp=0"], "parallel.tp: Input should be greater than 0"),
    (None, ["parallel.tp=two"], "parallel.tp: Input should be a valid integer"),
    (None, ["train.precision=fp12"], "train.precision: Input should be"),
    (None, ["engine=jax"], "engine: Input should be 'megatron' or 'deepspeed'"),
    (None, ["method.order=random"], "method.order"),
    (None, ["model.num_heads=3"], "model: hidden_size (128) must be divisible by num_heads (3)"),
    (None, ["model.num_kv_heads=3"], "multiple of num_kv_heads"),
    (None, ["model.attention_impl=flash9"], "attention_impl must be one of"),
    (None, ["model.norm=batchnorm"], "norm must be one of ['rmsnorm', 'layernorm']"),
    (None, ["model.output_bias=true"], "output_bias needs tie_embeddings: false"),
    (None, ["model.adaln=true"], "adaln is the reference DiT's: it needs norm: layernorm, a dense model"),
    (None, ["model.norm=layernorm", "model.backend=te"], "model.backend: the 'te' backend holds norm: rmsnorm"),
    (None, ["train.decay_fraction=1.5"], "train.decay_fraction"),
    (None, ["parallel.tp=3"], "parallel.tp: 3 must divide model.num_heads"),
    (None, ["parallel.pp=3"], "parallel.pp: pp x vpp = 3 must divide model.num_layers"),
    (None, ["parallel.tp=4"], "does not divide the 2 processes"),
    (None, ["parallel.global_batch_size=12"], "must be a multiple of micro_batch_size x data-parallel size"),
    (None, ["parallel.sequence_parallel=true"], "parallel.sequence_parallel: needs parallel.tp > 1"),
    (None, ["parallel.vpp=2"], "parallel.vpp: virtual pipeline stages need parallel.pp > 1"),
    (None, ["method.d=8", "method.m=4"], "method.d: d (8) must be <= m (4)"),
    (None, ["method.d=100"], "method.m: m (200) must be <= the sequence length (128)"),
    (None, ["method.order=block"], "method.block_size: the block order needs a block size"),
    (None, ["data.seq_len=512"], "data.seq_len: 512 exceeds model.max_seq_len"),
    (None, ["train.tokens=1000"], "set exactly one of train.steps and train.tokens"),
    (None, ["train.min_lr=1.0"], "train.min_lr"),
    (None, ["train.fp8=hybrid"], "train.fp8: FP8 needs model.backend: te"),
    (None, ["model.backend=te"], "model.backend: te (Transformer Engine) needs a GPU"),
    (
        None,
        ["model.attention_impl=te"],
        "model.attention_impl: te (Transformer Engine) needs a GPU; use model.attention_impl=auto here",
    ),
    (
        None,
        ["model.attention_impl=flash_attn"],
        "model.attention_impl: flash_attn (flash-attn) needs a GPU; use model.attention_impl=auto here",
    ),
    (None, ["engine=deepspeed", "parallel.tp=2"], "the deepspeed engine is data-parallel"),
    (None, ["parallel.cp=2", "data.seq_len=126"], "parallel.cp: each stream is split into 2 x cp = 4 chunks"),
    (None, ["parallel.cp=2", "engine=deepspeed"], "parallel.cp: context parallelism is a megatron-engine feature"),
    (None, ["parallel.cp=4"], "tp x pp x cp = 4 does not divide the 2 processes"),
    (None, ["model.num_experts=6", "parallel.ep=4"], "parallel.ep: 4 must divide model.num_experts (6)"),
    (None, ["model.num_experts=4", "model.moe_top_k=5"], "moe_top_k must lie in [1, num_experts=4]"),
    (None, ["model.num_experts=4", "model.moe_top_k=1"], "moe_top_k = 1 needs moe_router_pre_softmax"),
    (None, ["model.num_experts=4", "model.moe_layer_freq=[1, 0]"], "moe_layer_freq as a list needs num_layers=4"),
    (None, ["model.num_experts=4", "model.moe_capacity_factor=0"], "moe_capacity_factor must be > 0"),
    (None, ["parallel.ep=2"], "parallel.ep: expert parallelism needs a mixture of experts"),
    (
        None,
        ["model.num_experts=4", "parallel.ep=2", "engine=deepspeed"],
        "parallel.ep: expert parallelism is a megatron-engine",
    ),
    (
        None,
        ["model.num_experts=4", "parallel.ep=4"],
        "parallel.ep: 4 must divide the data- x context-parallel size (2 x 1)",
    ),
    (None, ["model.num_experts=4", "parallel.tp=2"], "megatron-core trains MoE layers under tp > 1 only with sequence"),
    (None, ["data.datasets=[{path: /nonexistent/corpus}]"], "data.datasets.0.path: no indexed dataset"),
    (
        None,
        ["data.datasets=[{path: stdlib, format: supervised}]"],
        "data.datasets.0.format: the built-in corpus 'stdlib' has no supervised records",
    ),
    (
        None,
        ["data.datasets=[{path: /x/a, format: supervised}, {path: /x/b}]"],
        "data.datasets: a blend mixes pretraining and supervised datasets",
    ),
    (
        None,
        ["data.datasets=[{path: reasoning, format: supervised}]", "data.document_mask=true"],
        "data.document_mask: applies to packed pretraining windows",
    ),
    (
        None,
        ["data.datasets=[{path: reasoning, format: supervised}]", "data.supervised.max_prompt_tokens=128"],
        "data.supervised.max_prompt_tokens: 128 leaves no room for a response in data.seq_len (128)",
    ),
    (None, ["data.supervised.layout=ragged"], "data.supervised.layout: Input should be 'padded' or 'packed'"),
    (
        None,
        ["engine=deepspeed", "checkpoint.async_save=true"],
        "checkpoint.async_save: the deepspeed engine saves synchronously",
    ),
    (None, ["data.datasets=[{path: reasoning, format: sft}]"], "data.datasets.0.format: Input should be"),
    (None, ["train.ema_decay=1.5"], "train.ema_decay: the EMA decay must be in (0, 1), e.g. 0.9999; 0 or null"),
    (None, ["train.ema_decay=-0.5"], "train.ema_decay: the EMA decay must be in (0, 1)"),
    (None, ["train.loss_normalization=per_sample"], "train.loss_normalization: Input should be 'per_token' or"),
    (None, ["train.optimizer=decoupled"], "train.optimizer: Input should be 'adamw', 'decoupled_adamw' or 'sgd'"),
    (
        None,
        ["train.loss_normalization=per_row", "model.num_experts=4"],
        "train.loss_normalization: per_row with a mixture of experts is not supported",
    ),
    (
        None,
        ["engine=deepspeed", "parallel.zero_stage=3", "parallel.distributed_optimizer=false", "train.ema_decay=0.9"],
        "train.ema_decay: the average of the weights is not kept under ZeRO-3",
    ),
    (None, ["data.tokenizer=/nonexistent/tok"], "data.tokenizer: /nonexistent/tok does not exist"),
    (None, ["checkpoint.resume=/nonexistent/ckpt"], "checkpoint.resume"),
    (None, ["train"], "expected dotted.key=value"),
    (None, ["launch.env=notamap"], "launch.env: Input should be a valid dictionary"),
    ("train: [1, 2\n", [], "is not valid YAML"),
    ("- a\n- b\n", [], "a recipe must be a mapping"),
    ("base: missing.yaml\n", [], "base: missing.yaml not found"),
    ("base: r.yaml\n", [], "circular base: r.yaml -> r.yaml"),
    (
        "data: {datasets: [{path: '${env:SETDIFF_SURELY_UNSET}'}]}\n",
        [],
        "environment variable SETDIFF_SURELY_UNSET is not set",
    ),
    ("base: 3\n", [], "base: must be a path or a list of paths"),
]


@pytest.mark.parametrize("text,overrides,fragment", MALFORMED, ids=[m[2][:40] for m in MALFORMED])
def test_malformed_recipe_gives_one_line_and_exit_2(tmp_path, capsys, text, overrides, fragment):
    path = TINY if text is None else write(tmp_path, text)
    assert main(["recipe", "validate", str(path), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert fragment in err, err
    assert str(path) in err or "override" in err


@pytest.mark.multiproc
def test_cli_error_has_no_traceback_in_a_real_process(tmp_path):
    out = setdiff("recipe", "validate", TINY, "train.lrr=1", check=False)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "did you mean 'lr'" in out.stderr


def test_missing_engine_extra_names_the_pip_extra(monkeypatch):
    import importlib.util

    from setdiff_megatron.recipes import check_engine_installed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(RecipeError, match=r"pip install 'setdiff-megatron\[deepspeed\]'"):
        check_engine_installed(load_recipe(TINY, ["engine=deepspeed"]))


def test_recipe_show_prints_resolved_yaml(capsys):
    assert main(["recipe", "show", str(TINY), "train.steps=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["steps"] == 7 and Recipe.model_validate(shown) == load_recipe(TINY, ["train.steps=7"])


def test_launch_dry_run_uses_torchrun(capsys):
    assert main(["launch", str(TINY), "--dry-run", "train.steps=3"]) == 0
    cmd = capsys.readouterr().out
    assert "torch.distributed.run" in cmd and "--nproc_per_node=2" in cmd and "train.steps=3" in cmd


def test_relative_inputs_are_found_from_any_working_directory(tmp_path, monkeypatch):
    """`setdiff train /path/to/checkout/recipes/tiny-reasoning.yaml` from elsewhere: a relative
    input is looked for in the working directory, then beside the recipe file and above it."""
    reasoning = TINY.parent / "tiny-reasoning.yaml"
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(reasoning)
    assert recipe.model.init_from == str(TINY.parents[1] / "assets" / "reasoning-ar-base")
    assert validate_recipe(recipe, recipe_file=reasoning) == []
    (tmp_path / "assets" / "reasoning-ar-base").mkdir(parents=True)  # the working directory's comes first
    assert load_recipe(reasoning).model.init_from == "assets/reasoning-ar-base"

    project = tmp_path / "project"  # a recipe two levels below the files it names
    (project / "recipes" / "mine").mkdir(parents=True)
    (project / "tok").mkdir()
    (project / "data").mkdir()
    (project / "data" / "corpus.idx").write_text("")
    mine = project / "recipes" / "mine" / "r.yaml"
    mine.write_text(
        yaml.safe_dump(
            {"base": str(TINY), "data": {"tokenizer": "tok", "datasets": [{"path": "data/corpus"}, {"path": "stdlib"}]}}
        )
    )
    data = load_recipe(mine).data
    assert data.tokenizer == str(project / "tok")
    assert [d.path for d in data.datasets] == [str(project / "data" / "corpus"), "stdlib"]


def test_a_relative_input_found_nowhere_says_where_it_was_looked_for(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["recipe", "validate", str(TINY), "model.init_from=assets/nope"]) == 2
    assert capsys.readouterr().err == (
        f"setdiff: error: {TINY}: model.init_from: assets/nope does not exist (looked in the working "
        f"directory {tmp_path}, then in {TINY.parent} and each directory above it)\n"
    )


def test_fp8_recipes_are_held_to_transformer_engines_fp8_shapes():
    """TE's FP8 GEMMs assert token counts that are multiples of 8 and inner sizes that are
    multiples of 16 (assert_dim_for_fp8_exec), and megatron-core runs every forward under FP8:
    the last layer's query stream, seq_len x micro-batch tokens per rank, is the smallest."""
    gpu = ["model.backend=te", "train.fp8=hybrid"]

    def errors(*overrides):
        return validate_recipe(load_recipe(TINY, [*gpu, *overrides]), has_gpu=True, check_paths=False)

    assert errors() == []  # 128 x 8 tokens, hidden 128, intermediate 384
    assert errors("data.seq_len=100", "parallel.micro_batch_size=2", "parallel.global_batch_size=4") == []  # 200
    odd = errors("data.seq_len=124", "parallel.micro_batch_size=1", "parallel.global_batch_size=2")
    assert odd == [
        "train.fp8: FP8 GEMMs take token counts that are multiples of 8; the last layer holds data.seq_len x "
        "parallel.micro_batch_size = 124 tokens per rank: make it a multiple of 8"
    ]
    split = errors("parallel.cp=2", "data.seq_len=120", "parallel.micro_batch_size=1", "parallel.global_batch_size=1")
    assert split and "data.seq_len x parallel.micro_batch_size / parallel.cp = 60 tokens per rank" in split[0]
    assert errors("model.intermediate_size=376") == [
        "train.fp8: FP8 GEMMs take inner sizes that are multiples of 16; model.intermediate_size is 376"
    ]
    assert validate_recipe(
        load_recipe(TINY, ["train.fp8_dot_product_attention=true"]), has_gpu=True, check_paths=False
    ) == ["train.fp8_dot_product_attention: FP8 attention needs train.fp8"]
