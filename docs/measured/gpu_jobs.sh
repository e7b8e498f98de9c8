#!/usr/bin/env bash
# The prepared GPU measurements: run from the repository root on the GPU
# machine, the wheels of `make gpu-wheels` on PYTHONPATH, as `bash docs/measured/gpu_jobs.sh
# JOB...`. Each job writes $OUT/JOB.log (and JOB.json) as it ends, under its own timeout cut to
# what is left of DEADLINE_S (seconds from the script's start, default 540: a device call runs
# 600 at most), so the jobs named first are the ones that surely run.
# Jobs:
#   paths                       launcher.bench.cuda_paths (~2 min)
#   dsv2, dsv2_eager            DeepSeek-V2-Lite's first 4 layers, compiled / eager, torchtitan beside
#   mixtral, mixtral_eager      Mixtral 8x7B's 2 layers, compiled / eager, torchtitan beside
#   gpt, gpt_eager              Megatron GPT 1.7B as published (attention not fused), engine alone
#   gpt_flash                   the same, compiled, fused attention and no dropout (what llama runs)
#   llama, llama_eager          the default (Llama 3.2 1B), compiled with both peers / eager alone
#   llama_profile, dsv2_profile the default compiled / DeepSeek's eager, engine alone, and one
#                               more step profiled: its top kernels in $OUT/JOB.txt (--profile)
#   gpt_flash_profile           gpt_flash, profiled likewise
#   llama_alone, llama_foreach  the default compiled, engine alone: AdamW fused (train.adamw=auto
#                               on a GPU) / foreach (torch's default on CUDA)
#   llama_fp8, llama_fp8_row    the default compiled in precision=fp8, tensorwise / rowwise
#   l8b, l8b_fp8                Llama 3 8B's shape cut to 8 layers, compiled, bf16 / fp8
#   selftest                    launcher.selftest on the one GPU (world 1: the speed row alone,
#                               Llama 3.2 1B cut to one layer, its efficiency fitted into a
#                               preset): $OUT/selftest/selftest.json, .md, conf/hardware/
# Tried on CPU at debug size first: EXTRA="model=deepseek_debug hardware=cpu train.seq_len=64
# train.compile=false" bash docs/measured/gpu_jobs.sh dsv2_eager (nvidia-smi absent: h100_80g).
set -u
OUT=${OUT:-/tmp/out}
DEADLINE_S=${DEADLINE_S:-540}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,power.limit,driver_version --format=csv \
  > "$OUT/gpu.csv" 2>&1
HW=h100_80g
grep -q H200 "$OUT/gpu.csv" && HW=h200
left() {  # left CAP: CAP seconds, or what is left of the deadline if less
  local rest=$((DEADLINE_S - SECONDS))
  echo $((rest < $1 ? rest : $1))
}
bench() {  # bench NAME CAP WORKLOAD WARMUP PEERS [OVERRIDES...]
  local name=$1 secs
  secs=$(left "$2")
  local workload=$3 warmup=$4 peers=$5
  shift 5
  if [ "$secs" -lt 20 ]; then echo "$name: skipped, ${secs}s left" >> "$OUT/skipped.log"; return; fi
  timeout "$secs" python -m launcher.bench.gpu --workload "$workload" --steps 5 \
    --warmup "$warmup" --peers "$peers" --json "$OUT/$name.json" "hardware=$HW" "$@" ${EXTRA:-} \
    > "$OUT/$name.log" 2>&1
  echo "exit $? after ${SECONDS}s of the script" >> "$OUT/$name.log"
}
for job in "$@"; do
  case $job in
    paths) timeout "$(left 150)" python -m launcher.bench.cuda_paths --json "$OUT/cuda_paths.json" \
             > "$OUT/paths.log" 2>&1; echo "exit $?" >> "$OUT/paths.log" ;;
    dsv2) bench dsv2 200 deepseek_v2_lite 2 torchtitan ;;
    dsv2_eager) bench dsv2_eager 150 deepseek_v2_lite 1 torchtitan train.compile=false ;;
    mixtral) bench mixtral 270 mixtral_8x7b 2 torchtitan ;;
    mixtral_eager) bench mixtral_eager 150 mixtral_8x7b 1 torchtitan train.compile=false ;;
    gpt) bench gpt 150 gpt_1_7b 2 "" ;;
    gpt_eager) bench gpt_eager 90 gpt_1_7b 1 "" train.compile=false ;;
    gpt_flash) bench gpt_flash 150 gpt_1_7b 2 "" model.flash_attention=true model.dropout=0 ;;
    llama) bench llama 200 llama3_2_1b 2 transformers,torchtitan ;;
    llama_eager) bench llama_eager 90 llama3_2_1b 1 "" train.compile=false ;;
    llama_profile) bench llama_profile 150 llama3_2_1b 2 "" --profile "$OUT/llama_profile.txt" ;;
    dsv2_profile) bench dsv2_profile 120 deepseek_v2_lite 1 "" train.compile=false \
                    --profile "$OUT/dsv2_profile.txt" ;;
    gpt_flash_profile) bench gpt_flash_profile 150 gpt_1_7b 2 "" model.flash_attention=true \
                         model.dropout=0 --profile "$OUT/gpt_flash_profile.txt" ;;
    llama_alone) bench llama_alone 150 llama3_2_1b 2 "" ;;
    llama_foreach) bench llama_foreach 150 llama3_2_1b 2 "" train.adamw=foreach ;;
    llama_fp8) bench llama_fp8 150 llama3_2_1b 2 "" precision=fp8 ;;
    llama_fp8_row) bench llama_fp8_row 150 llama3_2_1b 2 "" precision=fp8 precision.fp8=rowwise ;;
    l8b) bench l8b 180 llama3_8b_8l 2 "" ;;
    l8b_fp8) bench l8b_fp8 180 llama3_8b_8l 2 "" precision=fp8 ;;
    selftest) timeout "$(left 180)" python -m launcher.selftest "hardware=$HW" \
                hardware.nodes=1 hardware.devices_per_node=1 model=llama3_2_1b \
                train.seq_len=2048 "hydra.run.dir=$OUT/selftest" ${EXTRA:-} \
                > "$OUT/selftest.log" 2>&1; echo "exit $?" >> "$OUT/selftest.log" ;;
    *) echo "unknown job $job (see the script's header)" >&2; exit 2 ;;
  esac
done
