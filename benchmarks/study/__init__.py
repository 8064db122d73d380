"""The method's trade-offs on models this framework trains, against the paper's baselines:
`python -m benchmarks.study`.

Models of one size train on the same data, tokens and steps through the project's own recipes
(recipes/study/) and megatron engine: AR, set diffusion with d in {2, 4, 8}, the paper's
baselines MDLM and BD3-LM (blocks of 4 and 8; `method.family`), and set diffusion with a uniform
order and with a block order (blocks of 4 and 8; `sd-uniform`, `sd-block4`, `sd-block8`: set
diffusion with those orders, not the baselines), once or once per training seed (`--seeds 1,2,3`:
every figure then a mean with its spread and standard errors). Six settings (`--setting`):
- supervised (the default, the paper's format for its GSM8K models): one problem per row, its
  expression line pinned as clean context and only the solution in the loss;
- packed (recipes/study/packed/): pretraining windows across problems, every token a target
  (the models before the baselines; likelihood and the old infilling task);
- adapted (recipes/study/adapted/, the paper's pipeline): every model starts from one AR base
  pretrained here on packed windows (assets/reasoning-ar-base) and is adapted on the supervised
  records with the same budget, as the paper adapts Qwen3-1.7B-Base;
- infill (recipes/study/infill/): AR, set diffusion d = 4, 8 and 16, MDLM and BD3-LM (blocks of 4)
  pretrained on packed chains (data/chains.py) and infilling a held-out line that the right side
  decides and the left side leaves open, as the paper infills ROCStories;
- budget: the adapted setting's headline models (AR, d = 4, MDLM, BD3-LM blocks of 4) at several
  adaptation budgets (`--budgets`, its 400-step runs the adapted setting's own);
- unconditional (unconditional.py; recipes/study/packed/): AR, set diffusion d = 2, 4, 8, MDLM and
  BD3-LM pretrained on packed windows, sampled from an empty prompt and judged by an AR model
  trained four times as long (generative perplexity and unigram entropy against speed).
The project's own eval jobs then measure:
  (a) test accuracy against tokens per step and tokens/s at batch 16 over each family's decoding
      points (set diffusion: window x threshold, k = 1, and W = 1; MDLM and BD3-LM: a threshold
      sweep over their blocks), every speed with the invocation that measured it: the analogue of
      the paper's GSM8K Pareto figure;
  (b) validation loss against step;
  (c) packed setting: held-out NLL (exact left to right, and each model's NELBO under its own
      order policy) and infilling (middle solution lines, stdlib function bodies); infill setting:
      exact match and ROUGE of the chain lines with tokens/s, against the rules' baselines.
Results go to benchmarks/results/study/<setting>/ (results.json, results.md, plots); `--claims`
writes benchmarks/results/study/claims.md, the paper's claims against all of them (claims.py).
Reruns skip the models and points already done; `--report-only` draws results.md and the plots
again from an existing results.json. `--quick` trains set diffusion d = 4 of the supervised or
adapted setting as the full run does and decodes it at W = 1 and at the paper's default policy.

Modules: `plan` (the models and decoding settings), `run` (training and evaluation through the
project's commands and jobs), `unconditional` (the unconditional setting's sampling and judge),
`report` and `plots` (tables and plots), `claims` (the verdicts).
"""
