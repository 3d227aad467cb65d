#!/bin/bash
# One call on the GPU machine (the device tool runs it in the checkout, with `.whl/` carried):
# install the wheels, then run the steps named in the arguments, each bounded so that the call
# stays inside its 10 minutes. Steps: families, bench, gpuA (tests/gpu but faults, families and
# megatron; GPUA_S bounds it, its verbose log goes to $OUT/gpuA.log), gpuB (megatron + families), megatron,
# fsdpbench (FSDP_ARGS adds arguments, e.g. "--profile $OUT/prof"), faults, tests:FILE,FILE (TESTS_S bounds it), scale:WORKLOAD
# (grpo_scale_gpu.py's, e.g. scale:8b-2k; SCALE_S bounds it, SCALE_ARGS adds arguments; SCALE_S_8b_2k and
# SCALE_ARGS_8b_2k set them for one workload; the run's miles/trl logs come back as $OUT/8b-2k-miles.log). Results that
# files make go to $OUT.
# The checkout and .whl/ must fit in 64 MiB: `python3 scripts/slim_ray_wheel.py` after building .whl/.
#   bash scripts/gpu_call.sh gpuA        then        bash scripts/gpu_call.sh gpuB fsdpbench
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    families) timeout 240 python3 -m pytest tests/gpu/test_model_families_gpu.py -q -x -p no:cacheprovider 2>&1 | tail -25 ;;
    bench) timeout 225 python3 scripts/bench/grpo_step_gpu.py --miles-iters 21 --trl-steps 3 --side-timeout-s 140 --out /tmp/bench05 > $OUT/bench05.log 2>&1; tail -c 6000 $OUT/bench05.log ;;
    gpuA) timeout ${GPUA_S:-575} python3 -m pytest tests/gpu -v -p no:cacheprovider --durations=12 --ignore tests/gpu/test_faults_gpu.py --ignore tests/gpu/test_model_families_gpu.py --ignore tests/gpu/test_megatron_gpu.py > $OUT/gpuA.log 2>&1; echo "rc=$? passed=$(grep -c ' PASSED' $OUT/gpuA.log)"; grep -E "::.* (FAILED|ERROR|XFAIL|SKIPPED)" $OUT/gpuA.log | cut -c1-160 | tail -20; tail -30 $OUT/gpuA.log ;;
    gpuB) timeout 400 python3 -m pytest tests/gpu/test_megatron_gpu.py tests/gpu/test_model_families_gpu.py -q -p no:cacheprovider --durations=8 2>&1 | tail -30 ;;
    fsdpbench) timeout ${FSDP_S:-150} python3 scripts/bench/fsdp_step_gpu.py --out $OUT/fsdp.json ${FSDP_ARGS:-} > $OUT/fsdp.log 2>&1; tail -c 3000 $OUT/fsdp.log ;;
    megatron) timeout ${MEGATRON_S:-300} python3 -m pytest tests/gpu/test_megatron_gpu.py -q -p no:cacheprovider --durations=6 2>&1 | tail -20 ;;
    scale:*) w=${step#scale:}; k=${w//[.-]/_}; sv=SCALE_S_$k; av=SCALE_ARGS_$k   # per workload: SCALE_S_8b_2k, SCALE_ARGS_8b_2k
        timeout ${!sv:-${SCALE_S:-330}} python3 scripts/bench/grpo_scale_gpu.py --workload $w ${!av:-${SCALE_ARGS:-}} \
        --out /tmp/scale-$w > $OUT/scale-$w.json 2> $OUT/scale-$w.log; echo "rc=$?"; tail -c 2500 $OUT/scale-$w.log; \
        tail -c 5000 $OUT/scale-$w.json; for f in miles trl; do [ -f /tmp/scale-$w/$f.log ] && tail -c 300000 /tmp/scale-$w/$f.log > $OUT/$w-$f.log; done; \
        [ -f /tmp/scale-$w/miles-run/trace.jsonl ] && gzip -c /tmp/scale-$w/miles-run/trace.jsonl > $OUT/$w-trace.jsonl.gz ;;
    tests:*) t=${step#tests:}; timeout ${TESTS_S:-300} python3 -m pytest ${t//,/ } -q -p no:cacheprovider --durations=8 2>&1 | tail -25 ;;
    faults) timeout 260 python3 -m pytest tests/gpu/test_faults_gpu.py -q -p no:cacheprovider 2>&1 | tail -15 ;;
  esac
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
done
echo "=== done $(date +%T)"
