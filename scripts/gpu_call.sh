#!/bin/bash
# One call on the GPU machine (the device tool runs it in the checkout, with `.whl/` carried):
# install the wheels, then run the steps named in the arguments, each bounded so that the call
# stays inside its 10 minutes. Steps: families, bench, gpuA (tests/gpu but faults, families and
# megatron; GPUA_S bounds it, its verbose log goes to $OUT/gpuA.log), gpuB (megatron + families), megatron,
# wgrad (wgrad_accum_gpu.py: the float32 gradient accumulation fused into the matmul or not), mfu (train_mfu_gpu.py: the trainer's step alone at 4B by variant; MFU_ARGS, MFU_S), enginecaps (engine_caps.py at
# the 0.5B shape: per-request caps in one batch against cap by cap, stop strings' cost; CAPS_S), fp8 (fp8_rollout_gpu.py:
# bf16, FP8 weights, FP8 KV, both; FP8_ARGS adds arguments, FP8_S bounds it), fsdpbench (FSDP_ARGS adds arguments, e.g. "--profile $OUT/prof"; fsdpbench:NAME reads FSDP_ARGS_NAME, writes fsdp-NAME.json), faults, tests:FILE,FILE (TESTS_S bounds it), scale:WORKLOAD
# (grpo_scale_gpu.py's, e.g. scale:8b-2k; SCALE_S bounds it, SCALE_ARGS adds arguments; SCALE_S_8b_2k and
# SCALE_ARGS_8b_2k set them for one workload; the run's miles/trl logs come back as $OUT/8b-2k-miles.log, an --r3-effect
# run's second miles log as $OUT/W-r3-miles.log; the MoE commands are in grpo_scale_gpu.py's docstring). Results that
# files make go to $OUT. gpuP (tests/gpu in three parallel lanes, GPUP_S bounds each) and gpuS (the files that read the
# GPU's free or used memory, alone; GPUS_S) together are the whole of tests/gpu. bgscale:W starts scale:W in a
# session of its own and waits BG_WAIT_S for it; waitscale:W (the next call, the machine still warm) waits WAIT_S more
# and brings its results back: a workload longer than one call's 10 minutes.
# moeA then moeB (two calls, the second at once): issue 55's MoE run (the MoE section of docs/performance.md).
# script:NAME runs scripts/bench/NAME.py --out $OUT/NAME.json with ARGS_NAME and S_NAME (dots and dashes as _); basebench runs
# the colocated bench on bench-base/miles (git archive of an older tree) then on this tree, one after the other.
# The checkout and .whl/ must fit in 64 MiB: `python3 scripts/slim_ray_wheel.py` after building .whl/.
# `.whl/` also needs the base install's pure-Python packages the GPU image lacks (the demo's math reward):
#   pip download --no-deps -d .whl math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2
#   bash scripts/gpu_call.sh gpuA        then        bash scripts/gpu_call.sh gpuB fsdpbench
set -u
export PYTHONUNBUFFERED=1
stamp=$(ls -l .whl | md5sum | cut -c1-32)      # a warm machine keeps /tmp/site: install once per set of wheels
if [ "$(cat /tmp/site/.stamp 2>/dev/null)" != "$stamp" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
  echo "$stamp" > /tmp/site/.stamp
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import math_verify" 2>/dev/null || echo "WARNING: math_verify is missing (see the header): every whole run of the demo's recipe will be refused"
LANE1="tests/gpu/test_megatron_gpu.py tests/gpu/test_fp16_and_async_save_gpu.py tests/gpu/test_lora_gpu.py"
LANE2="tests/gpu/test_model_families_gpu.py tests/gpu/test_colocated_grpo.py tests/gpu/test_moe_gpu.py"
LANE3="tests/gpu/test_cuda_parts.py tests/gpu/test_fast_engine_gpu.py tests/gpu/test_fsdp_gpu.py tests/gpu/test_fused_logprobs_gpu.py
       tests/gpu/test_offload_cuda.py tests/gpu/test_weight_ipc.py tests/gpu/test_sglang_health_gpu.py tests/gpu/test_fast_engine_admission_gpu.py
       tests/gpu/test_step_syncs_gpu.py tests/gpu/test_weight_shadows_gpu.py tests/gpu/test_fp8_gpu.py tests/gpu/test_inflight_swap_gpu.py
       tests/gpu/test_fast_engine_paged_gpu.py"
# read the GPU's free or used memory, or fill it (the memory plan's 4B and 8B layer shapes): alone
SERIAL="tests/gpu/test_packing_gpu.py tests/gpu/test_faults_gpu.py tests/gpu/test_memory_plan_gpu.py"
# a scale run's folder (its model: 16 GB for the 12-layer MoE) on a disk, not in a tmpfs /tmp, whose pages
# count against the host memory the run itself needs
SCALE_DIR=${SCALE_DIR:-/tmp}
for d in $SCALE_DIR /var/tmp ${HOME:-/root} $PWD/..; do
  [ "$(stat -f -c %T $d 2>/dev/null)" != tmpfs ] && [ -w $d ] && { SCALE_DIR=$d; break; }
done
collect_scale() {     # $1: the workload; its JSON, log, the run's logs and trace into $OUT
  local w=$1 d=$SCALE_DIR/scale-$1
  tail -c 2500 /tmp/scale-$w.log; cp /tmp/scale-$w.json /tmp/scale-$w.log $OUT/ 2>/dev/null; tail -c 5000 /tmp/scale-$w.json
  for f in miles trl r3/miles; do [ -f $d/$f.log ] && tail -c 300000 $d/$f.log > $OUT/$w-${f//\//-}.log; done
  cp /tmp/scale-$w.mem $OUT/$w-host-mem.log 2>/dev/null
  [ -f $d/miles-run/trace.jsonl ] && gzip -c $d/miles-run/trace.jsonl > $OUT/$w-trace.jsonl.gz
}
wait_scale() {        # $1: the workload, $2: seconds at most; collects it once it has ended
  local w=$1 until=$((SECONDS + $2))
  while [ ! -f /tmp/scale-$w.rc ] && [ $SECONDS -lt $until ]; do sleep 5; done
  if [ -f /tmp/scale-$w.rc ]; then echo "rc=$(cat /tmp/scale-$w.rc)"; collect_scale $w; else echo "$w still running"; tail -c 1500 /tmp/scale-$w.log; fi
}
summary() {           # $1: a pytest -v log, $2: its exit status, $3: lines of its end to show
  echo "rc=$2 passed=$(grep -c ' PASSED' $1)"; grep -E "::.* (FAILED|ERROR|XFAIL|XPASS|SKIPPED)" $1 | cut -c1-160 | tail -20
  tail -${3:-15} $1
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
echo "scale runs in $SCALE_DIR; $(df -h --output=target,fstype,size,avail /tmp $SCALE_DIR | tr '\n' ';') $(free -g | sed -n 2p)"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    families) timeout 240 python3 -m pytest tests/gpu/test_model_families_gpu.py -q -x -p no:cacheprovider 2>&1 | tail -25 ;;
    bench) timeout 225 python3 scripts/bench/grpo_step_gpu.py --miles-iters 21 --trl-steps 3 --side-timeout-s 140 --out /tmp/bench05 > $OUT/bench05.log 2>&1; tail -c 6000 $OUT/bench05.log ;;
    gpuA) timeout ${GPUA_S:-575} python3 -m pytest tests/gpu -v -p no:cacheprovider --durations=12 --ignore tests/gpu/test_faults_gpu.py --ignore tests/gpu/test_model_families_gpu.py --ignore tests/gpu/test_megatron_gpu.py > $OUT/gpuA.log 2>&1; summary $OUT/gpuA.log $? 30 ;;
    gpuB) timeout 400 python3 -m pytest tests/gpu/test_megatron_gpu.py tests/gpu/test_model_families_gpu.py -q -p no:cacheprovider --durations=8 2>&1 | tail -30 ;;
    fsdpbench|fsdpbench:*) n=${step#fsdpbench}; n=${n#:}; av=FSDP_ARGS${n:+_$n}   # fsdpbench:tok reads FSDP_ARGS_tok
        timeout ${FSDP_S:-150} python3 scripts/bench/fsdp_step_gpu.py --out $OUT/fsdp${n:+-$n}.json ${!av:-} > /tmp/fsdp$n.log 2>&1; tail -c 3000 /tmp/fsdp$n.log ;;
    mfu) timeout ${MFU_S:-480} python3 scripts/bench/train_mfu_gpu.py --out $OUT/mfu.json ${MFU_ARGS:-} > /tmp/mfu.log 2>&1
        echo "rc=$?"; cp /tmp/mfu.log $OUT/; tail -c 4000 /tmp/mfu.log ;;
    wgrad) timeout 120 python3 scripts/bench/wgrad_accum_gpu.py --out $OUT/wgrad.json 2>&1 | tail -c 4000 ;;
    megatron) timeout ${MEGATRON_S:-300} python3 -m pytest tests/gpu/test_megatron_gpu.py -q -p no:cacheprovider --durations=6 2>&1 | tail -20 ;;
    scale:*|bgscale:*) w=${step#*scale:}; k=${w//[.-]/_}; sv=SCALE_S_$k; av=SCALE_ARGS_$k   # per workload: SCALE_S_8b_2k, SCALE_ARGS_8b_2k
        rm -f /tmp/scale-$w.rc
        # in a session of its own (setsid): a bgscale run outlives this call; `waitscale:W` in the next call
        # (made while the machine is still warm) waits for it and brings its results back
        setsid bash -c "timeout ${!sv:-${SCALE_S:-330}} python3 scripts/bench/grpo_scale_gpu.py --workload $w ${!av:-${SCALE_ARGS:-}} \
          --out $SCALE_DIR/scale-$w > /tmp/scale-$w.json 2> /tmp/scale-$w.log; echo \$? > /tmp/scale-$w.rc" < /dev/null &
        # the host's memory every 10 s while it runs (the Dec 7 run was ended by host memory): $OUT/W-host-mem.log
        setsid bash -c "while [ ! -f /tmp/scale-$w.rc ]; do echo \$(date +%T) \$(free -m | sed -n 2p) \$(ps -eo rss,comm --sort=-rss | sed -n 2,4p | tr '\n' ' '); sleep 10; done" > /tmp/scale-$w.mem 2>&1 < /dev/null &
        if [ ${step%%:*} = bgscale ]; then wait_scale $w ${BG_WAIT_S:-480}; else wait; wait_scale $w 5; fi ;;
    waitscale:*) wait_scale ${step#waitscale:} ${WAIT_S:-400} ;;
    moeA) # issue 55's run, first call: the GPU tests it leans on, the full-size rollout bench, then the 12-layer GRPO
        # with R3's effect started in the background (an H100's 80 GB: the 8-layer cut, what fits); moeB, the next
        # call made at once while the machine is warm, waits for it and brings it back
        mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
        cut=$([ "${mem:-0}" -lt 100000 ] && echo "--layers 8")
        echo "GPU memory ${mem} MiB: ${cut:-the 12-layer cut}"
        TESTS_S=150 S_moe_rollout_gpu=170 SCALE_S_30b_a3b_12l=800 BG_WAIT_S=220 SCALE_ARGS_30b_a3b_12l="--r3-effect \
          --miles-iters 4 --r3-iters 1 --skip-trl --side-timeout-s 380 --r3-timeout-s 230 $cut" bash "$0" \
          tests:tests/gpu/test_offload_cuda.py,tests/gpu/test_moe_gpu.py script:moe_rollout_gpu bgscale:30b-a3b-12l ;;
    moeB) WAIT_S=570 bash "$0" waitscale:30b-a3b-12l ;;
    gpuP) s=${GPUP_S:-330}; i=0   # tests/gpu but SERIAL, in three lanes at once (each its own pytest and Ray);
        # GPUP_LANE4: files for a fourth lane, e.g. test_memory_plan_gpu.py (it reads only its own allocations)
        for lane in "$LANE1" "$LANE2" "$LANE3" ${GPUP_LANE4:+"$GPUP_LANE4"}; do i=$((i + 1))
          (timeout $s python3 -m pytest $lane -v -p no:cacheprovider --durations=10 > $OUT/lane$i.log 2>&1; echo $? > /tmp/lane$i.rc) &
        done; wait
        for i in $(seq $i); do echo "--- lane$i"; summary $OUT/lane$i.log "$(cat /tmp/lane$i.rc)" 3; done ;;
    gpuS) timeout ${GPUS_S:-330} python3 -m pytest $SERIAL -v -p no:cacheprovider --durations=10 > $OUT/serial.log 2>&1; summary $OUT/serial.log $? ;;
    tests:*) t=${step#tests:}   # the verbose log comes back as $OUT/tests.log (a run cut by its bound keeps its failures' reports)
        timeout ${TESTS_S:-300} python3 -m pytest ${t//,/ } -v -p no:cacheprovider --durations=8 > $OUT/tests.log 2>&1; summary $OUT/tests.log $? ;;
    faults) timeout 260 python3 -m pytest tests/gpu/test_faults_gpu.py -q -p no:cacheprovider 2>&1 | tail -15 ;;
    script:*) n=${step#script:}; k=${n//[.-]/_}; av=ARGS_$k; sv=S_$k   # script:moe_rollout_gpu runs scripts/bench/moe_rollout_gpu.py
        timeout ${!sv:-300} python3 scripts/bench/$n.py --out $OUT/$n.json ${!av:-} > $OUT/$n.log 2>&1; echo "rc=$?"; tail -c 4000 $OUT/$n.log ;;
    basebench) # the colocated bench on the tree BASE_TREE names (`git archive BASE miles machines scripts | tar -x -C bench-base`, untracked), then on this tree
        # BASEBENCH_ORDER (default "base head"): e.g. "head base" checks the order's own effect (the second side
        # finds the first's compile caches and a warmer GPU); "base head base head" alternates: run k of a side
        # writes basebench-SIDE.json the first time, basebench-SIDE-k.json after
        declare -A seen=()
        for side in ${BASEBENCH_ORDER:-base head}; do [ $side = base ] && dir=$PWD/bench-base || dir=$PWD
          k=$(( ${seen[$side]:-0} + 1 )); seen[$side]=$k; name=basebench-$side$([ $k -gt 1 ] && echo "-$k")
          (cd $dir && PYTHONPATH=/tmp/site:$dir timeout ${BASEBENCH_S:-150} python3 scripts/bench/grpo_step_gpu.py --skip-trl --miles-iters ${BASEBENCH_ITERS:-9} \
            --side-timeout-s $((${BASEBENCH_S:-150} - 10)) --out /tmp/bb-$side > $OUT/$name.json 2> $OUT/$name.log)
          echo "--- $name rc=$?"; python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['miles']; print({k: m.get(k) for k in ('steady_iteration_s', 'first_iteration_s', 'steady_phase_s', 'steady_train_mfu')})
med=lambda xs: (lambda v: sorted(v)[len(v) // 2] if v else None)([x for x in xs[1:] if x is not None])
print('weight_sync split (median of iterations 2+): phase', med(m['phase_s']['weight_sync']), 'push+read-back', med(m['weight_sync_s']), 'memory_to_engines', med(m['memory_handoff_s']['memory_to_engines']))" $OUT/$name.json 2>&1 | tail -4
          grep -rhoE '"kv_cache_gib": [0-9.]+|kv_cache_gib=[0-9.]+' /tmp/bb-$side/miles.log /tmp/bb-$side/miles-run/logs 2>/dev/null | head -1
        done ;;
    fp8) timeout ${FP8_S:-570} python3 scripts/bench/fp8_rollout_gpu.py --out $OUT/fp8.json ${FP8_ARGS:-} > /tmp/fp8.log 2>&1
        echo "rc=$?"; cp /tmp/fp8.log $OUT/; tail -c 2500 /tmp/fp8.log; cat $OUT/fp8.json 2>/dev/null | tail -c 5000 ;;
    enginecaps) timeout ${CAPS_S:-150} python3 scripts/bench/engine_caps.py --prompts 256 --max-cap 512 --distinct 64 \
        --out $OUT/engine_caps.json > /tmp/caps.log 2>&1; echo "rc=$?"; tail -c 2500 /tmp/caps.log ;;
  esac
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
done
echo "=== done $(date +%T)"
