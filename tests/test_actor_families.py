"""actor.py on Qwen2-VL: packed log-probs and gradients equal a per-sequence transformers forward, on prompts built
by data.py (images, a video, text) for a tiny random Qwen2-VL. Qwen2.5-VL (the toy's family) and Qwen3-VL are
checked in tests/test_actor.py."""

import torch

from test_actor import assert_packed_equals_per_sequence, make_actor, token_weights
from test_data import builder, clip, config, png
from test_data_families import tiny_family


def test_qwen2_vl_packed_equals_per_sequence(tmp_path, toy):
    """Qwen2-VL's vision blocks attend over each image whole (no windows) and its mrope has no time scaling.
    Gradients: atol 1e-5, as lm_head's entries reach ~11 here and fp32 sums in another order move one of 10,688
    by 5e-6 (test_actor.py's 1e-6 holds for the smaller gradients of its models)."""
    path = str(tmp_path / "qwen2_vl")
    model, _ = tiny_family("qwen2_vl", path, toy)
    model = model.float().eval()
    build = builder(path, config(min_pixels=4096, max_pixels=16384, max_prompt_length=1024)).build
    rows = [{"problem": "<image>What is <image> 3 + 4?", "answer": "7", "images": [png(64, 64), png(200, 90)]},
            {"problem": "What is 3 + 4?", "answer": "7"},
            {"problem": "<video>Which colour, <image>?", "answer": "red", "images": [png(64, 64)],
             "videos": [clip(8, size=(64, 64), fps=4)]}]
    samples = []
    for i, row in enumerate(rows):
        prompt = build(row, i, f"r{i}")
        ids = torch.tensor([prompt["prompt_ids"]])
        types = (ids == model.config.image_token_id).long() + 2 * (ids == model.config.video_token_id).long()
        response = torch.randint(10, 150, (4 + i,), generator=torch.Generator().manual_seed(i)).tolist()
        samples.append({**{k: prompt[k] for k in ("prompt_ids", "position_ids", "multi_modal_inputs")},
                        "response_ids": response, "mm_token_type_ids": types})
    assert "pixel_values_videos" in samples[2]["multi_modal_inputs"] and samples[1]["multi_modal_inputs"] == {}
    expected = assert_packed_equals_per_sequence(make_actor(path), model, samples, token_weights(samples),
                                                 grad_atol=1e-5)
    assert any("visual" in name for name in expected)
