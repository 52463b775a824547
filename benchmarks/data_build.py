"""The host's share of a step: data.py's start-up checks and batch building at Geometry3K's scale, and the size
and pickling time of a batch as the trainer hands it to the workers (Ray pickles each call's samples).

    python benchmarks/data_build.py [--rows 2048] [--batch 512] [--workers 16] [--out results.json]

Writes a synthetic parquet in Geometry3K's schema under /tmp/bench_data (one PNG line drawing of 200-600 px a row,
as its diagrams), and a processor folder from the toy's (`python toy.py` first) with Qwen2.5-VL's own pixel
limits, so that, as with the real model, the processor keeps the size data.py resizes to (configs/geo3k.yaml:
min_pixels 262,144). Reports the start-up check's rows/s with --workers processes, the median of 3 batch builds
(no prefetch: the first training batch and every validation batch are built so), and one batch's samples, each
prompt's 5 responses sharing its tensors as trainer.py's do: pickled bytes and the seconds to pickle and
unpickle them, and the seconds a call of a Ray actor on this machine takes to receive them (median of 3), through
torch's pickling and as workers.py sends them (send_tensors_as_bytes: out of band), each with pixel values as the
processor makes them (fp32) and in bf16.
"""

import argparse
import io
import json
import os
import pickle
import random
import shutil
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
from config import load_config  # noqa: E402

FOLDER = "/tmp/bench_data"


def write_rows(n):
    import pandas
    from PIL import Image, ImageDraw

    rng, rows = random.Random(0), []
    for _ in range(n):
        image = Image.new("RGB", (rng.randint(200, 600), rng.randint(200, 500)), "white")
        draw = ImageDraw.Draw(image)
        for _ in range(20):
            draw.line([rng.randint(0, 199) for _ in range(4)], fill="black", width=2)
        png = io.BytesIO()
        image.save(png, "PNG")
        rows.append({"images": [{"bytes": png.getvalue(), "path": None}], "answer": str(rng.randint(1, 99)),
                     "problem": "<image>Find x. " + "The triangle has sides a, b and c. " * rng.randint(1, 6)})
    path = os.path.join(FOLDER, f"train_{n}.parquet")
    pandas.DataFrame(rows).to_parquet(path)
    return path


def processor_folder():
    """The toy model's tokenizer and processor, with Qwen2.5-VL's own max_pixels (12,845,056) for images."""
    toy, out = os.path.join(ROOT, ".toy", "vl_model"), os.path.join(FOLDER, "processor")
    if not os.path.isdir(toy):
        sys.exit(f"{toy} is missing: run `python toy.py` first")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(toy, out, ignore=shutil.ignore_patterns("*.safetensors"))
    path = os.path.join(out, "processor_config.json")
    config = json.load(open(path))
    config["image_processor"]["size"]["longest_edge"] = 12845056
    json.dump(config, open(path, "w"), indent=2)
    return out


def ray_call_seconds(samples):
    """{"torch_pickle": s, "as_bytes": s}: a Ray actor's call that receives `samples`, median of 3 after one."""
    import ray

    import workers

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": workers._worker_env()})  # as the run
    receiver, seconds = ray.remote(Receiver).remote(), {}
    for name in ("torch_pickle", "as_bytes"):
        if name == "as_bytes":
            workers.send_tensors_as_bytes()
        times = []
        for _ in range(4):
            start = time.perf_counter()
            ray.get(receiver.take.remote(samples))
            times.append(time.perf_counter() - start)
        seconds[name] = round(statistics.median(times[1:]), 2)
        ray.util.deregister_serializer(torch.Tensor)
    return seconds


class Receiver:
    def take(self, samples):
        return len(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count()))
    parser.add_argument("--out")
    args = parser.parse_args()
    os.makedirs(FOLDER, exist_ok=True)
    files, model = write_rows(args.rows), processor_folder()
    cfg = load_config(os.path.join(ROOT, "configs", "geo3k.yaml"),
                      [f"data.train_files={files}", "data.format_prompt=null",
                       f"data.filter_overlong_prompts_workers={args.workers}"])
    from transformers import AutoConfig

    processor, _ = data.load_processor(model, cfg.data)
    start = time.perf_counter()
    loader = data.PromptLoader(files, cfg.data, processor, AutoConfig.from_pretrained(model),
                               batch_size=args.batch, shuffle=True, drop_last=True)
    checked = time.perf_counter() - start
    builds = []
    for _ in range(3):
        start = time.perf_counter()
        batch = next(loader)
        builds.append(time.perf_counter() - start)
    samples = [{"uid": p["uid"], "prompt_ids": p["prompt_ids"], "position_ids": p["position_ids"],
                "multi_modal_inputs": p["multi_modal_inputs"], "response_ids": list(range(256))}
               for p in batch for _ in range(5)]  # as trainer._sample: one prompt's tensors shared by its responses
    transfer = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):  # as built; as bf16 compute reads them
        cast = {id(p["multi_modal_inputs"]): {k: v.to(dtype) if v.is_floating_point() else v
                                              for k, v in p["multi_modal_inputs"].items()} for p in batch}
        these = [{**s, "multi_modal_inputs": cast[id(s["multi_modal_inputs"])]} for s in samples]
        start = time.perf_counter()
        blob = pickle.dumps(these, protocol=pickle.HIGHEST_PROTOCOL)
        dumped = time.perf_counter() - start
        pickle.loads(blob)
        transfer[name] = {"gb": round(len(blob) / 1e9, 3), "dumps_s": round(dumped, 2),
                          "loads_s": round(time.perf_counter() - start - dumped, 2)}
        del blob
        transfer[name]["ray_call_s"] = ray_call_seconds(these)
        del these, cast
    result = {"rows": args.rows, "workers": args.workers, "start_up_check_s": round(checked, 2),
              "start_up_rows_per_s": round(args.rows / checked), "batch": args.batch,
              "batch_build_s_median": round(statistics.median(builds), 2),
              "prompts_per_s": round(args.batch / statistics.median(builds), 1),
              "image_patches_mean": round(statistics.fmean(p["multi_modal_inputs"]["pixel_values"].shape[0]
                                                           for p in batch)),
              "samples_pickled": transfer,
              "cpus": os.cpu_count()}
    print(json.dumps(result, indent=2))
    if args.out:
        json.dump(result, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
