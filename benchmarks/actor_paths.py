"""The actor's log-prob pass and update on one GPU, per weight mode: tokens/s, MFU, memory, and a profile.

    python benchmarks/actor_paths.py [--modes fp32,bf16,fp32-fsdp] [--actor-file OTHER/actor.py] [--out r.json]
    python benchmarks/actor_paths.py --modes fp32 --samples 160 --prompt 340 --generate   # a step's bare parts
    python benchmarks/actor_paths.py --modes fp32+compile --samples 160 --images .toy/colors@train --generate

A random-init 3B-sized Qwen2.5-VL (toy.py's VL_SHAPES["3b"]; built under /tmp or BENCH_MODEL), gradient
checkpointing on, 40 samples of a 330-token prompt and a 512-token response (33.7k tokens, about three packed
micro-batches of at most 16,384 tokens), one optimizer step per update (`--optimizer-steps`). Modes:
    fp32       fp32 master weights and AdamW state, bf16 compute by autocast (one GPU, no process group)
    bf16       bf16 weights (fsdp.torch_dtype=bf16), plain AdamW
    fp32-fsdp  as fp32, but FSDP2 over a one-rank process group (bf16 MixedPrecisionPolicy)
    MODE+compile  MODE with worker.actor.use_torch_compile (each decoder layer and vision block torch.compiled)
    MODE+nockpt   MODE without gradient checkpointing (no recomputed forward in the update)
For each: Actor.compute_log_probs and Actor.update, median of 3 after a warm-up (synchronised), response +
prompt tokens per second, the update's perf/mfu_actor, torch's peak allocated memory, the caching allocator's
retries and cudaMalloc / cudaFree calls while timed, and the top CUDA kernels of one log-prob micro-batch and
one update micro-batch (torch.profiler), with their kernel time summed by kind (GEMM, attention, Triton-fused,
copies and casts, the rest), the profiled span's idle GPU time, the host ops with the most CPU time and the host
op the GPU waited on in each idle gap.
`--actor-file` times another copy of actor.py (for a before/after comparison). `--samples/--prompt/--response`
change the shape; `--images SOURCE` takes the trainer's own prompts instead (data.py, images included, 5
responses each: the vision tower runs in every pass and in vLLM); `--generate` first times a plain vLLM generate
of the same samples (`--response` tokens each, EOS ignored, the engine alone: no Ray, no weight sync), so the
three bare parts of a training step can be set against it.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import toy  # noqa: E402
from config import RolloutConfig  # noqa: E402
from test_actor import actor_config  # noqa: E402

MODEL = os.environ.get("BENCH_MODEL", "/tmp/bench_qwen25vl_3b")
PROMPT, RESPONSE, SAMPLES, STEPS, MICRO = 330, 512, 40, 1, 16384  # changed by the command line
IMAGES, N, PROMPTS = None, 5, None  # --images: the trainer's prompts of that source, N responses each


def load_actor_module(path):
    if path is None:
        import actor
        return actor
    spec = importlib.util.spec_from_file_location("actor_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def image_prompts():
    """SAMPLES // N prompt dicts of the source IMAGES, built as trainer_gpu.sh's 3B run builds them (data.py,
    configs/toy.yaml's data section, every image scaled to 512 x 512: 324 image tokens)."""
    import data
    from config import load_config

    cfg = load_config("configs/toy.yaml", [f"data.train_files={IMAGES}", "data.min_pixels=262144",
                                           "data.max_pixels=262144", "data.max_prompt_length=512"]).data
    processor, _ = data.load_processor(MODEL, cfg)
    loader = data.PromptLoader(cfg.train_files, cfg, processor, MODEL, batch_size=SAMPLES // N, shuffle=False,
                               drop_last=True)
    prompts = next(loader)
    for i, p in enumerate(prompts):
        p["uid"] = str(i)
    return prompts


def make_samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    if IMAGES:  # N responses of RESPONSE random tokens to each of the trainer's prompts
        return [{"uid": p["uid"], "prompt_ids": p["prompt_ids"], "position_ids": p["position_ids"],
                 "multi_modal_inputs": p["multi_modal_inputs"], "advantage": 1.0,
                 "response_ids": torch.randint(200, 150000, (RESPONSE,), generator=g).tolist()}
                for p in PROMPTS for _ in range(N)]
    out = []
    for _ in range(SAMPLES):
        ids = torch.randint(200, 150000, (PROMPT + RESPONSE,), generator=g).tolist()
        out.append({"prompt_ids": ids[:PROMPT], "response_ids": ids[PROMPT:], "multi_modal_inputs": {},
                    "position_ids": torch.arange(PROMPT)[None].expand(4, -1).clone(), "advantage": 1.0})
    return out


def timed(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


KINDS = {"attention": ("flash", "fmha", "attention", "attn"),  # before gemm: flash kernels name cutlass types
         "gemm": ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "splitk"),
         "triton": ("triton",),
         "copy_cast": ("copy", "memcpy", "memset", "cast", "to_copy")}


def top_kernels(fn, rows=8):
    """The `rows` longest CUDA kernels of one call of fn after a warm-up call (name, ms, share), then kernel ms
    summed by kind (KINDS, first match by name; the rest "other"), the profiled span's wall ms, the share of it no
    kernel ran, the `rows` host-side ops with the most self CPU time (name, calls, ms) and the idle gaps by host op
    (idle_gaps). Only device activities count as kernel time: a host op's own device time repeats its kernels'."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm-up: compilation and autotuning stay out of the profile
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    host = [(e.key[:80], e.count, round(e.self_cpu_time_total / 1e3, 1))
            for e in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]]
    events = prof.events()
    by_name = {}
    for e in events:
        if e.device_type != DeviceType.CPU:
            by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    total = sum(by_name.values()) or 1e-9
    top = [(name[:80], round(ms, 1), round(ms / total, 3))
           for name, ms in sorted(by_name.items(), key=lambda kv: kv[1], reverse=True)[:rows]]
    kinds = dict.fromkeys([*KINDS, "other"], 0.0)
    for name, ms in by_name.items():
        low = name.lower()
        kinds[next((k for k, words in KINDS.items() if any(w in low for w in words)), "other")] += ms
    return {"top": top, "kernel_ms_by_kind": {k: round(v, 1) for k, v in kinds.items()},
            "kernel_ms": round(total, 1), "wall_ms": round(wall_ms, 1),
            "idle_share": round(max(0.0, 1 - total / wall_ms), 3), "top_host_ops": host,
            "idle_gaps": idle_gaps(events, rows)}


def idle_gaps(events, rows=8, min_us=50):
    """The GPU's idle gaps of at least min_us between device activities (kernels, copies), with what the host was
    doing when each gap began: the gaps' count and ms, then the ms summed per (outermost, innermost) host op
    open at that moment on any thread (the innermost op is what the GPU waited on: a sync, a launch, Python)."""
    import heapq

    from torch.autograd import DeviceType

    busy = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type != DeviceType.CPU)
    gaps, end = [], None
    for start, stop in busy:
        if end is not None and start - end >= min_us:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    host = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type == DeviceType.CPU and not e.is_async)
    by_op, open_ops, i = {}, [], 0
    for start, stop in gaps:  # sweep: the host ops open at each gap's start
        while i < len(host) and host[i][0] <= start:
            heapq.heappush(open_ops, (host[i][1], host[i][0], host[i][2]))
            i += 1
        while open_ops and open_ops[0][0] < start:
            heapq.heappop(open_ops)
        ops = sorted((op_start, name) for _, op_start, name in open_ops)
        key = f"{ops[0][1][:50]} > {ops[-1][1][:50]}" if ops else "(no host op)"
        by_op[key] = by_op.get(key, 0.0) + (stop - start) / 1e3
    top = sorted(by_op.items(), key=lambda kv: kv[1], reverse=True)[:rows]
    return {"count": len(gaps), "ms": round(sum(b - a for a, b in gaps) / 1e3, 1),
            "by_host_op": [(k, round(v, 1)) for k, v in top]}


def sync_points(fn, rows=20):
    """Where one call of fn (already warm: top_kernels ran it) makes the host wait for the GPU: the count of syncs
    torch.cuda.set_sync_debug_mode("warn") reports (item(), tolist(), nonzero, a blocking copy), then the `rows`
    most frequent call sites, keyed by their three innermost frames outside torch, with counts. A sync in the
    backward is reported at backward()."""
    import traceback
    import warnings

    counts = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # another warning
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and "warnings" not in f.filename]
        where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        counts[where] = counts.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return {"count": sum(counts.values()), "where": sorted(counts.items(), key=lambda kv: kv[1], reverse=True)[:rows]}


def allocator_counts():
    """torch's caching-allocator counters: a retry frees every cached block after a synchronize (the GPU idles),
    device allocs / frees are cudaMalloc / cudaFree calls (empty_cache, fragmentation)."""
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}


def bare_generate(repeats):
    """Seconds of one vLLM generate of SAMPLES prompts x RESPONSE new tokens (median after a warm-up), then sleep."""
    import rollout
    from transformers import AutoModelForImageTextToText

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29533", "VLLM_USE_FLASHINFER_SAMPLER": "0"})
    cfg = RolloutConfig(name="vllm", ignore_eos=True, gpu_memory_utilization=0.35, tensor_parallel_size=1,
                        max_num_batched_tokens=16384, disable_tqdm=True)
    longest = max([PROMPT] + [len(p["prompt_ids"]) for p in PROMPTS or []])
    engine = rollout.make_rollout(cfg, MODEL, max_prompt_length=longest, max_response_length=RESPONSE, device="cuda")
    hf = AutoModelForImageTextToText.from_pretrained(MODEL, dtype=torch.bfloat16)
    engine.load_weights(iter(hf.state_dict().items()))
    del hf
    if IMAGES:  # the trainer's prompts, images and all, N responses each
        prompts, n = PROMPTS, N
    else:
        prompts, n = [{"uid": str(i), "raw_prompt_ids": s["prompt_ids"]} for i, s in enumerate(make_samples())], 1
    seconds, _ = timed(lambda: engine.generate(prompts, n=n, max_tokens=RESPONSE, seed=5), repeats)
    engine.sleep()
    return seconds


def run_mode(actor, mode, repeats):
    weights = "bf16" if mode.startswith("bf16") else "fp32"
    cfg = actor_config(MODEL, max_tokens_per_micro_batch=MICRO, compute_entropy=False,
                       global_batch_size=SAMPLES // STEPS, use_torch_compile="+compile" in mode,
                       **{"fsdp.torch_dtype": weights, "fsdp.mp_param_dtype": "bf16", "fsdp.mp_reduce_dtype": "fp32",
                          "model.enable_gradient_checkpointing": "+nockpt" not in mode, "optim.lr": 1e-6})
    policy = actor.Actor(cfg, device="cuda", max_prompt_length=PROMPT, max_response_length=RESPONSE,
                         training_steps=100)
    samples = make_samples()
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    tokens = sum(lengths)
    torch.cuda.reset_peak_memory_stats()
    before = allocator_counts()
    old_s, old = timed(lambda: policy.compute_log_probs(samples), repeats)
    for s, lp in zip(samples, old):
        s["old_logprobs"] = lp
    update_s, metrics = timed(lambda: policy.update(samples), repeats)
    result = {"mode": mode, "tokens": tokens, "old_tokens_per_s": tokens / old_s,
              "update_tokens_per_s": tokens / update_s, "old_s": old_s, "update_s": update_s,
              "mfu_update": metrics.get("perf/mfu_actor"),
              "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
              "allocator_during_timing": {k: v - before[k] for k, v in allocator_counts().items()}}
    print(json.dumps(result), flush=True)
    one = samples[:next((i for i in range(len(lengths)) if sum(lengths[:i + 1]) > MICRO), len(samples))]
    # one micro-batch of each pass (the first samples within the budget), profiled; then their host syncs
    policy.cfg.global_batch_size = policy.mini_batch_size = len(one)  # the actor reads its mini-batch size once
    result["profile_old_micro_batch"] = top_kernels(lambda: policy.compute_log_probs(one))
    result["profile_update_micro_batch"] = top_kernels(lambda: policy.update(one))
    result["sync_points_old"] = sync_points(lambda: policy.compute_log_probs(one))
    result["sync_points_update"] = sync_points(lambda: policy.update(one))
    del policy
    torch.cuda.empty_cache()
    return result


def main():
    global SAMPLES, PROMPT, RESPONSE, STEPS, MICRO, IMAGES, PROMPTS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fp32,bf16,fp32-fsdp")
    parser.add_argument("--actor-file", default=None, help="another actor.py to time instead of this one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--prompt", type=int, default=PROMPT)
    parser.add_argument("--response", type=int, default=RESPONSE)
    parser.add_argument("--micro-tokens", type=int, default=MICRO, help="worker.actor.max_tokens_per_micro_batch")
    parser.add_argument("--optimizer-steps", type=int, default=STEPS, help="mini-batches per update")
    parser.add_argument("--generate", action="store_true", help="first time a plain vLLM generate of the samples")
    parser.add_argument("--images", default=None, metavar="SOURCE",
                        help=f"the trainer's prompts of SOURCE (e.g. .toy/colors@train), images included, {N} "
                             f"responses each, instead of random text-only prompts of --prompt tokens")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    SAMPLES, PROMPT, RESPONSE, STEPS = args.samples, args.prompt, args.response, args.optimizer_steps
    MICRO = args.micro_tokens
    if not os.path.exists(os.path.join(MODEL, "config.json")):
        toy.build_vl_model(MODEL, toy.build_tokenizer(pad_to=151936), seed=0, shape="3b", device="cuda")
    IMAGES = args.images
    PROMPTS = image_prompts() if IMAGES else None
    actor = load_actor_module(args.actor_file)
    results = {"gpu": torch.cuda.get_device_name(), "actor": args.actor_file or "actor.py", "modes": [],
               "samples": SAMPLES, "prompt": PROMPT, "response": RESPONSE, "images": IMAGES}
    if args.generate:
        results["generate_s"] = bare_generate(args.repeats)
        responses = len(PROMPTS) * N if IMAGES else SAMPLES
        results["generate_new_tokens_per_s"] = responses * RESPONSE / results["generate_s"]
        print(json.dumps(results), flush=True)
    for mode in args.modes.split(","):
        if mode.startswith("fp32-fsdp") and not torch.distributed.is_initialized():
            os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29541"})
            torch.distributed.init_process_group("nccl", rank=0, world_size=1)
        results["modes"].append(run_mode(actor, mode, args.repeats))
        print(json.dumps(results["modes"][-1], indent=1), flush=True)
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
