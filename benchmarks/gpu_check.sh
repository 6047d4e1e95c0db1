#!/usr/bin/env bash
# The prepared run for a lent GPU machine: the CUDA tests, then every row of `fp16kit bench` on the GPU.
#
#   bash benchmarks/gpu_check.sh            # from the repository root; results under $OUT
#
# Sized for the 15 minutes of device time a session may get, with room to run it twice: the
# tests stop at 300 s, the bench at 150 s (the whole run under 8 minutes). It needs a python3
# with torch (a CUDA build) and pytest; fp16kit is taken from this tree (PYTHONPATH), nothing is
# installed. Files written under $OUT (default: ./gpu-check-out):
#   env.txt          torch, CUDA, the device, nvidia-smi's line, the load
#   cuda-tests.log   `pytest -m cuda -rs` (skips are listed: a CUDA test that skips on a GPU is a fault)
#   bench.md         `fp16kit bench --device cuda --quick`, the table
#   bench.log        its progress lines
# The exit status is the tests' (124 when they ran out of time), else the bench's.
# Without a CUDA device it says so and exits 0 at once (tests/test_gpu_check.py runs it so).
set -uo pipefail

out=${OUT:-./gpu-check-out}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check" | tee "$out/env.txt"
    exit 0
fi

{
    "$python" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")'
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 || true
    uptime
} | tee "$out/env.txt"

start=$SECONDS
timeout 300 "$python" -m pytest -m cuda -q -rs -p no:cacheprovider tests 2>&1 | tee "$out/cuda-tests.log"
tests=${PIPESTATUS[0]}
echo "gpu_check: pytest -m cuda exited $tests after $((SECONDS - start)) s"

start=$SECONDS
timeout 150 "$python" -m fp16kit bench --device cuda --quick >"$out/bench.md" 2>"$out/bench.log"
bench=$?
cat "$out/bench.md" "$out/bench.log"
echo "gpu_check: fp16kit bench --device cuda exited $bench after $((SECONDS - start)) s"

if [ "$tests" -ne 0 ]; then
    exit "$tests"
fi
exit "$bench"
