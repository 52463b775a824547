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
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}]
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    a = pd.read_parquet(os.path.join(first["colors"], "test.parquet"))
    b = pd.read_parquet(os.path.join(second["colors"], "test.parquet"))
    assert a["answer"].tolist() == b["answer"].tolist()
    stamp = os.path.getmtime(os.path.join(first["vl_model"], "model.safetensors"))
    toy_world.ensure_toy(str(tmp_path / "a"), seed=3)  # cached: not rebuilt
    assert os.path.getmtime(os.path.join(first["vl_model"], "model.safetensors")) == stamp


def test_padded_tokenizer_encodes_like_the_toy_one_and_decodes_every_id():
    # The 3B-sized timing model's tokenizer: the toy vocabulary plus placeholders up to Qwen's size.
    import toy as toy_world

    small, padded = toy_world.build_tokenizer(), toy_world.build_tokenizer(pad_to=151936)
    assert len(small) == 167 and len(padded) == 151936
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is the square?<|im_end|>\n red"
    assert padded(text)["input_ids"] == small(text)["input_ids"]
    assert padded.decode([167, 151935]) == "<t167><t151935>"
    assert padded.convert_tokens_to_ids("<|im_end|>") == small.convert_tokens_to_ids("<|im_end|>")
