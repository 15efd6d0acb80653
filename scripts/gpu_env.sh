# Sourced by the scripts/gpu_validate_*.sh device scripts: the repository root as the working
# directory, OUT_DIR (the script's first argument, else $OUT, else the default it passes), the
# environment of the H200 hosts (NVLink multicast off, eager module loading), `step` to print
# a step's title, and the MoK library: $MOK_LIBRARY when it names a file, else built into
# OUT_DIR/lib.
#
#   source scripts/gpu_env.sh "${1:-}" DEFAULT_OUT_DIR     (sets root, out, py, failed=0)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
out=${1:-${OUT:-$2}}
mkdir -p "$out"
py=${MOK_PYTHON_BIN:-python3}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=EAGER
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
failed=0
step() { echo; echo "=== $* ($(date +%T))"; }

if [ -n "${MOK_LIBRARY:-}" ] && [ -f "$MOK_LIBRARY" ]; then
  step "library: $MOK_LIBRARY (prebuilt)"
else
  step "build"
  "$py" -m megatron_mok._build --out "$out/lib" || { echo "build failed"; exit 1; }
  export MOK_LIBRARY="$out/lib/libmegatron_mok.so"
fi
