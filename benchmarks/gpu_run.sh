#!/bin/bash
# The GPU checks of a short loan of one NVIDIA GPU, in one command (about 8 minutes on
# an H100), run from the repository root on the GPU machine. That machine needs JAX
# with CUDA, PyTorch, transformers and PEFT; IREE's compiler is not needed there.
#
# Before, on any machine with iree-base-compiler (see docs/benchmarks.md, "GPU"):
#   python benchmarks/gpu_smoke.py --iree-prepare gpu-work/iree      # the cuda modules
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d gpu-work/wheels iree-base-runtime==3.13.0
# (the Python version of the GPU machine's), then bring gpu-work/ along: the .vmfb files are
# git-ignored, so a device call that copies the working tree must carry gpu-work/iree by name.
#
# A JAX newer than pockjax's verified range needs POCKJAX_ALLOW_UNVERIFIED_JAX=1 (say so
# beside the figures).
#
# Writes to $OUT (default gpu-results/): iree_cuda.txt and each bench group's results.
# Each group has its own time limit and is interrupted with SIGINT, so a group cut
# short still writes the rows that finished.
set -u -o pipefail
WORK=${WORK:-gpu-work}
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls "$WORK"/wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/pockjax-gpu-site "$WORK"/wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/pockjax-gpu-site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi -L
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)"
echo "== IREE cuda"
status=0
timeout 90 python3 benchmarks/gpu_smoke.py --iree-check "$WORK/iree" 2>&1 | tee "$OUT/iree_cuda.txt" \
    || { echo "IREE cuda check FAILED (exit $?)"; status=1; }
bench() {  # bench NAME SECONDS ROWS
    echo "== $1"
    rm -rf "/tmp/pockjax-gpu-$1"  # a group interrupted before any run finished must not leave old results
    timeout -s INT "$2" python3 -m pockjax.cli bench --device gpu --model llama-1b --rows "$3" \
        --reps 1 --steps 5 --quality-steps 0 --out "/tmp/pockjax-gpu-$1" --no-progress 2>&1 | tail -25 \
        || { echo "bench $1 FAILED or was cut short (exit $?)"; status=1; }
    for f in results.json results.md; do
        [ -f "/tmp/pockjax-gpu-$1/$f" ] && cp "/tmp/pockjax-gpu-$1/$f" "$OUT/$1_$f"
    done
}
bench precision 330 torch-full,torch-full-bf16,pockjax-paper,pockjax-paper-bf16,pockjax-paper-int8-bf16,pockjax-paper-int8,pockjax-paper-int4
bench lora 180 torch-lora,torch-lora-bf16,pockjax-lora
exit $status
