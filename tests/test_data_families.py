"""data.py on the other Qwen-VL families: Qwen2-VL and Qwen3-VL prompts (images, videos, text) equal their own
processors' ids, their models' rope indices and forward passes (tiny random models built here)."""

import itertools
import os

import pytest
import torch

from test_data import builder, clip, config, forward, png

def tiny_family(family, path, toy):
    """A tiny random Qwen2-VL or Qwen3-VL with the toy tokenizer, saved as a normal HF folder."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(toy["vl_model"])
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                      "<|vision_end|>", "<|endoftext|>", "<|im_end|>")}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=False)
    template = open(os.path.join(toy["vl_model"], "chat_template.jinja")).read()
    torch.manual_seed(0)
    if family == "qwen2_vl":
        cfg = tf.Qwen2VLConfig(text_config=text, vision_config=dict(
            depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2), **common)
        model = tf.Qwen2VLForConditionalGeneration(cfg)
        processor = tf.Qwen2VLProcessor(
            image_processor=tf.Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12544),
            video_processor=tf.Qwen2VLVideoProcessor(), tokenizer=tok, chat_template=template)
    else:
        text["rope_parameters"]["mrope_interleaved"] = True
        cfg = tf.Qwen3VLConfig(text_config=text, vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[1]),
            **common)
        model = tf.Qwen3VLForConditionalGeneration(cfg)
        processor = tf.Qwen3VLProcessor(
            image_processor=tf.Qwen2VLImageProcessor(patch_size=16, merge_size=2, min_pixels=4096, max_pixels=16384),
            video_processor=tf.Qwen3VLVideoProcessor(), tokenizer=tok, chat_template=template)
    model.float().save_pretrained(path)
    processor.save_pretrained(path)
    return model.eval(), processor


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_qwen2_vl_and_qwen3_vl_prompts_match_their_models(family, tmp_path, toy):
    model, processor = tiny_family(family, str(tmp_path / family), toy)
    family_builder = builder(str(tmp_path / family), config(min_pixels=4096, max_pixels=16384, max_prompt_length=1024))
    row = {"problem": "<image>What is <image> 3 + 4?", "answer": "7",
           "images": [png(64, 64), {"bytes": png(200, 90), "path": None}]}
    text_row = {"problem": "What is 3 + 4?", "answer": "7"}
    video_row = {"problem": "<video>Which colour, <image>?", "answer": "red", "images": [png(64, 64)],
                 "videos": [clip(8, size=(64, 64), fps=4)]}
    for prompt in (family_builder.build(row, 0, "r0"), family_builder.build(text_row, 1, "r1"),
                   family_builder.build(video_row, 2, "r2")):
        videos = {"videos": prompt["videos"], "video_metadata": prompt["video_metadata"],
                  "do_sample_frames": False} if prompt["videos"] else {}
        text = prompt["prompt_text"]
        if family == "qwen3_vl":  # the template's pair around a video's placeholder goes, as vLLM and transformers 4
            text = text.replace("<|vision_start|><|video_pad|><|vision_end|>", "<|video_pad|>")  # drop it
        ref = processor(text=[text], images=prompt["images"] or None, return_tensors="pt", **videos)
        assert prompt["prompt_ids"] == ref["input_ids"][0].tolist()
        if family == "qwen3_vl" and videos:  # a timestamp before each temporal patch (frames 0,2 / 5,7), in its pair
            decoded = processor.decode(prompt["prompt_ids"])
            assert "user\n<0.2 seconds><|vision_start|><|video_pad|>" in decoded and "<1.5 seconds>" in decoded
            assert "<|vision_end|><|vision_end|>" not in decoded
        rope, _ = model.model.get_rope_index(input_ids=ref["input_ids"], mm_token_type_ids=ref["mm_token_type_ids"],
                                             image_grid_thw=ref.get("image_grid_thw"),
                                             video_grid_thw=ref.get("video_grid_thw"))
        assert torch.equal(prompt["position_ids"][1:], rope[:, 0])
        with torch.no_grad():
            reference = model(**ref).logits[0]
        torch.testing.assert_close(forward(model, prompt), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vision_indices_from_the_host_grid_give_the_towers_own_output(family, tmp_path, toy):
    """modeling.vision_indices (the tower's positions, boundaries, windows and interpolation computed from the host
    grid_thw, so the GPU is not waited on) gives exactly the tower's own output, and the tower uses them: reversed
    positions change it."""
    import transformers as tf

    import modeling

    if family == "qwen2_5_vl":
        model = tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(toy["vl_model"]).eval()
    else:
        model, _ = tiny_family(family, str(tmp_path / family), toy)
    tower, cpu = modeling.vision_tower(model), torch.device("cpu")
    grid = torch.tensor([[1, 8, 12], [2, 16, 8]])  # two entries of different sizes, one of two frames
    torch.manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), tower.patch_embed.proj.weight[0].numel())
    wrong = modeling.vision_indices(tower, grid, cpu)
    wrong["position_ids"] = wrong["position_ids"].flip(0)
    with torch.no_grad():
        own, given, moved = (model.model.get_image_features(pixels, grid, return_dict=True, **kw)
                             for kw in ({}, modeling.vision_indices(tower, grid, cpu), wrong))
    assert torch.equal(torch.cat(own.pooler_output), torch.cat(given.pooler_output))
    for a, b in zip(getattr(own, "deepstack_features", None) or [], getattr(given, "deepstack_features", None) or []):
        assert torch.equal(torch.cat(a), torch.cat(b))  # Qwen3-VL's per-layer features
    assert not torch.allclose(torch.cat(own.pooler_output), torch.cat(moved.pooler_output))


def rollout_positions(ids, types, grids, time_steps, merge=2):
    """The mrope rows as vLLM builds them for Qwen2-VL / Qwen2.5-VL (and as the models were trained), from the grids
    alone: text runs count on from one past the largest position before them; a vision run of grid (t, h, w) puts
    its tokens at (time_step * i, j, k) + its start. types [P]: 0 text, else vision; time_steps: one per grid."""
    rows, start, grids, steps = [[], [], []], 0, iter(grids), iter(time_steps)
    for kind, run in itertools.groupby(types):
        n = len(list(run))
        if kind == 0:
            block = [[start + i for i in range(n)]] * 3
        else:
            (t, h, w), step = next(grids), next(steps)
            cells = [(i, j, k) for i in range(t) for j in range(h // merge) for k in range(w // merge)]
            block = [[start + int(c[0] * step) for c in cells], [start + c[1] for c in cells],
                     [start + c[2] for c in cells]]
        for row, values in zip(rows, block):
            row += values
        start = max(max(values) for values in block) + 1
    return torch.tensor(rows)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_the_text_after_a_long_video_resumes_past_the_videos_positions(family, tmp_path, toy):
    """A video whose time positions reach past its height and width (16 temporal patches; Qwen2-VL's processor
    upscales the frames to 12 x 12 merged tokens, the toy's keeps 2 x 2): data.py's rows equal the rollout's (vLLM's
    convention, built above from the grids alone). transformers >= 5.3's get_rope_index restarted the text at the
    video's start + max(h, w), inside its times, so the actor trained on other positions than vLLM sampled with."""
    path = toy["vl_model"] if family == "qwen2_5_vl" else str(tmp_path / family)
    if family == "qwen2_vl":
        tiny_family(family, path, toy)
    build = builder(path, config(min_pixels=3136, max_pixels=3136, max_prompt_length=8192, video_fps=2.0))
    prompt = build.build({"problem": "<video>Which colour comes last?", "answer": "red",
                          "videos": [clip(32, size=(56, 56), fps=2)]}, 0, "r0")
    (t, h, w), = grid = prompt["multi_modal_inputs"]["video_grid_thw"].tolist()
    step = 1.0 if family == "qwen2_vl" else 4.0  # Qwen2.5-VL: (2 frames / 2 fps) x tokens_per_second 4
    assert t == 16 and (t - 1) * step >= max(h, w) // 2  # the times reach past the height and width
    video_id = build.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    types = [2 if i == video_id else 0 for i in prompt["prompt_ids"]]
    assert torch.equal(prompt["position_ids"][1:], rollout_positions(prompt["prompt_ids"], types, grid, [step]))
    k, n = types.index(2), types.count(2)
    assert prompt["position_ids"][1:, k + n].tolist() == [k + int((t - 1) * step) + 1] * 3  # past the last time
