#!/usr/bin/env bash
# The device checks of one lent GPU session, in one call of at most 9.8 minutes (a session has 15 minutes of
# device time, its start included): the per-rank training table with compile="reduce-overhead" rows (issue
# 34's model, rank 0 of 4 under the fake process group; d4 compiled: the training graph in pieces, what
# they cost beside one rank's share), gpu_check's parity on CUDA (training compiled,
# generate, reduce-overhead with accumulation), and one rank's static-cache decode. Each step has its own
# timeout, so a slow one leaves the others their time. Results go to $OUT (or ./gpu-session) as JSON and logs.
#
#   bash benchmarks/gpu_session.sh                              # on the lent machine
#   SIZE=tiny DEVICE=cpu BATCH=8x32 bash benchmarks/gpu_session.sh   # the same commands on a CPU, to try them
set -uo pipefail
out="${OUT:-gpu-session}"
mkdir -p "$out"
size="${SIZE:-medium}" device="${DEVICE:-auto}" batch="${BATCH:-8x1024}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
status=0
# rows of `python -m benchmarks --simulate 4 --reduce-overhead`, each its own child with its own timeout (the
# serial rows left out: one rank's share, compiled, is the goal's reference), one JSON line each
for row in share t4x1x1:compiled t4x1x1:reduce-overhead d4:compiled; do
    echo "== $row"
    timeout 100 python3 -m benchmarks.simulate --child "$row" --world 4 --size "$size" --device "$device" \
        --batch "$batch" --repeats 7 2>"$out/simulate-${row//:/-}.err" | tail -1 | tee -a "$out/simulate.jsonl" \
        || { status=1; tail -3 "$out/simulate-${row//:/-}.err"; }
done
timeout 100 python3 -m autopar.examples.gpu_check --device "$device" --simulate 0 --steps 3 2>&1 \
    | tee "$out/gpu_check.log" || status=1
timeout 100 python3 -m benchmarks --simulate 4 --decode --size "$size" --device "$device" --grids t4x1x1 \
    --modes graphs --timeout 90 --json "$out/decode.json" 2>&1 | tee "$out/decode.log" || status=1
exit $status
