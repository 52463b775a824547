import io
import os

import pandas as pd
import pytest
import torch


def test_vl_model_reloads_through_auto_classes(toy):
    from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

    processor = AutoProcessor.from_pretrained(toy["vl_model"])
    model = AutoModelForImageTextToText.from_pretrained(toy["vl_model"])
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.config.text_config.vocab_size >= len(processor.tokenizer)
    gen = GenerationConfig.from_pretrained(toy["vl_model"])
    tok = processor.tokenizer
    assert gen.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]

    # One task row through the chat template, the processor and the model.
    from PIL import Image

    row = pd.read_parquet(os.path.join(toy["colors"], "train.parquet")).iloc[0]
    assert "<image>" in row["problem"] and row["answer"] in ("red", "green", "blue", "yellow")
    image = Image.open(io.BytesIO(row["images"][0]["bytes"]))
    messages = [{"role": "user",
                 "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    n_image_tokens = (inputs["input_ids"] == processor.image_token_id).sum().item()
    assert n_image_tokens == inputs["image_grid_thw"].prod().item() // 4 == 4
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_text_model_and_tokenizer_round_trip(toy):
    from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer

    for path in (toy["text_model"], toy["vl_model"]):
        tok = AutoTokenizer.from_pretrained(path)
        for text in ["<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n", "red green\nblue yellow",
                     "<think> x </think> \\boxed{\\frac{1}{2}} Answer: 12, hello world!",
                     "<|vision_start|><|image_pad|><|vision_end|><|video_pad|><|endoftext|>"]:
            ids = tok(text)["input_ids"]
            assert tok.decode(ids) == text
        specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                    "<|video_pad|>", "<|endoftext|>"]
        for s in specials:
            assert tok(s)["input_ids"] == [tok.convert_tokens_to_ids(s)], s
        for color in ("red", "green", "blue", "yellow"):  # task answers are single tokens, with a
            for text in (color, " " + color):             # leading space too: no colour is harder to say
                assert len(tok(text)["input_ids"]) == 1, repr(text)
    model = AutoModelForCausalLM.from_pretrained(toy["text_model"])
    assert type(model).__name__ == "Qwen2ForCausalLM"
    for name in ("text_model", "text_warm"):  # another tool's AutoProcessor: the tokenizer, not the VL processor's
        assert type(AutoProcessor.from_pretrained(toy[name])) is type(AutoTokenizer.from_pretrained(toy[name]))
    rows = pd.read_parquet(os.path.join(toy["sums"], "test.parquet"))
    a, b = rows.iloc[0]["problem"].removeprefix("What is ").removesuffix("?").split(" + ")
    assert int(a) + int(b) == int(rows.iloc[0]["answer"])


def test_toy_world_is_deterministic_and_cached(tmp_path):
    import toy as toy_world

    first = toy_world.ensure_toy(str(tmp_path / "a"), seed=3)
    second = toy_world.ensure_toy(str(tmp_path / "b"), seed=3)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert open(os.path.join(first["vl_model"], name), "rb").read() == \
            open(os.path.join(second["vl_model"], name), "rb").read(), name
    for model in ("vl_warm", "text_warm"):  # the warm start too (one CPU thread: the same sums anywhere)
        assert open(os.path.join(first[model], "model.safetensors"), "rb").read() == \
            open(os.path.join(second[model], "model.safetensors"), "rb").read(), model
    a = pd.read_parquet(os.path.join(first["colors"], "test.parquet"))
    b = pd.read_parquet(os.path.join(second["colors"], "test.parquet"))
    assert a["answer"].tolist() == b["answer"].tolist()
    stamp = os.path.getmtime(os.path.join(first["vl_model"], "model.safetensors"))
    toy_world.ensure_toy(str(tmp_path / "a"), seed=3)  # cached: not rebuilt
    assert os.path.getmtime(os.path.join(first["vl_model"], "model.safetensors")) == stamp


def test_a_build_that_loses_the_race_keeps_the_winners_world(tmp_path, monkeypatch):
    """Two processes build at once: the one that finishes second deleted the first one's finished world (which
    others were already reading) before renaming its own copy into place. It now keeps the finished one; an older
    version is replaced, and no build folder is left behind."""
    import toy as toy_world

    root = tmp_path / "toy"
    for name in ("build_vl_model", "build_text_model", "_write_task"):
        monkeypatch.setattr(toy_world, name, lambda path, *args, **kwargs: os.makedirs(path))
    monkeypatch.setattr(toy_world, "build_tokenizer", lambda: None)

    def warm_start_while_another_build_finishes(base, out, task, seed):
        os.makedirs(out)
        if winner:
            (root / "vl_model").mkdir(parents=True, exist_ok=True)
            (root / "VERSION").write_text(f"{toy_world.TOY_VERSION} {seed}\n")
    monkeypatch.setattr(toy_world, "warm_start", warm_start_while_another_build_finishes)
    winner = True
    toy_world.ensure_toy(str(root))
    assert (root / "vl_model").exists() and not (root / "vl_warm").exists(), "the winner's world was replaced"
    (root / "VERSION").write_text("an older version 0\n")
    winner = False
    toy_world.ensure_toy(str(root))
    assert (root / "vl_warm").exists() and (root / "VERSION").read_text() == f"{toy_world.TOY_VERSION} 0\n"
    assert os.listdir(tmp_path) == ["toy"], os.listdir(tmp_path)
    assert os.stat(root).st_mode & 0o777 == 0o755, "not a usual folder (mkdtemp's 0700)"


def test_padded_tokenizer_encodes_like_the_toy_one_and_decodes_every_id():
    # The 3B-sized timing model's tokenizer: the toy vocabulary plus placeholders up to Qwen's size.
    import toy as toy_world

    small, padded = toy_world.build_tokenizer(), toy_world.build_tokenizer(pad_to=151936)
    assert len(small) == 167 and len(padded) == 151936
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is the square?<|im_end|>\n red"
    assert padded(text)["input_ids"] == small(text)["input_ids"]
    assert padded.decode([167, 151935]) == "<t167><t151935>"
    assert padded.convert_tokens_to_ids("<|im_end|>") == small.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("model, task", [("vl_warm", "colors"), ("text_warm", "sums")])
def test_warm_start_answers_in_format_with_content_at_chance(toy, model, task):
    """The warm-started policy answers `<answer>X</answer>` then EOS and nothing else (greedy: every test prompt;
    sampled at temperature 1: >= 95%), X one of the task's answers, right about as often as chance."""
    import re

    from PIL import Image
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    import toy as toy_world

    is_vl = task == "colors"
    policy = (AutoModelForImageTextToText if is_vl else AutoModelForCausalLM).from_pretrained(toy[model]).eval()
    processor = (AutoProcessor if is_vl else AutoTokenizer).from_pretrained(toy[model])
    tok = processor.tokenizer if is_vl else processor
    rows = pd.read_parquet(os.path.join(toy[task], "test.parquet"))
    texts, images = [], []
    for question in rows["problem"]:
        content = [{"type": "image"}, {"type": "text", "text": question.replace("<image>", "")}] if is_vl else question
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                   tokenize=False))
    if is_vl:
        images = [Image.open(io.BytesIO(r[0]["bytes"])) for r in rows["images"]]
    inputs = (processor(text=texts, images=images, return_tensors="pt") if is_vl
              else processor(texts, return_tensors="pt"))
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    choices = ["red", "green", "blue", "yellow"] if is_vl else list(map(str, range(2 * toy_world.SUM_DIGITS + 1)))
    torch.manual_seed(0)
    for sampled in (False, True):
        with torch.no_grad():
            out = policy.generate(**inputs, max_new_tokens=16, do_sample=sampled, temperature=1.0, top_k=0,
                                  num_return_sequences=4 if sampled else 1, eos_token_id=eos, pad_token_id=eos[1])
        answers, right = [], 0
        for i, ids in enumerate(out[:, inputs["input_ids"].shape[1]:].tolist()):
            found = re.fullmatch(r"<answer>(.*)</answer><\|im_end\|>(<\|endoftext\|>)*", tok.decode(ids))
            answers.append(found.group(1) if found and found.group(1) in choices else None)
            right += answers[-1] == rows["answer"].iloc[i // 4 if sampled else i]
        formatted = sum(a is not None for a in answers) / len(answers)
        if not sampled:
            assert formatted == 1.0 and right / len(answers) <= 0.4, (formatted, right)
        else:
            assert formatted >= 0.95, formatted
            assert abs(right / len(answers) - 1 / len(choices)) < 0.1, right  # chance
            assert len(set(answers) - {None}) == len(choices)  # every answer is still said


def test_toy_reward_file_scores_format_and_accuracy():
    import reward

    path = os.path.join(os.path.dirname(__file__), "..", "configs", "toy_reward.py") + ":compute_score"
    score = reward.load_reward_function(path)
    cases = [("<answer>red</answer>", "red", 1.0, 1.0), ("<answer>blue</answer>", "red", 1.0, 0.0),
             ("<answer> 7 </answer>", "7", 1.0, 1.0), ("<answer>red</answer>\n", "red", 0.0, 1.0),
             ("red", "red", 0.0, 1.0), ("<answer>red", "red", 0.0, 0.0), ("x<answer>red</answer>", "green", 0.0, 0.0),
             ("<answer>red</answer></answer></answer>", "red", 0.0, 1.0),  # run on to the length cap
             ("<answer><answer>red</answer>", "red", 0.0, 0.0),
             ("<answer>red</answer><answer>red</answer>", "red", 0.0, 1.0)]  # two blocks: not one, format 0
    got = score([{"response": r, "ground_truth": g, "response_length": 1, "prompt": "", "extra": {}}
                 for r, g, _, _ in cases])
    for (response, _, form, accuracy), result in zip(cases, got):
        assert result == {"overall": 0.5 * accuracy + 0.5 * form, "format": form, "accuracy": accuracy}, response
    # format_weight 0.2 (the default 0.5 weighs both alike): 0.8 x accuracy + 0.2 x format
    got = reward.load_reward_function(path, format_weight=0.2)([
        {"response": r, "ground_truth": "red", "response_length": 1, "prompt": "", "extra": {}}
        for r in ("<answer>red</answer>\n", "<answer>blue</answer>")])  # accuracy 1 format 0; format 1 accuracy 0
    assert [s["overall"] for s in got] == [pytest.approx(0.8), pytest.approx(0.2)]


def test_task_rows_answer_what_they_show():
    """A colours row's image holds a square of its answer's colour (40 to 56 pixels a side), a sums row's answer is
    the sum it asks of two digits 0..2 (each sum 0..4 drawn), a video row's answer is the colour of 3 of its 4 frames
    (MPEG-4 shifts colours a little: a pixel within 90 of a colour's RGB, summed over channels, counts as it)."""
    import random

    import av
    import numpy as np
    from PIL import Image

    import toy as toy_world

    def pixels_of_each_colour(image):
        rgb = np.asarray(image.convert("RGB"), dtype=int)
        return {name: int((np.abs(rgb - value).sum(-1) < 90).sum()) for name, value in toy_world.COLORS.items()}

    rng = random.Random(0)
    for _ in range(20):
        row = toy_world.colors_row(rng)
        counts = pixels_of_each_colour(Image.open(io.BytesIO(row["images"][0]["bytes"])))
        assert counts[row["answer"]] >= 40 * 40 and sum(counts.values()) == counts[row["answer"]], counts
    sums = [toy_world.sums_row(rng) for _ in range(200)]
    for row in sums:
        a, b = map(int, row["problem"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert a + b == int(row["answer"]) and 0 <= min(a, b) <= max(a, b) <= 2, row
    assert sorted({row["answer"] for row in sums}) == ["0", "1", "2", "3", "4"]
    for _ in range(3):
        row = toy_world.video_colors_row(rng)
        with av.open(io.BytesIO(row["videos"][0]["bytes"])) as clip:
            frames = [pixels_of_each_colour(frame.to_image()) for frame in clip.decode(video=0)]
        assert [max(f, key=f.get) == row["answer"] for f in frames].count(True) == 3 and len(frames) == 4, row["answer"]
