"""Packed vs per-sequence log-probs of the actor's packed pass (modeling.py) on a GPU, in bf16 and fp32, and its time.

    python benchmarks/packed_logprobs.py [--out results.json]

Builds a random-init Qwen2.5-VL (8 layers, hidden 1024, vision depth 4; weights scaled up so the
log-probs are not flat) under /tmp, samples 8 prompts (two of every three with an image) with 256-token
responses drawn from the model itself, then compares Actor.compute_log_probs (packed, one row per
micro-batch, the attention backend modeling.py picks: flash-attn varlen, else torch varlen_attn) with a
plain transformers sdpa forward of each sequence alone. Reports max and mean |delta logp| and the median
of 5 timed log-prob passes after a warm-up.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import actor  # noqa: E402
from test_actor import actor_config  # noqa: E402  (config.ActorConfig with the CPU tests' settings)

MODEL = "/tmp/bench_mid_vl"
IMG, VID, VS, VE = 5, 6, 3, 4


def build_model():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=8192, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 8, 8]}),
        vision_config=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=1024,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[3]),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # sharper than the random init, so log-probs are not flat
        model.lm_head.weight.mul_(6)
        for name, p in model.named_parameters():
            if p.ndim == 2 and "layers" in name:
                p.mul_(1.5)
    model.save_pretrained(MODEL)


def make_samples(n, seed=0):
    """Prompts of 50-400 text tokens, an image of 16 x (12..20) patches in two of three, 4-row positions."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        pre = torch.randint(10, 32000, (int(torch.randint(50, 400, (1,), generator=g)),), generator=g).tolist()
        post = torch.randint(10, 32000, (20,), generator=g).tolist()
        if i % 3 != 2:
            h, w = 16, 12 + 4 * (i % 3)
            mm = {"pixel_values": torch.randn(h * w, 3 * 2 * 14 * 14, generator=g),
                  "image_grid_thw": torch.tensor([[1, h, w]])}
            ids = pre + [VS] + [IMG] * (h * w // 4) + [VE] + post
            start = len(pre) + 1
            rows = [list(range(start)) for _ in range(3)]
            for a in range(h // 2):
                for b in range(w // 2):
                    rows[0].append(start)
                    rows[1].append(start + a)
                    rows[2].append(start + b)
            nxt = start + max(h, w) // 2
            for k in range(len(post) + 1):
                for r in rows:
                    r.append(nxt + k)
            pos = torch.cat([torch.arange(len(ids))[None], torch.tensor(rows)])
        else:
            mm, ids = {}, pre + post
            pos = torch.arange(len(ids))[None].expand(4, -1).clone()
        samples.append({"prompt_ids": ids, "response_ids": [], "multi_modal_inputs": mm, "position_ids": pos})
    return samples


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import transformers
    from transformers import AutoModelForImageTextToText

    build_model()
    samples = make_samples(8)
    ref = AutoModelForImageTextToText.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa").cuda()
    torch.manual_seed(0)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):  # responses the model itself samples
        for s in samples:
            ids = torch.tensor([s["prompt_ids"]], device="cuda")
            mm = {k: v.cuda() for k, v in s["multi_modal_inputs"].items()}
            out = ref.generate(input_ids=ids, **mm, max_new_tokens=256, min_new_tokens=256, do_sample=True,
                               top_k=0, pad_token_id=0, eos_token_id=None)
            s["response_ids"] = [t if t not in (IMG, VID) else 7 for t in out[0, ids.shape[1]:].tolist()]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
              "tokens": sum(len(s["response_ids"]) for s in samples)}
    for dtype in ("bf16", "fp32"):
        cfg = actor_config(MODEL, max_tokens_per_micro_batch=8192, compute_entropy=False,
                           **{"fsdp.torch_dtype": "fp32", "fsdp.mp_param_dtype": dtype})
        policy = actor.Actor(cfg, device="cuda", max_prompt_length=1024, max_response_length=1024)
        policy.compute_log_probs(samples)  # warm-up
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            logps = policy.compute_log_probs(samples)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        diffs = []
        with torch.no_grad(), torch.autocast("cuda", dtype=actor.DTYPES[dtype], enabled=dtype != "fp32"):
            for s, lp in zip(samples, logps):
                ids = torch.tensor([s["prompt_ids"] + s["response_ids"]], device="cuda")
                p = s["position_ids"]
                pos = torch.cat([p, p[:, -1:] + torch.arange(1, len(s["response_ids"]) + 1)], 1)[:, None].cuda()
                mm = {k: v.cuda() for k, v in s["multi_modal_inputs"].items()}
                logits = ref(input_ids=ids, position_ids=pos, **mm).logits[0].float()
                n = len(s["prompt_ids"])
                want = torch.log_softmax(logits[n - 1:-1], -1).gather(-1, ids[0, n:, None])[:, 0].cpu()
                diffs.append((want - lp).abs())
        d = torch.cat(diffs)
        result[dtype] = {"max_abs_dlogp": d.max().item(), "mean_abs_dlogp": d.mean().item(),
                         "logprob_pass_s_median": statistics.median(times)}
        print(json.dumps(result, indent=1), flush=True)
        del policy
        torch.cuda.empty_cache()
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
