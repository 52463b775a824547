"""Rollout engines on a GPU: generation throughput, weight-sync time, sleep memory and log-prob agreement.

    python benchmarks/rollout_throughput.py --engine vllm      # needs requirements-gpu.txt
    python benchmarks/rollout_throughput.py --engine hf

Builds a random-init Qwen2.5-VL with the shapes of the 3B model (toy.py's VL_SHAPES["3b"], vocabulary 151,936)
under /tmp (or uses BENCH_MODEL), in bf16. Then, for the chosen engine:
  1. weight sync: load_weights(state dict of the transformers model) + wake_up, seconds (median of 3);
  2. log-prob agreement: 64 sampled tokens of 8 prompts, the engine's processed log-probs against a
     transformers bf16 forward of prompt + response (mean and max |delta|);
  3. throughput: batch 64 and 256 prompts of 256 random tokens, 256 new tokens each (EOS ignored),
     new tokens per second, median of 3 runs after a warm-up;
  4. (vllm) GPU memory before and after sleep(level=1), GiB.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rollout  # noqa: E402
from config import RolloutConfig  # noqa: E402
import toy  # noqa: E402

MODEL = os.environ.get("BENCH_MODEL", "/tmp/bench_qwen25vl_3b")


def build_model():
    """A 3B-sized random Qwen2.5-VL folder with the toy tokenizer padded to Qwen's vocabulary (toy.py)."""
    if not os.path.exists(os.path.join(MODEL, "config.json")):
        toy.build_vl_model(MODEL, toy.build_tokenizer(pad_to=151936), seed=0, shape="3b", device="cuda")


def prompts(batch, length=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(batch):
        ids = torch.randint(200, 150000, (length,), generator=g).tolist()
        out.append({"uid": str(i), "prompt_ids": ids, "raw_prompt_ids": ids, "images": [], "multi_modal_inputs": {},
                    "position_ids": torch.arange(length)[None].expand(4, -1)})
    return out


def timed(fn, repeats=3):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["vllm", "hf"], required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29533", "VLLM_USE_FLASHINFER_SAMPLER": "0"})
    build_model()
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(MODEL, dtype=torch.bfloat16).cuda().eval()
    state = {k: v for k, v in hf.state_dict().items()}
    cfg = RolloutConfig(name=args.engine, ignore_eos=True, tensor_parallel_size=1, max_num_batched_tokens=16384,
                        disable_tqdm=True)
    engine = rollout.make_rollout(cfg, MODEL, max_prompt_length=256, max_response_length=256, device="cuda",
                                  batch_size=256)
    result = {"gpu": torch.cuda.get_device_name(), "engine": args.engine}

    def sync():
        engine.load_weights(iter(state.items()))
        engine.wake_up()

    result["weight_sync_s"] = timed(sync)

    # Log-prob agreement after the sync.
    sample = engine.generate(prompts(8, seed=1), n=1, temperature=1.0, max_tokens=64, seed=3)
    diffs = []
    with torch.no_grad():
        for p, r in zip(prompts(8, seed=1), sample):
            ids = torch.tensor([p["prompt_ids"] + r["response_ids"]], device="cuda")
            logits = hf(input_ids=ids).logits[0, len(p["prompt_ids"]) - 1:-1].float()
            want = torch.log_softmax(logits, -1).gather(-1, ids[0, len(p["prompt_ids"]):, None])[:, 0].cpu()
            diffs.append((want - torch.tensor(r["logprobs"])).abs())
    d = torch.cat(diffs)
    result["logprob_abs_diff"] = {"mean": d.mean().item(), "max": d.max().item()}

    for batch in (64, 256):
        batch_prompts = prompts(batch)
        seconds = timed(lambda: engine.generate(batch_prompts, n=1, temperature=1.0, max_tokens=256, seed=5))
        result[f"new_tokens_per_s_batch{batch}"] = batch * 256 / seconds
        print(json.dumps(result), flush=True)

    if args.engine == "vllm":
        before = torch.cuda.mem_get_info()
        engine.sleep()
        after = torch.cuda.mem_get_info()
        result["sleep_freed_gib"] = (after[0] - before[0]) / 2**30
    print(json.dumps(result, indent=1))
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
