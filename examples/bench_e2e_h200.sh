#!/usr/bin/env bash
# The end-to-end comparison as measured for docs/benchmarks.md: the same Megatron training run
# (the launcher `python -m megatron_mok.pretrain_gpt`) with the alltoall and the mok token
# dispatchers, on a model config (e.g. the proxy DeepSeek-V3 config in configs/), reporting step
# time and tokens/s per GPU. Writes OUT_DIR/e2e-h200xN.{json,png,md} and one log per dispatcher.
#
# Usage: examples/bench_e2e_h200.sh OUT_DIR CONFIG.args [MORE.args ...] [-- extra launcher flags]
#   NGPU (default: every visible GPU), ITERS (default 20, the first 5 are warm-up),
#   DISPATCHERS (default alltoall,mok), MICRO_BATCH (1), GLOBAL_BATCH (4 x NGPU),
#   LAUNCHER (default megatron_mok.pretrain_gpt: a module, or a .py script).
# The training flags below come first, so the config files and the flags after -- override them.
set -euo pipefail
out=${1:?usage: $0 OUT_DIR CONFIG.args [MORE.args ...] [-- extra launcher flags]}
shift
configs=()
while (( $# )) && [[ $1 != -- ]]; do configs+=("$1"); shift; done
(( $# )) && shift  # the --
(( ${#configs[@]} )) || { echo "name at least one CONFIG.args file" >&2; exit 2; }
python=${PYTHON:-python3}
ngpu=${NGPU:-$("$python" -c 'import torch; print(max(1, torch.cuda.device_count()))')}
iters=${ITERS:-20}
dispatchers=${DISPATCHERS:-alltoall,mok}
cd "$(dirname "$0")/.."
mkdir -p "$out"
defaults="$(mktemp -d)/training-defaults.args"  # its flags are recorded in the JSON
cat > "$defaults" <<ARGS
# Written by examples/bench_e2e_h200.sh: parallelism and training flags of the comparison.
--tensor-model-parallel-size 1
--pipeline-model-parallel-size 1
--expert-model-parallel-size $ngpu
--micro-batch-size ${MICRO_BATCH:-1}
--global-batch-size ${GLOBAL_BATCH:-$(( 4 * ngpu ))}
--lr 1e-4
--min-lr 1e-5
--lr-decay-style constant
--bf16
--seed 1234
ARGS
# Without Transformer Engine, Megatron runs its local spec with the TE-only fusions off.
extra=()
if [[ -f configs/local_no_te.args ]] && ! "$python" -c 'import transformer_engine' 2>/dev/null; then
  extra=(--args-file configs/local_no_te.args)
fi
# NVLink multicast stays off (the shared H200 hosts do not allow it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
config_args=()
for c in "${configs[@]}"; do config_args+=(--args-file "$c"); done
set -x
"$python" -m megatron_mok.bench e2e --nproc-per-node "$ngpu" --dispatchers "$dispatchers" \
  --launcher "${LAUNCHER:-megatron_mok.pretrain_gpt}" \
  --iters "$iters" --skip-iters 5 --args-file "$defaults" "${extra[@]}" "${config_args[@]}" \
  --label "$(basename "${configs[-1]}" .args)" --out "$out" --name "e2e-h200x$ngpu" -- "$@"
