export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MOK_LIBRARY=$PWD/.gpu/libmegatron_mok.so PYTHONUNBUFFERED=1 TORCH_COMPILE_DISABLE=1 CUDA_MODULE_LOADING=EAGER
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/megatron_core*.whl
export PYTHONPATH=/tmp/site:$PWD
T="torchrun --nproc-per-node 2 scripts/megakernel_timeline.py"
run() { name=$1; shift; echo "== $name"; timeout 100 $T "$@" > $OUT/$name.txt 2>&1; grep -E "paired|ratio|by block|Error|error" $OUT/$name.txt | grep -v -i warn | head -6; }
run ab48 --experts 48 --ab MOK_MEGAKERNEL_COMM_PULL_LIMIT=1000000,0 --blocks --rounds 20
timeout 200 python3 -m pytest -q -rsf -p no:warnings --timeout=150 -m "gpu2 or gpun" tests/ 2>&1 | tail -4
timeout 100 python3 -m pytest -q -rsf -p no:warnings --timeout=90 -m gpu tests/ 2>&1 | tail -4
run ab6 --experts 6 --ab MOK_MEGAKERNEL_COMM_PULL_LIMIT=1000000,0 --blocks --rounds 20
run ab192 --experts 192 --ab MOK_MEGAKERNEL_COMM_PULL_LIMIT=1000000,0 --blocks --rounds 20
