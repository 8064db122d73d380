#!/usr/bin/env bash
# build_reasoning_ar_base.sh - rebuild assets/reasoning-ar-base, the pretrained AR model the main job
# (recipes/tiny-reasoning.yaml) adapts into set diffusion: recipes/study/adapted/ar-base.yaml
# (4 x 128, packed 128-character windows of the built-in reasoning corpus, 1,500 steps; about 12 min
# on 2 cores), exported in bfloat16 without the generated model code (setdiff reads the weights,
# config and tokenizer itself), its README and checksums written beside it.
#
#   tools/build_reasoning_ar_base.sh [OUT [RUN_DIR]]     (relative paths: from the checkout's root)
#     OUT      assets/reasoning-ar-base by default; if it exists, it must be an earlier build of
#              this script (its README heading and SHA256SUMS), which is replaced; anything else
#              there is refused, never overwritten
#     RUN_DIR  the training run, which must not exist: the base is trained from scratch every time
#              (resuming an earlier run would export its old weights); by default a new
#              runs/build-reasoning-ar-base/<UTC time>, left in place after the build
#
# CPUs round differently, so a rebuild elsewhere gives other (equally good) weights and checksums;
# tests/test_assets.py checks the shipped files against SHA256SUMS.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-assets/reasoning-ar-base}"
run="${2:-runs/build-reasoning-ar-base/$(date -u +%Y%m%dT%H%M%SZ)}"
die() { echo "build_reasoning_ar_base: error: $*" >&2; exit 2; }
[ -e "$run" ] && die "$run exists; the base trains from scratch in a new run directory (pass another RUN_DIR)"
overwrite=()
if [ -e "$out" ]; then
  if [ "$(head -n1 "$out/README.md" 2>/dev/null)" = "# reasoning-ar-base" ] && [ -f "$out/SHA256SUMS" ]; then
    overwrite=(--overwrite)
  else
    die "$out exists and is not an earlier build of this script (README.md '# reasoning-ar-base' and SHA256SUMS); choose another OUT"
  fi
fi
mkdir -p "$(dirname "$run")"
setdiff train recipes/study/adapted/ar-base.yaml "checkpoint.dir=$run"
setdiff convert to-hf "$run" "$out" --dtype bf16 "${overwrite[@]}"
rm -f "$out/modeling_setdiff.py" "$out/configuration_setdiff.py"
recipe=$(sed -n '/^## Training recipe/,$p' "$out/README.md")
cat > "$out/README.md" <<TEXT
# reasoning-ar-base

The AR base model that the main job (recipes/tiny-reasoning.yaml) adapts into set diffusion, as
the paper adapts Qwen3-1.7B-Base on GSM8K: 4 layers x 128 (under a million parameters), trained
left to right on packed 128-character windows of the built-in reasoning corpus, every token a
target, for 1,500 steps of 32 windows by recipes/study/adapted/ar-base.yaml, then exported with
\`setdiff convert to-hf --dtype bf16\`. Rebuilt by tools/build_reasoning_ar_base.sh; SHA256SUMS
lists every file's checksum.

Read by any setdiff command that takes a model source (\`model.init_from\`, \`setdiff sample\`,
\`setdiff eval\`); the generated model code is left out, so transformers' AutoModel needs a
fresh \`setdiff convert to-hf\` of the run instead.

$recipe
TEXT
(cd "$out" && sha256sum $(ls | grep -v '^SHA256SUMS$') > SHA256SUMS)
echo "built $out"
