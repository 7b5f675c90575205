#!/usr/bin/env bash
# The whole-pipeline benchmark (wan22_pipeline: Wan2.2-T2V-A14B, 69 GB of random bf16 weights generated
# on the GPU) in device calls of 10 minutes each. PART=1: native and ours under 8 GiB (the target, one
# invocation). PART=2: ours without a budget under a 24 GiB cap, diffusers' pipeline-level group offload.
# PART=3: flextensor 0.5.0, diffusers' enable_model_cpu_offload (87 s a generation on an H100). Each
# method builds the pipeline afresh (~50 s) and runs 1-3 warm-up generations and 2 timed ones (28-30 s
# natively); ours takes about 220 s in all, native 250 s, diffusers' group offload 300 s (2026-12-05,
# H100). flextensor 0.5.0 learns for about 11 forwards of each expert (4 a generation), so about three
# warm-up generations: give it a call of its own (METHODS=flextensor050), as model offload needs one
# (METHODS=diffusers_model_offload, with --min-steps 1 it took 330 s in all). PART=4: diffusers'
# enable_sequential_cpu_offload (each module's weights copied at each call: expect ~40 s a generation).
# REFERENCE=<result files of PART=1 whose native run has an output digest, copied into the repo,
# space-separated> compares PART=2 and 3 with the native run of this machine's GPU model (time, and
# output by SHA-256) instead of running native again: ~250 s saved per call. Outputs differ between GPU
# models, so pass one per model: H200 benchmarks/results/wan22_pipeline-cuda-20261205-165450.json,
# H100 benchmarks/results/h100/wan22_pipeline-cuda-20261205-182647.json.
# METHODS overrides the part's list; STEPS the timed generations of each method (2). PROFILE=1 profiles one more generation of each method and prints
# flextensor's ranges (layouts, uploads, vacates at the switches; waits and prefetches in the steps).
#   device tool: carry [".whl"], command: PART=1 bash scripts/gpu_pipeline_check.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
out=${OUT:-benchmarks/results}
case "${PART:-1}" in
1) methods="native,ours_budget:8GiB" ;;
2) methods="ours/cap=24GiB,diffusers_group" ;;
3) methods="flextensor050,diffusers_model_offload" ;;
*) methods="diffusers_sequential_offload" ;;
esac
methods=${METHODS:-$methods}
if [ -n "${PROFILE:-}" ]; then export FLEXTENSOR_BENCH_PROFILE=summary; fi
reference=()
for file in ${REFERENCE:-}; do reference+=(--reference "$file"); done
python3 -m benchmarks.run --workload wan22_pipeline --device cuda --out "$out" --deadline "${DEADLINE:-560}" --timeout 330 \
    --min-steps "${STEPS:-2}" --max-steps "${STEPS:-2}" --methods "$methods" "${reference[@]}" 2>&1 | tail -12
python3 - "$out" <<'PY'
import glob, json, sys
path = sorted(glob.glob(f"{sys.argv[1]}/wan22_pipeline-cuda-*.json"))[-1]
for r in json.load(open(path))["runs"]:
    last = (r.get("phase_steps") or [{}])[-1]
    peaks = {k: round(v / 1e9, 2) for k, v in last.get("phase_peak_allocated_bytes", {}).items()}
    print(r["method_spec"], r["status"], r.get("step_s"), "phases s:", last.get("phase_s"), "peaks GB:", peaks,
          "rss GB:", round((r.get("host_rss_peak_bytes") or 0) / 1e9, 1), (r.get("reason") or "")[:300])
    for step in r.get("phase_steps") or []:
        print("  between phases s:", step.get("between_s"))
    switches = (r.get("method_details") or {}).get("pipeline_switches")
    if switches:
        print("  switches:", switches)
    if r.get("profile"):
        print("  flextensor ranges:", r["profile"]["ranges"])
PY
