#!/usr/bin/env bash
# Issue 43's GPU items: run from the repository root on the GPU machine, the
# wheels of `make gpu-wheels` on PYTHONPATH. Each job writes $OUT/JOB.log (and .json) as it ends,
# under its own timeout; torchtitan is the one peer. Jobs: paths (launcher.bench.cuda_paths,
# ~2 min), dsv2 and dsv2_eager (DeepSeek-V2-Lite's 4 layers compiled / eager, ~4 and ~2 min),
# mixtral and mixtral_eager (Mixtral 8x7B's 2 layers). A device call runs 10 minutes at most:
# name the jobs that fit, e.g. `bash docs/measured/moe_gpu.sh paths dsv2 dsv2_eager`, then
# `... mixtral mixtral_eager`.
# Tried on CPU at debug size first: EXTRA="model=deepseek_debug hardware=cpu train.seq_len=64
# train.compile=false" bash docs/measured/moe_gpu.sh dsv2_eager (nvidia-smi absent: h100_80g).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,power.limit,driver_version --format=csv \
  > "$OUT/gpu.csv" 2>&1
HW=h100_80g
grep -q H200 "$OUT/gpu.csv" && HW=h200
bench() {  # bench NAME SECONDS WORKLOAD WARMUP [OVERRIDES...]
  local name=$1 secs=$2 workload=$3 warmup=$4
  shift 4
  timeout "$secs" python -m launcher.bench.gpu --workload "$workload" --steps 5 \
    --warmup "$warmup" --peers torchtitan --json "$OUT/$name.json" "hardware=$HW" "$@" ${EXTRA:-} \
    > "$OUT/$name.log" 2>&1
  echo "exit $?" >> "$OUT/$name.log"
}
for job in "${@:-paths dsv2 dsv2_eager mixtral mixtral_eager}"; do
  for j in $job; do
    case $j in
      paths) timeout 150 python -m launcher.bench.cuda_paths --json "$OUT/cuda_paths.json" \
               > "$OUT/paths.log" 2>&1; echo "exit $?" >> "$OUT/paths.log" ;;
      dsv2) bench dsv2 270 deepseek_v2_lite 2 ;;
      dsv2_eager) bench dsv2_eager 150 deepseek_v2_lite 1 train.compile=false ;;
      mixtral) bench mixtral 270 mixtral_8x7b 2 ;;
      mixtral_eager) bench mixtral_eager 150 mixtral_8x7b 1 train.compile=false ;;
      *) echo "unknown job $j (paths dsv2 dsv2_eager mixtral mixtral_eager)" >&2; exit 2 ;;
    esac
  done
done
