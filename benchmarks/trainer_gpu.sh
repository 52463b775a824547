#!/usr/bin/env bash
# trainer.py on GPUS GPUs of one machine with the vLLM engine, a few steps each:
#   1. the toy world (configs/toy.yaml, bf16 compute);
#   2. a random-init 3B-sized Qwen2.5-VL (python toy.py --vl-3b; RUNS=7b: the 7B-sized one, --vl-7b) on the
#      toy colours task, its images scaled up to 512 x 512 (324 image tokens), BATCH prompts x 5 responses of up
#      to 512 tokens per step, two updates per step, full fine-tuning (fp32 weights and AdamW state, bf16
#      compute), a model-only save at the end (deleted after the run unless KEEP_CHECKPOINTS=1).
# Then prints seconds per step and the per-stage timings (median over the steps after the first) of each, with
# perf/throughput (prompt + response tokens / step seconds / GPUs, EasyR1's tokens/s/GPU), perf/mfu_actor and the
# peak device memory of each phase (perf/peak_device_memory_gb/*), with what vLLM's sleep freed
# (perf/rollout_sleep_freed_gb). COMPONENTS=1 then times the bare parts of the 3B step on the same prompts (the
# first BATCH of the colours task, images included, 5 responses of 512 tokens each) and the same one-GPU path
# (benchmarks/actor_paths.py --images --generate: vLLM generate, log-prob pass, update; fp32 master weights under
# autocast, compiled layers; COMPONENT_MODES=... adds others) and prints their sum against the 3B step, the
# profiled kernel time by kind, the GPU's idle gaps by host op and the allocator's counters (all in
# components.json).
#
#   GPUS=2 STEPS=3 BATCH=32 bash benchmarks/trainer_gpu.sh [OUT]   # needs requirements-gpu.txt
#   EXTRA="worker.rollout.tensor_parallel_size=2" GPUS=2 RUNS=3b ...   # more overrides for the 3B/7B-sized run
#   EXTRA="worker.actor.fsdp.torch_dtype=bf16 worker.actor.optim.strategy=adamw_bf16" BATCH=16 RUNS=7b ...
set -euo pipefail
OUT=${1:-/tmp/trainer_gpu}
MODELS=${MODELS:-$OUT}      # where the random-init 3B/7B-sized models are built (once) and reused
STEPS=${STEPS:-6}
GPUS=${GPUS:-1}
BATCH=${BATCH:-64}
MICRO=${MICRO:-16384}      # worker.actor.max_tokens_per_micro_batch of the 3B/7B-sized run (and COMPONENTS)
RUNS=${RUNS:-"toy 3b"}     # RUNS=3b: only the 3B-sized run; RUNS=7b: the 7B-sized one
GPU="trainer.device=cuda trainer.n_gpus_per_node=$GPUS worker.rollout.name=vllm worker.rollout.dtype=bf16
     worker.actor.fsdp.torch_dtype=null worker.actor.fsdp.mp_param_dtype=bf16 worker.ref.fsdp.mp_param_dtype=bf16
     trainer.val_before_train=false trainer.val_freq=-1 worker.rollout.disable_tqdm=true"

if [[ $RUNS == *toy* ]]; then
python trainer.py --config configs/toy.yaml $GPU trainer.max_steps=$STEPS trainer.save_checkpoint_path=$OUT/toy \
    worker.rollout.gpu_memory_utilization=0.2 trainer.find_last_checkpoint=false  # a run again: earlier one set aside
fi

for SIZE in 3b 7b; do
if [[ " $RUNS " == *" $SIZE "* ]]; then
[ -f $MODELS/qwen25vl-$SIZE/config.json ] || python toy.py --vl-$SIZE $MODELS/qwen25vl-$SIZE
python trainer.py --config configs/toy.yaml $GPU trainer.max_steps=$STEPS trainer.save_checkpoint_path=$OUT/$SIZE \
    worker.actor.model.model_path=$MODELS/qwen25vl-$SIZE worker.actor.model.enable_gradient_checkpointing=true \
    worker.actor.optim.lr=1e-6 worker.actor.optim.weight_decay=0.01 worker.actor.max_tokens_per_micro_batch=$MICRO \
    data.min_pixels=262144 data.max_pixels=262144 data.max_prompt_length=512 data.max_response_length=512 \
    data.rollout_batch_size=$BATCH worker.rollout.n=5 worker.actor.global_batch_size=$((BATCH / 2)) \
    worker.rollout.gpu_memory_utilization=0.35 worker.rollout.max_num_batched_tokens=16384 \
    trainer.save_freq=-1 trainer.save_model_only=true trainer.find_last_checkpoint=false ${EXTRA:-}
[[ ${KEEP_CHECKPOINTS:-0} == 1 ]] || rm -rf $OUT/$SIZE/global_step_*  # 16 GB a 7B run: back-to-back runs fill a disk
fi
done

if [[ ${COMPONENTS:-0} == 1 ]]; then
BENCH_MODEL=$MODELS/qwen25vl-3b python benchmarks/actor_paths.py --modes ${COMPONENT_MODES:-fp32+compile} \
    --samples $((BATCH * 5)) --images .toy/colors@train --response 512 --optimizer-steps 2 --generate --repeats 1 \
    --micro-tokens $MICRO \
    --out $OUT/components.json
fi

python - $OUT $(for r in $RUNS; do echo $OUT/$r; done) <<'PY'
import json, os, statistics, sys
step = None
for run in sys.argv[2:]:
    rows = [json.loads(line) for line in open(f"{run}/experiment_log.jsonl")]
    rows = [r for r in rows if "timing_s/step" in r]
    later = rows[1:] or rows
    keys = sorted(k for k in later[0] if k.startswith(("timing_s/", "perf/")) or k.startswith("response_length/mean"))
    print(run, f"steps {len(rows)}; first step {rows[0]['timing_s/step']:.1f} s; median of steps 2..{len(rows)}:")
    for k in keys:
        print(f"  {k:36s} {statistics.median(r[k] for r in later if k in r):10.3f}")
    step = statistics.median(r["timing_s/step"] for r in later) if run.endswith("/3b") else step
if os.path.exists(f"{sys.argv[1]}/components.json"):  # COMPONENTS=1: the bare parts against the 3B step
    c = json.load(open(f"{sys.argv[1]}/components.json"))
    m = c["modes"][0]
    bare = c["generate_s"] + m["old_s"] + m["update_s"]
    print(f"bare parts ({m['mode']}, images {c['images']}): generate {c['generate_s']:.2f} s, log-probs "
          f"{m['old_s']:.2f} s, update {m['update_s']:.2f} s (MFU {m['mfu_update']:.3f}) = {bare:.2f} s"
          + (f"; the 3B step is {step / bare:.2f}x that" if step else ""))
    for name in ("profile_old_micro_batch", "profile_update_micro_batch"):
        print(f"  {name}: kernel ms by kind {m[name]['kernel_ms_by_kind']}, wall {m[name]['wall_ms']} ms")
        print(f"    GPU idle gaps by host op (outermost > innermost): {m[name]['idle_gaps']}")
    print(f"  allocator while timed: {m['allocator_during_timing']}")
    print(f"  host syncs of one micro-batch, log-probs: {m['sync_points_old']}; update: {m['sync_points_update']}")
PY
