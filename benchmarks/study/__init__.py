"""The method's trade-offs on models this framework trains: `python -m benchmarks.study`.

Seven models of one size train on the same data, tokens and steps through the project's own
recipes (recipes/study/) and megatron engine: AR, set diffusion with d in {2, 4, 8}, and set
diffusion with a uniform order and with a block order (blocks of 4 and 8) -- the orders MDLM's and
BD3-LM's masking imply, not those baselines themselves -- once or once per training seed
(`--seeds 1,2,3`: every figure then a mean with its spread and standard errors). Three settings
(`--setting`):
- supervised (the default, the paper's format for its GSM8K models): one problem per row, its
  expression line pinned as clean context and only the solution in the loss;
- packed (recipes/study/packed/): pretraining windows across problems, every token a target, the
  right models for likelihood and infilling as the paper uses its OpenWebText models for those;
- adapted (recipes/study/adapted/, the paper's pipeline): every model starts from one AR base
  pretrained here on packed windows (assets/reasoning-ar-base) and is adapted on the supervised
  records with the same budget, as the paper adapts Qwen3-1.7B-Base.
The project's own eval jobs then measure:
  (a) test accuracy against tokens per step and tokens/s at batch 16 over a decoding grid
      (window x threshold, k = 1; W = 1 for every model): the analogue of the paper's GSM8K
      Pareto figure;
  (b) validation loss against step;
  (c) packed setting only: held-out NLL (exact left to right, and each model's NELBO under its
      own order policy) and infilling (middle solution lines of test problems, and held-out
      stdlib function bodies by four models trained on the built-in code corpus), each model
      given the context its order can use.
Results go to benchmarks/results/study/<setting>/ (results.json, results.md, plots). Reruns skip
the models and points already done; `--report-only` draws results.md and the plots again from an
existing results.json. `--quick` trains set diffusion d = 4 of the supervised setting as the full
run does and decodes it at W = 1 and at the paper's default policy.

Modules: `plan` (the models and decoding settings), `run` (training and evaluation through the
project's commands and jobs), `report` (tables and plots).
"""
