"""data.py: sources, prompt text, images, rope positions, the length filter, the loader, bad input.

References are independent of data.py: hand-written prompt strings and sizes, the toy model's own
get_rope_index, vision tower and forward pass on the processor's own outputs.
"""

import io
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import replace

import datasets
import pandas as pd
import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

import data
import toy as toy_world
from config import DataConfig

torch.set_num_threads(1)
PAD = "<|image_pad|>"
QUESTION = "What colour is the square?"


def config(**overrides):
    base = DataConfig(train_files="", val_files="", format_prompt=None, min_pixels=3136, max_pixels=12544,
                      max_prompt_length=256, rollout_batch_size=4, val_batch_size=-1,
                      filter_overlong_prompts_workers=1)
    return replace(base, **overrides)


def builder(path, cfg=None):
    cfg = cfg or config()
    processor, _ = data.load_processor(path, cfg)
    return data.PromptBuilder(cfg, processor, path)


def loader(path, files, cfg=None, **kw):
    cfg = cfg or config()
    processor, _ = data.load_processor(path, cfg)
    return data.PromptLoader(files, cfg, processor, path, **{"shuffle": True, "drop_last": True, **kw})


def png(width, height, color=(200, 20, 20), mode="RGB"):
    buf = io.BytesIO()
    Image.new(mode, (width, height), color if mode == "RGB" else None).save(buf, format="PNG")
    return buf.getvalue()


def chat(user, system=None):
    """The toy chat template by hand."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return head + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def vision(n=1, pad="<|image_pad|>"):
    return f"<|vision_start|>{pad}<|vision_end|>" * n


COLOR_LIST = [(220, 30, 30), (30, 180, 40), (30, 60, 220), (230, 210, 20), (200, 0, 200), (0, 200, 200),
              (120, 60, 0), (250, 250, 250)]


def clip(n=8, size=(56, 56), fps=4):
    """MP4 bytes of n plain frames, frame i in COLOR_LIST[i % 8]."""
    return toy_world.video_bytes([Image.new("RGB", size, COLOR_LIST[i % 8]) for i in range(n)], fps)


@pytest.fixture(scope="module")
def vl(toy):
    return builder(toy["vl_model"])


@pytest.fixture(scope="module")
def model(toy):
    return AutoModelForImageTextToText.from_pretrained(toy["vl_model"]).eval()


@pytest.fixture(scope="module")
def processor(toy):
    return AutoProcessor.from_pretrained(toy["vl_model"])


def forward(model, prompt):
    """Logits of the model on a prompt dict, the way the actor feeds it: ids + tensors + position ids
    ([4, 1, P] for Qwen-VL; a text model takes its one row as the batch of one, [1, P])."""
    positions = prompt["position_ids"]
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt["prompt_ids"]]),
                     position_ids=positions[:, None] if len(positions) == 4 else positions,
                     **prompt["multi_modal_inputs"]).logits[0]


def test_video_and_image_prompt_matches_processor_rope_and_forward(toy, vl, model, processor):
    raw = clip(8, fps=4)
    row = {"problem": "<video>Which colour comes first? <image>", "answer": "red", "videos": [raw],
           "images": [png(56, 56)]}
    prompt = vl.build(row, 0, "mem row 0")
    assert prompt["prompt_text"] == chat(vision(pad="<|video_pad|>") + "Which colour comes first? " + vision())
    frames, metadata = data.process_video(raw, 3136, 12544, 2.0)
    assert len(prompt["videos"]) == 1 and (prompt["videos"][0] == frames).all()
    assert prompt["video_metadata"] == [metadata]
    # The processor's own outputs on the same frames and metadata (frames not sampled again) are the reference.
    ref = processor(text=[prompt["prompt_text"]], images=prompt["images"], videos=[frames], video_metadata=[metadata],
                    do_sample_frames=False, return_tensors="pt")
    assert prompt["prompt_ids"] == ref["input_ids"][0].tolist()
    mm = prompt["multi_modal_inputs"]
    assert mm["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert torch.equal(mm["pixel_values_videos"], ref["pixel_values_videos"])
    assert torch.equal(mm["pixel_values"], ref["pixel_values"])
    # Positions by hand (Qwen2.5-VL): the video's 2 temporal patches of 2x2 merged tokens at t = k and
    # k + second_per_grid * tokens_per_second = k + (2 / sampled fps 2) * 4 = k + 4; h, w as for an image;
    # the text after it resumes one past its largest position, k + 5, as Qwen2.5-VL was trained and as vLLM
    # computes it (transformers >= 5.3's get_rope_index resumes at k + max(h, w) = k + 2, inside the video's times).
    k = prompt["raw_prompt_ids"].index(processor.tokenizer.convert_tokens_to_ids("<|video_pad|>"))
    t_row, h_row, w_row = prompt["position_ids"][1:, k:k + 8].tolist()
    assert t_row == [k] * 4 + [k + 4] * 4
    assert h_row == [k, k, k + 1, k + 1] * 2 and w_row == [k, k + 1, k, k + 1] * 2
    after = len(prompt["prompt_ids"]) - k - 8  # the text after the video, then the image and text
    rope, _ = model.model.get_rope_index(input_ids=ref["input_ids"], mm_token_type_ids=ref["mm_token_type_ids"],
                                         image_grid_thw=ref["image_grid_thw"], video_grid_thw=ref["video_grid_thw"],
                                         second_per_grid_ts=ref["second_per_grid_ts"])
    assert torch.equal(prompt["position_ids"][1:, :k + 8], rope[:, 0, :k + 8])
    assert prompt["position_ids"][1:, k + 8].tolist() == [k + 5] * 3
    assert rope[:, 0, k + 8].tolist() in ([k + 2] * 3, [k + 5] * 3)  # transformers >= 5.3; 4.x, vLLM
    assert torch.equal(prompt["position_ids"][1:, k + 8:], rope[:, 0, k + 8:] - rope[0, 0, k + 8] + k + 5)  # [3, after]
    assert after > 0
    with torch.no_grad():  # the model's own forward on these positions
        reference = model(**ref, position_ids=prompt["position_ids"][1:, None]).logits[0]
    torch.testing.assert_close(forward(model, prompt), reference, rtol=1e-5, atol=1e-5)
    assert vl.measure(row, "mem row 0") == len(prompt["prompt_ids"])


def test_mixed_rows_text_image_video_in_one_batch(tmp_path, toy, model):
    raw = clip(4, fps=2)
    rows = [{"problem": "What is 3 + 4?", "answer": "7", "images": [], "videos": []},
            {"problem": "<image>What colour?", "answer": "red", "images": [png(56, 56)], "videos": []},
            {"problem": "<video>What colour?", "answer": "red", "images": [], "videos": [raw]},
            {"problem": "<image> then <video> and <video>?", "answer": "red", "images": [png(56, 56)],
             "videos": [raw, raw]}]
    pd.DataFrame(rows).to_parquet(tmp_path / "mix.parquet")
    mixed = loader(toy["vl_model"], str(tmp_path / "mix.parquet"), batch_size=4, shuffle=False)
    assert (mixed.videos_per_prompt, mixed.images_per_prompt) == (2, 1)
    batch = next(mixed)
    assert [(len(p["images"]), len(p["videos"])) for p in batch] == [(0, 0), (1, 0), (0, 1), (1, 2)]
    for prompt in batch:
        assert prompt["prompt_text"].count("<|video_pad|>") == len(prompt["videos"])
        grids = prompt["multi_modal_inputs"].get("video_grid_thw")
        assert prompt["prompt_ids"].count(6) == (0 if grids is None else int(grids.prod(-1).sum()) // 4)
        assert torch.isfinite(forward(model, prompt)).all()
    assert loader(toy["vl_model"], os.path.join(toy["colors"], "test.parquet"), batch_size=4).videos_per_prompt == 0


# --------------------------------------------------------------------------------------------- sources

ROWS = [{"problem": f"What is {a} + 1?", "answer": str(a + 1), "level": a} for a in range(5)]


def test_every_local_source_form(tmp_path, monkeypatch, toy):
    pd.DataFrame(ROWS).to_parquet(tmp_path / "set.parquet")
    with open(tmp_path / "set.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    (tmp_path / "set.json").write_text(json.dumps(ROWS))
    folder = tmp_path / "folder"
    (folder / "data").mkdir(parents=True)
    pd.DataFrame(ROWS[:3]).to_parquet(folder / "train.parquet")
    with open(folder / "data" / "test-00000.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS[3:])
    cfg = config()
    for name in ("set.parquet", "set.jsonl", "set.json"):
        rows = data.load_rows(str(tmp_path / name), cfg)
        assert [rows[i] for i in range(len(rows))] == ROWS, name
        assert rows.where(2) == f"{tmp_path / name} row 2"
    train, test = data.load_rows(f"{folder}@train", cfg), data.load_rows(f"{folder}@test", cfg)
    assert [train[i] for i in range(len(train))] == ROWS[:3] and [test[i] for i in range(len(test))] == ROWS[3:]
    assert test.where(1) == f"{folder / 'data' / 'test-00000.jsonl'} row 1"
    assert len(data.load_rows(str(folder), cfg)) == 3  # a folder without @split reads the train split
    with pytest.raises(data.DataError, match="a file has one split, train; drop '@test'"):
        data.load_rows(f"{tmp_path / 'set.parquet'}@test", cfg)
    assert len(data.load_rows(f"{tmp_path / 'set.parquet'}@train", cfg)) == len(ROWS)  # as EasyR1 (datasets) reads it
    pd.DataFrame(ROWS).to_parquet(tmp_path / "set@v2.parquet")  # an @ in a file's own name is not a split
    assert len(data.load_rows(str(tmp_path / "set@v2.parquet"), cfg)) == len(ROWS)
    with pytest.raises(data.DataError, match="no .parquet/.json/.jsonl/.csv/.arrow file in .* naming 'validation'"):
        data.load_rows(f"{folder}@validation", cfg)
    # The repo-relative toy path resolves from any working directory.
    monkeypatch.chdir(tmp_path)
    assert len(data.load_rows(".toy/colors@test", cfg)) == 64


def test_a_folder_split_is_a_word_of_the_file_name_not_any_substring(tmp_path):
    """folder@train must not read pretrain_test.parquet (nor @test contest_train.jsonl): test rows in training."""
    pd.DataFrame(ROWS[:2]).to_parquet(tmp_path / "geo_train.parquet")
    pd.DataFrame(ROWS[2:3]).to_parquet(tmp_path / "pretrain_test.parquet")
    with open(tmp_path / "contest_train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS[3:])
    train, test = data.load_rows(f"{tmp_path}@train", config()), data.load_rows(f"{tmp_path}@test", config())
    assert [p for p, _ in train.parts] == [str(tmp_path / "contest_train.jsonl"), str(tmp_path / "geo_train.parquet")]
    assert [p for p, _ in test.parts] == [str(tmp_path / "pretrain_test.parquet")] and test[0] == ROWS[2]
    pd.DataFrame(ROWS).to_parquet(tmp_path / "training-00000.parquet")  # a word starting with the split still counts
    assert len(data.load_rows(f"{tmp_path}@train", config())) == 2 + 2 + len(ROWS)


def test_csv_and_arrow_files_load_as_easyr1_loads_them(tmp_path):
    """EasyR1 hands a file's extension to datasets as its builder (verl/utils/dataset.py:139, "jsonl" -> "json"),
    so .csv and .arrow files (datasets' save_to_disk shards) load there (a csv cell as written: test_data_media)."""
    pd.DataFrame(ROWS).to_csv(tmp_path / "set.csv", index=False)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "set.csv", next((tmp_path / "saved").glob("*.arrow"))):
        rows = data.load_rows(str(path), config())
        assert [(rows[i]["problem"], str(rows[i]["answer"])) for i in range(len(rows))] == \
            [(r["problem"], r["answer"]) for r in ROWS], path


def test_an_empty_file_has_no_rows(tmp_path):
    """datasets itself fails on these with StopIteration, ArrowInvalid or "corresponds to no data"."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "empty.parquet").write_bytes(b"")
    pd.DataFrame({"problem": [], "answer": []}).to_parquet(tmp_path / "zero.parquet")
    for name in ("empty.jsonl", "blank.jsonl", "list.json", "empty.parquet", "zero.parquet"):
        with pytest.raises(data.DataError, match=rf"{tmp_path / name} has no rows$"):
            data.load_rows(str(tmp_path / name), config())
    # In a folder an empty shard is skipped; a folder of empty shards has no rows.
    pd.DataFrame(ROWS).to_parquet(tmp_path / "zero_train_full.parquet")
    assert len(data.load_rows(f"{tmp_path}@zero", config())) == len(ROWS)
    with pytest.raises(data.DataError, match="has no rows: every file with 'empty' in its name"):
        data.load_rows(f"{tmp_path}@empty", config())
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(data.DataError, match="bad.parquet: not readable as a .parquet file"):
        data.load_rows(str(tmp_path / "bad.parquet"), config())
    (tmp_path / "bad.jsonl").write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": \n')
    with pytest.raises(data.DataError, match=r"bad.jsonl: not readable as a .jsonl file: .*JSON parse error.* row 1"):
        data.load_rows(str(tmp_path / "bad.jsonl"), config())  # the parser's message, not datasets' "An error .."


def test_hub_name_at_split_goes_to_load_dataset(monkeypatch, toy):
    """No network here: a hub id must reach datasets.load_dataset(name, split=...); the fake returns a
    dataset with an Image feature, as the hub's Geometry3K has, left undecoded: rows carry {"bytes", "path"}."""
    calls = []
    features = datasets.Features({"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "images": datasets.Sequence(datasets.Image())})
    hub = datasets.Dataset.from_dict({"problem": ["<image>" + QUESTION], "answer": ["red"],
                                      "images": [[{"bytes": png(56, 56), "path": None}]]}, features=features)

    def fake_load_dataset(path, *args, **kwargs):
        calls.append((path, kwargs.get("split")))
        return hub

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows = data.load_rows("someone/geometry@test", config())
    assert calls == [("someone/geometry", "test")] and rows.where(0) == "someone/geometry@test row 0"
    assert rows[0]["images"] == [{"bytes": png(56, 56), "path": None}]
    data.load_rows("someone/geometry", config())
    assert calls[-1] == ("someone/geometry", "train")
    prompt = builder(toy["vl_model"]).build(rows[0], 0, rows.where(0))
    assert prompt["prompt_text"] == chat(vision() + QUESTION) and prompt["ground_truth"] == "red"

    def offline(path, *args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(data.DataError, match="neither a local file or folder .* nor loadable from the hub"):
        data.load_rows("no/such_set@train", config())


# ---------------------------------------------------------------------------------------------- prompts

def test_single_image_prompt_from_the_toy_parquet(toy, vl):
    rows = data.load_rows(os.path.join(toy["colors"], "train.parquet"), config())
    prompt = vl.build(rows[0], 0, rows.where(0))
    tok = vl.tokenizer
    assert prompt["prompt_text"] == chat(vision() + QUESTION)
    assert prompt["raw_prompt_ids"] == tok(prompt["prompt_text"], add_special_tokens=False)["input_ids"]
    pad = tok.convert_tokens_to_ids(PAD)
    k = prompt["raw_prompt_ids"].index(pad)
    assert prompt["prompt_ids"] == prompt["raw_prompt_ids"][:k] + [pad] * 4 + prompt["raw_prompt_ids"][k + 1:]
    assert [im.size for im in prompt["images"]] == [(56, 56)] and prompt["images"][0].mode == "RGB"
    mm = prompt["multi_modal_inputs"]
    assert mm["image_grid_thw"].tolist() == [[1, 4, 4]] and mm["pixel_values"].shape == (16, 3 * 2 * 14 * 14)
    assert prompt["ground_truth"] == rows[0]["answer"] and prompt["index"] == 0 and prompt["extra"] == {}
    # Positions by hand: text 0..k-1; the 2x2 merged image at t=k, h=k+{0,0,1,1}, w=k+{0,1,0,1};
    # the text after it resumes at k + 2 (= k + max(h, w) of the merged grid).
    P = len(prompt["prompt_ids"])
    rest = list(range(k + 2, k + 2 + P - k - 4))
    expected = [list(range(k)) + image + rest for image in ([k] * 4, [k, k, k + 1, k + 1], [k, k + 1, k, k + 1])]
    assert prompt["position_ids"].tolist() == [list(range(P))] + expected
    assert prompt["position_ids"].dtype == torch.long


def test_multi_image_prompt_matches_model_rope_vision_tower_and_forward(tmp_path, toy, model, processor):
    images = [png(56, 56, (200, 20, 20)), png(300, 150, (20, 20, 200)), png(20, 20, (20, 200, 20))]
    row = {"problem": "Compare <image> and <image>, then <image>: which is red?", "answer": "1",
           "images": [{"bytes": b, "path": None} for b in images], "id": "q7"}
    cfg = config(system_prompt="You are a helpful")
    prompt = builder(toy["vl_model"], cfg).build(row, 3, "mem row 3")
    text = chat(f"Compare {vision()} and {vision()}, then {vision()}: which is red?", system="You are a helpful")
    assert prompt["prompt_text"] == text and prompt["extra"] == {"id": "q7"}
    # Resized once: 300x150 down (s = sqrt(12544/45000) -> 158x79), 20x20 up (s = 2.8 -> 56x56).
    assert [im.size for im in prompt["images"]] == [(56, 56), (158, 79), (56, 56)]
    # The processor's own outputs on the same text and the same resized images: the reference.
    ref = processor(text=[text], images=prompt["images"], return_tensors="pt")
    assert prompt["prompt_ids"] == ref["input_ids"][0].tolist()
    assert torch.equal(prompt["multi_modal_inputs"]["pixel_values"], ref["pixel_values"])
    assert torch.equal(prompt["multi_modal_inputs"]["image_grid_thw"], ref["image_grid_thw"])
    rope, _ = model.model.get_rope_index(input_ids=ref["input_ids"], mm_token_type_ids=ref["mm_token_type_ids"],
                                         image_grid_thw=ref["image_grid_thw"], attention_mask=ref["attention_mask"])
    P = len(prompt["prompt_ids"])
    assert prompt["position_ids"].shape == (4, P)
    assert torch.equal(prompt["position_ids"][0], torch.arange(P))
    assert torch.equal(prompt["position_ids"][1:], rope[:, 0])
    # Image-token count = the features the vision tower produces.
    pad = processor.tokenizer.convert_tokens_to_ids(PAD)
    with torch.no_grad():
        features = model.model.visual(prompt["multi_modal_inputs"]["pixel_values"],
                                      grid_thw=prompt["multi_modal_inputs"]["image_grid_thw"]).pooler_output
    assert prompt["prompt_ids"].count(pad) == features.shape[0] == 4 + 2 * 5 + 4
    # The forward on the prompt dict equals the forward on the processor's outputs (own positions).
    with torch.no_grad():
        reference = model(**ref).logits[0]
    torch.testing.assert_close(forward(model, prompt), reference, rtol=1e-5, atol=1e-5)


def test_text_only_rows_on_the_vl_model_and_on_a_text_model(toy, model):
    row = {"problem": "What is 3 + 4?", "answer": 7}
    vl_prompt = builder(toy["vl_model"]).build(row, 0, "mem row 0")
    text_prompt = builder(toy["text_model"]).build(row, 0, "mem row 0")
    for prompt in (vl_prompt, text_prompt):
        assert prompt["prompt_text"] == chat("What is 3 + 4?") and prompt["ground_truth"] == "7"
        assert prompt["prompt_ids"] == prompt["raw_prompt_ids"] and prompt["images"] == []
        assert prompt["multi_modal_inputs"] == {}
    P = len(vl_prompt["prompt_ids"])
    assert vl_prompt["position_ids"].tolist() == [list(range(P))] * 4
    assert text_prompt["position_ids"].tolist() == [list(range(P))]
    text_model = AutoModelForCausalLM.from_pretrained(toy["text_model"]).eval()
    with torch.no_grad():
        reference = text_model(input_ids=torch.tensor([text_prompt["prompt_ids"]])).logits[0]
        reference_vl = model(input_ids=torch.tensor([vl_prompt["prompt_ids"]])).logits[0]
    torch.testing.assert_close(forward(text_model, text_prompt), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(forward(model, vl_prompt), reference_vl, rtol=1e-5, atol=1e-5)


def test_format_templates_system_prompt_and_chat_template_override(tmp_path, toy):
    row = {"problem": "  <image>What colour is the square?  ", "answer": "red", "images": [png(56, 56)]}
    math_prompt = builder(toy["vl_model"], config(format_prompt="configs/format/math.jinja"))
    text = math_prompt.prompt_text(row, "mem row 0")[0]
    assert text == chat(vision() + QUESTION + " You FIRST think about the reasoning process as an internal "
                        "monologue and then provide the final answer. The reasoning process MUST BE enclosed "
                        "within <think> </think> tags. The final answer MUST BE put in \\boxed{}.")
    dapo = builder(toy["text_model"], config(format_prompt="configs/format/dapo.jinja"))
    text = dapo.prompt_text({"problem": "What is 3 + 4?", "answer": "7"}, "mem row 0")[0]
    assert "\n\nWhat is 3 + 4?\n\nRemember to put your answer" in text and "\\n" not in text
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    over_cfg = config(override_chat_template=str(tmp_path / "chat.jinja"), system_prompt="Be brief.")
    processor, tokenizer = data.load_processor(toy["text_model"], over_cfg)
    over = data.PromptBuilder(over_cfg, processor, toy["text_model"])
    assert over.prompt_text({"problem": "Hi", "answer": "x"}, "r")[0] == "[system] Be brief.\n[user] Hi\n[assistant] "
    assert tokenizer.chat_template == (tmp_path / "chat.jinja").read_text()  # the trainer's tokenizer agrees
    for key in ("format_prompt", "override_chat_template"):
        with pytest.raises(data.DataError, match=f"data.{key}: file not found: configs/format/nope.jinja"):
            builder(toy["text_model"], config(**{key: "configs/format/nope.jinja"}))


# ---------------------------------------------------------------------------- the done-when datasets

def write_datasets(tmp_path):
    """A Geometry3K-schema parquet (embedded bytes, mixed 0/1/2 images), a jsonl with image paths, a
    text-only math jsonl."""
    rng = random.Random(1)
    geo = []
    for i in range(8):
        n = i % 3
        sizes = [(rng.randint(20, 400), rng.randint(20, 400)) for _ in range(n)]
        marks = " and ".join(["<image>"] * n)
        geo.append({"problem": f"{marks} What is 3 + {i}?", "answer": str(3 + i),
                    "images": [{"bytes": png(w, h), "path": None} for w, h in sizes]})
    pd.DataFrame(geo).to_parquet(tmp_path / "geo_train.parquet")
    (tmp_path / "img").mkdir()
    with open(tmp_path / "paths_train.jsonl", "w") as f:
        for i in range(6):
            (tmp_path / "img" / f"{i}.png").write_bytes(png(40 + 20 * i, 60, (20 * i, 100, 50)))
            images = [f"{i}.png"] if i % 2 else []
            row = {"problem": "<image>" * len(images) + QUESTION, "answer": "red", "images": images}
            f.write(json.dumps(row) + "\n")
    with open(tmp_path / "math_train.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n")
    return tmp_path


def test_done_when_three_datasets_load_into_prompts_the_toy_model_accepts(tmp_path, toy, model):
    root = write_datasets(tmp_path)
    cfg = config(image_dir=str(root / "img"), max_prompt_length=2048,
                 format_prompt="configs/format/math.jinja")
    seen_images = 0
    for name in ("geo_train.parquet", "paths_train.jsonl", "math_train.jsonl"):
        train = loader(toy["vl_model"], str(root / name), cfg, batch_size=4)
        val = loader(toy["vl_model"], str(root / name), cfg, batch_size=-1, shuffle=False, drop_last=False)
        batches = list(val.epoch())
        assert len(batches) == 1 and [p["index"] for p in batches[0]] == list(range(len(train.rows)))
        batch = next(train)
        assert len(batch) == 4 and len({p["uid"] for p in batch}) == 4
        for prompt in batches[0]:
            n_images = len(prompt["images"])
            seen_images += n_images
            assert prompt["prompt_text"].count(PAD) == n_images
            logits = forward(model, prompt)
            assert logits.shape[0] == len(prompt["prompt_ids"]) and torch.isfinite(logits).all()
    assert seen_images == 7 + 3  # geo: 0+1+2+0+1+2+0+1, paths: rows 1, 3, 5


# ------------------------------------------------------------------------------------ overlong prompts

def test_measured_length_is_exact_and_the_filter_drops_overlong_rows(tmp_path, toy, vl, caplog):
    rng = random.Random(2)
    rows = []
    for i in range(12):
        sizes = [(rng.randint(10, 500), rng.randint(10, 500)) for _ in range(i % 3)]
        rows.append({"problem": "<image>" * len(sizes) + "What is" + " 3 + 4" * rng.randint(0, 12) + "?",
                     "answer": "7", "images": [{"bytes": png(w, h), "path": None} for w, h in sizes]})
    path = str(tmp_path / "mix.parquet")
    pd.DataFrame(rows).to_parquet(path)
    source = data.load_rows(path, config())
    lengths = [len(vl.build(source[i], i, source.where(i))["prompt_ids"]) for i in range(len(source))]
    assert [vl.measure(source[i], source.where(i)) for i in range(len(source))] == lengths
    limit = sorted(lengths)[8]
    dropped = sum(n > limit for n in lengths)
    assert dropped > 0
    with caplog.at_level(logging.INFO, logger="data"):
        filtered = loader(toy["vl_model"], path, config(max_prompt_length=limit), batch_size=-1, shuffle=False)
    assert filtered.indices == [i for i, n in enumerate(lengths) if n <= limit]
    assert f"dropped {dropped} of 12 rows as longer than max_prompt_length={limit}" in caplog.text
    first = next(i for i, n in enumerate(lengths) if n > limit)  # named, with its length
    assert f"the first: {path} row {first} ({lengths[first]})" in caplog.text
    assert all(len(p["prompt_ids"]) <= limit for p in next(filtered))
    # Filtering off: a too-long row is an error naming the file and row at start-up, never a silent cut;
    # with skip_bad_rows it is skipped and counted instead.
    unfiltered = config(max_prompt_length=limit, filter_overlong_prompts=False)
    first_long = next(i for i, n in enumerate(lengths) if n > limit)
    with pytest.raises(data.DataError, match=rf"mix.parquet row {first_long}: the prompt is {lengths[first_long]} "
                                             rf"tokens with images and videos expanded, more than "
                                             rf"max_prompt_length={limit}"):
        loader(toy["vl_model"], path, unfiltered, batch_size=-1, shuffle=False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data"):
        skipping = loader(toy["vl_model"], path, replace(unfiltered, skip_bad_rows=True), batch_size=-1, shuffle=False)
    assert skipping.indices == filtered.indices
    assert f"skipped {dropped} of 12 rows as bad (data.skip_bad_rows); the first: " in caplog.text
    assert f"mix.parquet row {first_long}: the prompt is {lengths[first_long]} tokens" in caplog.text
    with pytest.raises(data.DataError, match="no row left: 12 longer than max_prompt_length=5"):
        data.check_rows(source, builder(toy["vl_model"], config(max_prompt_length=5)))


def test_rows_are_measured_in_filter_overlong_prompts_workers_processes(tmp_path, toy, vl, monkeypatch):
    """data.filter_overlong_prompts_workers processes measure the rows (EasyR1: datasets' filter num_proc),
    with the same result as one process, bad rows included."""
    rows = [{"problem": "<image>" * (i % 2) + "What is" + " 3 + 4" * i + "?", "answer": "7",
             "images": [{"bytes": png(56 + 10 * i, 56), "path": None}] * (i % 2)} for i in range(12)]
    rows[5]["answer"] = None
    pd.DataFrame(rows).to_parquet(tmp_path / "w.parquet")
    source = data.load_rows(str(tmp_path / "w.parquet"), config())
    measure = data.PromptBuilder.measure

    def measure_and_record(self, row, where):
        with open(tmp_path / f"pid-{os.getpid()}", "a") as f:
            f.write(where + "\n")
        time.sleep(0.05)  # so that one worker cannot take every row before the others start (a loaded machine)
        return measure(self, row, where)

    monkeypatch.setattr(data.PromptBuilder, "measure", measure_and_record)
    one = data.check_rows(source, vl, workers=1, skip_bad=True)
    assert [p.name for p in tmp_path.glob("pid-*")] == [f"pid-{os.getpid()}"]
    (tmp_path / f"pid-{os.getpid()}").unlink()
    assert data.check_rows(source, vl, workers=3, skip_bad=True) == one == [i for i in range(12) if i != 5]
    measured = {p.name: p.read_text().split("\n")[:-1] for p in tmp_path.glob("pid-*")}
    assert len(measured) >= 2 and f"pid-{os.getpid()}" not in measured  # in workers, more than one
    assert sorted(w for ws in measured.values() for w in ws) == sorted(source.where(i) for i in range(12))
    with pytest.raises(data.DataError, match="w.parquet row 5: no answer in column 'answer' .*skip_bad_rows"):
        data.check_rows(source, vl, workers=3)


def test_a_measuring_process_that_dies_is_an_error_not_a_hang(tmp_path, vl, monkeypatch):
    """A worker killed mid-measure (the OOM killer, a crash in a decoder): start-up fails at once; a
    multiprocessing.Pool would wait for the lost rows forever."""
    pd.DataFrame([{"problem": f"What is {i}?", "answer": "7"} for i in range(8)]).to_parquet(tmp_path / "d.parquet")
    source, measure, parent = data.load_rows(str(tmp_path / "d.parquet"), config()), data.PromptBuilder.measure, \
        os.getpid()
    monkeypatch.setattr(data.PromptBuilder, "measure", lambda self, row, where: os._exit(9) if where.endswith(
        "row 3") and os.getpid() != parent else measure(self, row, where))
    errors = []
    check = threading.Thread(target=lambda: errors.append(pytest.raises(Exception, data.check_rows, source, vl, 2)),
                             daemon=True)
    check.start()
    check.join(30)
    assert not check.is_alive(), "check_rows hangs on a dead worker"
    assert "terminated abruptly" in str(errors[0].value)


# --------------------------------------------------------------------------------------------- loader

def test_loader_epochs_shuffle_and_exact_resume(tmp_path, toy):
    # 160 rows; every fifth is too long and filtered out: 128 kept, 10 batches of 12, a tail of 8 dropped.
    rows = [{"problem": f"What is {i % 10} + {i // 10}?" + (" and 3 + 4" * 40 if i % 5 == 0 else ""),
             "answer": str(i % 10 + i // 10)} for i in range(160)]
    path = str(tmp_path / "sums.parquet")
    pd.DataFrame(rows).to_parquet(path)
    cfg = config(max_prompt_length=64)
    kept = [i for i in range(160) if i % 5]
    make = lambda cfg=cfg, **kw: loader(toy["text_model"], path, cfg, **{"batch_size": 12, **kw})
    indices = lambda batch: [p["index"] for p in batch]
    straight = make()
    assert straight.indices == kept and straight.batches_per_epoch == 10
    batches, epochs = [], []
    for _ in range(25):
        epochs.append(straight.current_epoch)
        batches.append(next(straight))
    assert epochs == [0] * 10 + [1] * 10 + [2] * 5 and straight.current_epoch == 2
    order = [indices(b) for b in batches]
    for e in range(2):
        visited = [i for b in order[10 * e:10 * e + 10] for i in b]
        assert len(visited) == len(set(visited)) == 120 and set(visited) <= set(kept)
    assert order[0:10] != order[10:20]  # a new order every epoch
    assert all(p["uid"] == f"1-{p['index']}" for p in batches[10])
    assert all(p["ground_truth"] == rows[p["index"]]["answer"] for b in batches for p in b)
    assert [indices(b) for b in make().epoch()] == order[:10]  # same seed, same order
    # prefetch: the same batches, all after the first built ahead in a background thread, with its own processor
    ahead = make(prefetch=True)
    threads, build = [], ahead.builder.build
    ahead.builder.build = lambda *a: threads.append(threading.current_thread().name) or build(*a)
    assert [indices(next(ahead)) for _ in range(25)] == order
    assert ahead.builder.processor is not straight.builder.processor  # no tokenizer shared with another thread
    assert set(threads[:12]) == {"MainThread"} and set(threads[12:]) == {"prefetch"}, threads
    assert indices(next(make(replace(cfg, seed=2)))) != order[0]
    # Interrupt after 13 batches (mid epoch 1), save, restore into a fresh loader: the same 12 batches follow.
    first = make()
    for _ in range(13):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make(prefetch=True)
    next(resumed)  # its prefetched batch (0, 1) is not where the state moves it
    resumed.load_state_dict(state)
    rest = [next(iter(resumed)) for _ in range(12)]
    assert [indices(b) for b in rest] == order[13:]
    assert [p["prompt_ids"] for p in rest[-1]] == [p["prompt_ids"] for p in batches[-1]]
    with pytest.raises(ValueError, match="batch_size=12, now it is 8"):
        make(batch_size=8).load_state_dict(state)
    # Validation order: every kept row once, in file order, the last batch short; the position is left alone.
    val = make(shuffle=False, drop_last=False, batch_size=50)
    assert [indices(b) for b in val.epoch()] == [kept[:50], kept[50:100], kept[100:]]
    assert val.state_dict()["batch"] == 0 and val.current_epoch == 0
    with pytest.raises(data.DataError, match="fewer than one batch of 500"):
        make(batch_size=500)


def test_resume_with_another_drop_last_is_an_error(tmp_path, toy):
    """10 rows in batches of 4: with the tail kept the saved position (0, 2) lies past the last batch of a
    drop_last loader, which would then yield empty batches forever."""
    pd.DataFrame([{"problem": f"What is {i}?", "answer": str(i)} for i in range(10)]).to_parquet(tmp_path / "t.parquet")
    make = lambda drop_last: loader(toy["text_model"], str(tmp_path / "t.parquet"), batch_size=4, drop_last=drop_last)
    kept = make(False)
    next(kept), next(kept)
    with pytest.raises(ValueError, match="saved with drop_last=False, now it is True"):
        make(True).load_state_dict(kept.state_dict())
    old = {k: v for k, v in kept.state_dict().items() if k != "drop_last"}  # a state saved before drop_last was
    resumed = make(False)
    resumed.load_state_dict(old)
    assert [len(next(resumed)) for _ in range(2)] == [2, 4] and resumed.current_epoch == 1


PREFETCH_EXIT = """import sys, threading, time, torch
import data, test_data
loader = test_data.loader(sys.argv[1], sys.argv[2], batch_size=4, prefetch=True)
def slow(*args, build=loader.builder.build):  # rows built ahead take 3 s each inside torch (GIL released): 12 s a batch
    end = time.time() + 3
    while threading.current_thread().name != "MainThread" and time.time() < end:
        torch.ones(400, 400) @ torch.ones(400, 400)
    return build(*args)
loader.builder.build = slow
next(loader), time.sleep(0.5)  # the prefetch is then inside torch
print(time.time(), flush=True)
"""


def test_exit_waits_for_the_prefetched_row_not_the_batch_and_does_not_abort(tmp_path, toy):
    """A script ends once the row being prefetched is built (3 s), not its batch (12 s); without that wait, the
    daemon thread left inside torch aborted the interpreter (-6)."""
    pd.DataFrame([{"problem": f"What is {i}?", "answer": "7"} for i in range(4)]).to_parquet(tmp_path / "p.parquet")
    tests = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", PREFETCH_EXIT, toy["text_model"], str(tmp_path / "p.parquet")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [os.path.dirname(tests), tests])})
    assert run.returncode == 0, run.stderr[-2000:]
    assert time.time() - float(run.stdout.split()[-1]) < 8, "the interpreter waited for the whole prefetched batch"


# ------------------------------------------------------------------------------------------ bad input

def _truncated_png():
    """A noisy PNG cut in the middle of its pixel data: the header (and so the size) still reads."""
    buf = io.BytesIO()
    Image.effect_noise((64, 64), 60).convert("RGB").save(buf, format="PNG")
    raw = buf.getvalue()
    assert Image.open(io.BytesIO(raw[:len(raw) // 2])).size == (64, 64)
    return raw[:len(raw) // 2]


TRUNCATED = _truncated_png()
CLIP = clip(4, fps=2)
TRUNCATED_CLIP = CLIP[:len(CLIP) // 2]
BAD_ROWS = {
    "unreadable image": ({"problem": "<image>Q?", "answer": "a", "images": [{"bytes": b"not a png", "path": None}]},
                         "image 0 of column 'images' is unreadable"),
    "missing image file": ({"problem": "<image>Q?", "answer": "a", "images": [{"bytes": None, "path": "no/x.png"}]},
                           "image 0 of column 'images' is unreadable: FileNotFoundError: .*'no/x.png' \\(a "
                           "relative path is looked up under data.image_dir=None; null: the working directory"),
    "empty prompt": ({"problem": "  ", "answer": "a", "images": []}, "no prompt text in column 'problem'"),
    "null prompt": ({"problem": None, "answer": "a", "images": []}, "no prompt text in column 'problem'"),
    "image, no placeholder": ({"problem": "Q?", "answer": "a", "images": [{"bytes": png(56, 56), "path": None}]},
                              r"1 image\(s\) in column 'images' but 0 <image> placeholder"),
    "placeholders, no image": ({"problem": "<image><image>Q?", "answer": "a", "images": []},
                               r"0 image\(s\) in column 'images' but 2 <image> placeholder"),
    "no video column": ({"problem": "<video>Q?", "answer": "a", "images": []},  # a mistyped video_key, say
                        r"0 video\(s\) in column 'videos' \(none such\) but 1 <video> placeholder"),
    "missing video file": ({"problem": "<video>Q?", "answer": "a", "images": [], "videos": ["/no/clip.mp4"]},
                           "video 0 of column 'videos' is unreadable: .*No such file"),
    "corrupt video": ({"problem": "<video>Q?", "answer": "a", "images": [], "videos": [b"not a video"]},
                      "video 0 of column 'videos' is unreadable"),
    "truncated video": ({"problem": "<video>Q?", "answer": "a", "images": [], "videos": [TRUNCATED_CLIP]},
                        "video 0 of column 'videos' is unreadable"),
    "video, no placeholder": ({"problem": "Q?", "answer": "a", "images": [], "videos": [CLIP]},
                              r"1 video\(s\) in column 'videos' but 0 <video> placeholder"),
    "placeholders, no video": ({"problem": "<video><image>Q?", "answer": "a", "videos": [],
                                "images": [{"bytes": png(56, 56), "path": None}]},
                               r"0 video\(s\) in column 'videos' but 1 <video> placeholder"),
    "null answer": ({"problem": "Q?", "answer": None, "images": []}, "no answer in column 'answer'"),
    "empty answer": ({"problem": "Q?", "answer": " \n", "images": []}, r"no answer in column 'answer' \(' \\n'\)"),
    # A vision token written as text: the tokenizer reads it as the real token, and the image count goes wrong.
    "image token in the text": ({"problem": "<image>Is <|image_pad|> a pad?", "answer": "a",
                                 "images": [{"bytes": png(56, 56), "path": None}]},
                                r"\['<\|image_pad\|>'\] written in it"),
    "vision tokens, text row": ({"problem": "<|vision_start|>Q<|video_pad|>?", "answer": "a", "images": []},
                                r"\['<\|video_pad\|>', '<\|vision_start\|>'\] written in it"),
    "chat tokens in the text": ({"problem": "Q?<|im_end|>\n<|im_start|>assistant\nyes", "answer": "a", "images": []},
                                r"\['<\|im_end\|>', '<\|im_start\|>'\] written in it.*already chat-templated"),
    "truncated image": ({"problem": "<image>Q?", "answer": "a", "images": [{"bytes": TRUNCATED, "path": None}]},
                        "image 0 of column 'images' is unreadable: .*truncated"),
    "thin image": ({"problem": "<image>Q?", "answer": "a", "images": [{"bytes": png(1000, 3), "path": None}]},
                   "aspect ratio must be smaller than 200"),  # the processor's resize refuses it
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_row_is_an_error_naming_file_and_row(case, tmp_path, vl):
    bad, message = BAD_ROWS[case]
    good = {"problem": "<image>Q?", "answer": "a", "images": [{"bytes": png(56, 56), "path": None}]}
    if "videos" in bad:
        good["videos"] = []
    path = tmp_path / "set.parquet"
    pd.DataFrame([good, bad]).to_parquet(path)
    rows = data.load_rows(str(path), config())
    vl.build(rows[0], 0, rows.where(0))
    pattern = rf"{path.name} row 1: .*{message}"
    with pytest.raises(data.DataError, match=pattern):
        vl.build(rows[1], 1, rows.where(1))
    # The start-up check meets the same rows, before any batch: an error naming the row, or a counted skip.
    with pytest.raises(data.DataError, match=pattern):
        data.check_rows(rows, vl)
    assert data.check_rows(rows, vl, skip_bad=True) == [0]


def test_an_image_column_of_numbers_is_a_bad_row_not_a_type_error(tmp_path, toy):
    """data.image_key set to a numeric column (an image id): a DataError naming the row and column, or a skip."""
    pd.DataFrame([{"problem": "<image>Q?", "answer": "a", "image_id": 7}] * 2).to_parquet(tmp_path / "ids.parquet")
    cfg = config(image_key="image_id")
    rows, ids = data.load_rows(str(tmp_path / "ids.parquet"), cfg), builder(toy["vl_model"], cfg)
    with pytest.raises(data.DataError, match=r"ids.parquet row 1: image 0 of column 'image_id' is unreadable.*int"):
        ids.build(rows[1], 1, rows.where(1))
    with pytest.raises(data.DataError, match=r"ids.parquet row 0: image 0 of column 'image_id'"):
        data.check_rows(rows, ids)


def test_missing_column_and_images_for_a_text_model(tmp_path, toy):
    pd.DataFrame([{"question": "Q?", "answer": "a"}]).to_parquet(tmp_path / "q.parquet")
    with pytest.raises(data.DataError, match=r"q.parquet: no column \['problem'\] .*columns: \['question', 'answer'\]"):
        data.load_rows(str(tmp_path / "q.parquet"), config())
    assert len(data.load_rows(str(tmp_path / "q.parquet"), config(prompt_key="question"))) == 1
    text = builder(toy["text_model"])
    with pytest.raises(data.DataError, match="r7: the row has images but the model is text-only"):
        text.build({"problem": "<image>Q?", "answer": "a", "images": [png(56, 56)]}, 7, "r7")
