"""data.py's images and videos alone: sizes by hand, every accepted form, colours as a viewer shows them, files
closed, frames sampled and decoded, the loader's documented order (the prompts that carry them: test_data.py)."""

import gc
import io
import os
import random
import re
import shutil
import warnings

import numpy
import pandas as pd
import pytest
import torch
from PIL import Image

import data
from test_data import COLOR_LIST, builder, chat, clip, config, loader, png, vl  # noqa: F401 (vl: a fixture)


# ---------------------------------------------------------------------------------------------- images

def test_process_image_bounds_and_aspect(tmp_path):
    # Hand-computed: 400x200 down to 12544 px: s = sqrt(12544/80000) = 0.39598 -> 158.4 x 79.2 -> floor.
    big = data.process_image(Image.new("RGBA", (400, 200)), 3136, 12544)
    assert big.size == (158, 79) and big.mode == "RGB"
    # 10x30 up to 3136 px: s = sqrt(3136/300) = 3.2332 -> 32.3 x 97.0 -> ceil 33 x 97 (3201 >= 3136).
    small = data.process_image(Image.new("L", (10, 30)), 3136, 12544)
    assert small.size == (33, 97) and small.mode == "RGB"
    assert data.process_image(Image.new("RGB", (56, 56)), 3136, 12544).size == (56, 56)  # in range: kept
    rng = random.Random(0)
    for _ in range(200):
        w, h = rng.randint(8, 900), rng.randint(8, 900)
        out = data.process_image(Image.new("RGB", (w, h)), 3136, 12544)
        area = out.width * out.height
        assert 3136 <= area <= 12544 or (3136 <= w * h <= 12544 and out.size == (w, h))
        assert abs(out.width / out.height - w / h) <= (w / h) * 2.5 / min(out.size), (w, h, out.size)


def test_process_image_accepts_every_form(tmp_path):
    raw = png(60, 40, (10, 200, 30))
    (tmp_path / "a.png").write_bytes(raw)
    reference = data.process_image(Image.open(io.BytesIO(raw)), 1000, 100000)
    forms = [raw, {"bytes": raw, "path": None}, {"bytes": None, "path": str(tmp_path / "a.png")},
             str(tmp_path / "a.png")]
    for form in forms:
        out = data.process_image(form, 1000, 100000)
        assert out.size == (60, 40) and out.tobytes() == reference.tobytes()
    assert data.process_image("a.png", 1000, 100000, image_dir=str(tmp_path)).tobytes() == reference.tobytes()
    with pytest.raises(TypeError, match="an image must be"):
        data.process_image(42, 1000, 100000)


def encoded(image, format="PNG", **kw):
    buf = io.BytesIO()
    image.save(buf, format=format, **kw)
    return buf.getvalue()


def test_transparent_16_bit_and_rotated_images_keep_what_a_viewer_shows(tmp_path, vl):
    """A black drawing on a transparent background stays a drawing (over white, as transformers' and vLLM's own
    RGB conversions do; PIL's convert makes it all black); 16-bit grey keeps its levels (v / 257; PIL clips at
    255: white); a photo with EXIF orientation 6 (stored 90 degrees anticlockwise) is turned upright."""
    rgba = Image.new("RGBA", (60, 60), (0, 0, 0, 0))
    rgba.paste((0, 0, 0, 255), (20, 0, 40, 60))  # an opaque black bar, x in [20, 40)
    palette = Image.new("P", (60, 60), 0)
    palette.putpalette([0, 0, 0, 0, 0, 0])
    palette.paste(1, (20, 0, 40, 60))
    for image in (rgba, rgba.convert("LA"), encoded(rgba), encoded(palette, transparency=0)):
        out = data.process_image(image, 1000, 100000)
        assert out.mode == "RGB" and out.getpixel((5, 5)) == (255, 255, 255) and out.getpixel((30, 5)) == (0, 0, 0)
    grey = Image.fromarray(torch.tensor([[128 * 257, 65535, 0, 257]] * 60, dtype=torch.uint16).repeat(1, 15).numpy())
    assert grey.mode == "I;16"
    out = data.process_image(encoded(grey), 1000, 100000)
    assert [out.getpixel((x, 0)) for x in range(4)] == [(128,) * 3, (255,) * 3, (0,) * 3, (1,) * 3]
    photo = Image.new("RGB", (120, 60), (255, 0, 0))  # as stored: left half red, right half blue
    photo.paste((0, 0, 255), (60, 0, 120, 60))
    exif = photo.getexif()
    exif[0x0112] = 6  # orientation 6: shown turned 90 degrees clockwise, the stored left edge on top
    raw = encoded(photo, "JPEG", exif=exif, quality=95)
    out = data.process_image(raw, 1000, 100000)
    assert out.size == (60, 120)
    assert max(abs(a - b) for a, b in zip(out.getpixel((30, 20)), (255, 0, 0))) <= 8  # top: red
    assert max(abs(a - b) for a, b in zip(out.getpixel((30, 100)), (0, 0, 255))) <= 8  # bottom: blue
    row = {"problem": "<image>Which colour is on top?", "answer": "red", "images": [raw]}
    prompt = vl.build(row, 0, "r0")
    assert prompt["images"][0].size == (60, 120)  # 7200 px: in [3136, 12544], kept
    assert vl.measure(row, "r0") == len(prompt["prompt_ids"])


def test_an_image_file_is_closed_once_read(tmp_path):
    """A multi-page TIFF keeps its file open after its pixels are read: data.py closes it, leaving no descriptor open
    with the prompt and none to the garbage collector, which closes a forgotten one with a ResourceWarning."""
    pages = [Image.new("RGB", (60, 60), c) for c in ((255, 0, 0), (0, 255, 0))]
    pages[0].save(tmp_path / "p.tiff", save_all=True, append_images=pages[1:])
    before = len(os.listdir("/proc/self/fd"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        kept = [data.process_image(str(tmp_path / "p.tiff"), 1000, 100000) for _ in range(3)]
        gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before and kept[0].getpixel((0, 0)) == (255, 0, 0)
    assert [str(w.message) for w in caught if "p.tiff" in str(w.message)] == []


# ---------------------------------------------------------------------------------------------- videos

def test_sample_frame_indices_by_hand():
    # T = total / rate * fps, clamped to [min(4, total), min(768, total)], down to even; round(linspace(0, N-1, T)).
    assert data.sample_frame_indices(8, 4.0, 2.0) == [0, 2, 5, 7]                    # 4 frames: 0, 2.33, 4.67, 7
    assert data.sample_frame_indices(100, 25.0, 2.0) == [0, 14, 28, 42, 57, 71, 85, 99]  # 8: steps of 14.14
    assert data.sample_frame_indices(6, 30.0, 2.0) == [0, 2, 3, 5]                   # 0.4 -> at least 4
    assert data.sample_frame_indices(50, 10.0, 1.4) == [0, 10, 20, 29, 39, 49]      # 7 -> 6 (even)
    assert data.sample_frame_indices(3, 30.0, 2.0) == [0, 2]                         # 3 frames -> 2
    assert data.sample_frame_indices(1, 30.0, 2.0) == [0]
    assert len(data.sample_frame_indices(10000, 1.0, 2.0)) == 768
    assert data.sample_frame_indices(10, 1.0, 2.0) == list(range(10))               # 20 clamped to the 10 there are


def test_process_video_decodes_samples_and_resizes(tmp_path):
    raw = clip(8, size=(200, 100), fps=4)
    (tmp_path / "c.mp4").write_bytes(raw)
    frames, metadata = data.process_video(raw, 3136, 12544, 2.0)
    # 8 frames at 4 fps sampled at 2 fps: frames 0, 2, 5, 7; 200x100 down to 12544 px as an image: 158 x 79.
    assert frames.shape == (4, 79, 158, 3) and frames.dtype.name == "uint8"
    assert metadata == {"fps": 4.0, "duration": 2.0, "total_num_frames": 8, "frames_indices": [0, 2, 5, 7],
                        "video_backend": "pyav"}
    centre = torch.tensor(frames[:, 40, 79].astype("int64"))
    expected = torch.tensor([COLOR_LIST[i] for i in (0, 2, 5, 7)])
    assert (centre - expected).abs().max() <= 12  # lossy MPEG-4: within a few levels
    path = str(tmp_path / "c.mp4")
    for form in ({"bytes": raw, "path": None}, {"bytes": None, "path": path}, path):
        assert (data.process_video(form, 3136, 12544, 2.0)[0] == frames).all()
    assert (data.process_video("c.mp4", 3136, 12544, 2.0, image_dir=str(tmp_path))[0] == frames).all()
    small, _ = data.process_video(clip(4, size=(20, 20), fps=2), 3136, 12544, 2.0)  # up to 3136 px: 56 x 56
    assert small.shape == (4, 56, 56, 3)


def test_a_list_of_frames_is_one_video_as_qwen_vl_utils_reads_it(tmp_path, vl):
    """EasyR1's reader (qwen-vl-utils) takes a list of frame images as one video: every frame, each resized as an
    image, the last repeated to an even count, at the configured rate. It was a TypeError here."""
    for i in range(3):
        Image.new("RGB", (200, 100), COLOR_LIST[i]).save(tmp_path / f"f{i}.png")
    frames, metadata = data.process_video(["f0.png", "f1.png", "f2.png"], 3136, 12544, 2.0, image_dir=str(tmp_path))
    assert frames.shape == (4, 79, 158, 3) and frames.dtype.name == "uint8"  # as process_image: 158 x 79
    assert [tuple(f[40, 79]) for f in frames] == [COLOR_LIST[0], COLOR_LIST[1], COLOR_LIST[2], COLOR_LIST[2]]
    assert metadata == {"fps": 2.0, "duration": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3],
                        "video_backend": "frames"}
    prompt = vl.build({"problem": "<video>Which colour comes first?", "answer": "red",
                       "videos": [[png(56, 56, COLOR_LIST[0]), {"bytes": png(56, 56, COLOR_LIST[1])}]]}, 0, "r0")
    assert prompt["multi_modal_inputs"]["video_grid_thw"].tolist() == [[1, 4, 4]]  # 2 frames: one temporal patch
    with pytest.raises(ValueError, match=r"frame 1 is 56x112 after resizing, frame 0 56x56: one size for a video"):
        data.process_video([png(56, 56), png(56, 112)], 3136, 12544, 2.0)
    with pytest.raises(ValueError, match="an empty list of frames"):
        data.process_video([], 3136, 12544, 2.0)


def test_video_frames_are_bounded_per_frame_as_qwen_vl_utils_bounds_them(tmp_path, monkeypatch):
    """EasyR1's reader caps each frame at min(max_pixels, max(min(768 f^2, 0.9 x 128000 f^2 x 2 / T), 1.05
    min_pixels)); the frames were bounded by data.max_pixels alone: 1.7x the tokens of a 720p clip, 3.7x at 1080p."""
    hd = [Image.new("RGB", (1280, 720), COLOR_LIST[i]) for i in range(4)]
    # geo3k's bounds, Qwen2.5-VL (f = 28), 4 frames: cap 768 x 784 = 602112; s = sqrt(602112 / 921600) = 0.80829
    frames, _ = data.process_video(hd, 262144, 4194304, 2.0, factor=28)
    assert frames.shape == (4, 581, 1034, 3)  # 1280 s = 1034.6, 720 s = 581.97, rounded down
    # Qwen3-VL (f = 32): 768 x 1024 = 786432, s = 0.92376: 1182.4 x 665.1
    assert data.process_video(hd[:2], 262144, 4194304, 2.0, factor=32)[0].shape == (2, 665, 1182, 3)
    small = [Image.new("RGB", (60, 60))] * 399  # f = 2: 768 x 4 = 3072; 0.9 x 128000 x 4 x 2 / 400 = 2304 (even)
    assert data.process_video(small, 100, 10**6, 2.0, factor=2)[0].shape == (400, 48, 48, 3)  # s = 0.8
    small = small + small  # 798 frames: 921600 / 798 = 1154.9 < 1.05 x 1500 = 1575: s = sqrt(1575 / 3600) = 0.661
    assert data.process_video(small, 1500, 10**6, 2.0, factor=2)[0].shape == (798, 39, 39, 3)  # 39.7 down to 39
    raw = clip(4, size=(200, 100), fps=2)  # a file: the same bound for its 4 sampled frames
    assert data.process_video(raw, 100, 10**6, 2.0, factor=2)[0].shape == (4, 39, 78, 3)  # 3072: s = 0.39192
    long = clip(400, size=(200, 100), fps=100)  # 8 sampled of 400 frames: the bound of 8 (3072), not of 400 (2304)
    assert data.process_video(long, 100, 10**6, 2.0, factor=2)[0].shape == (8, 39, 78, 3)
    caps = []  # 301 listed frames are bounded as the 302 they are padded to: 0.9 x 128000 x 28^2 x 2 / 302
    monkeypatch.setattr(data, "process_image", lambda *args: caps.append(args[2]) or numpy.zeros((4, 4, 3), "uint8"))
    data.process_video([None] * 301, 3136, 10**7, 2.0, factor=28)
    assert caps == pytest.approx([0.9 * 128000 * 784 * 2 / 302] * 301, rel=1e-12)


def test_a_file_without_a_video_stream_says_so(tmp_path):
    """An audio-only file was an IndexError: tuple index out of range."""
    import av

    with av.open(str(tmp_path / "a.mp4"), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(numpy.zeros((1, 1024), numpy.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    with pytest.raises(ValueError, match=re.escape("no video stream in the file, only ['audio']")):
        data.process_video(str(tmp_path / "a.mp4"), 3136, 12544, 2.0)


def test_16_bit_grey_is_divided_by_257_rounding_down():
    # v // 257 by hand: 256 -> 0 (not 1, as v // 256 or v >> 8 give), 65280 = 257 * 254 + 2 -> 254 (not 255).
    grey = Image.fromarray(torch.tensor([[256, 65280]] * 4, dtype=torch.uint16).numpy())
    out = data.process_image(encoded(grey), 1, 100000)
    assert [out.getpixel((x, 0)) for x in range(2)] == [(0,) * 3, (254,) * 3]
    # A 16-bit PGM opens as 32-bit "I" (it came out white); an "I" image within 0..255 is taken as it is.
    out = data.process_image(encoded(grey, "PPM"), 1, 100000)  # PIL writes a 16-bit grey PPM as PGM (P5, max 65535)
    assert Image.open(io.BytesIO(encoded(grey, "PPM"))).mode == "I"
    assert [out.getpixel((x, 0)) for x in range(2)] == [(0,) * 3, (254,) * 3]
    low = Image.fromarray(numpy.array([[3, 255]] * 4, dtype=numpy.int32))  # 255 is the top of 8 bits, not of 16
    assert low.mode == "I" and [data.process_image(low, 1, 100000).getpixel((x, 0)) for x in range(2)] == [(3,) * 3,
                                                                                                         (255,) * 3]


def test_a_float_image_in_0_1_is_scaled_and_any_other_taken_as_levels():
    # PIL's own convert clips mode F to 0..255, so a [0, 1] image came out black. By hand: 0.2 * 255 = 51,
    # 0.5 * 255 = 127.5 -> 128, NaN -> 0; an image beyond 1 keeps its levels, 300 clipped to 255.
    unit = Image.fromarray(numpy.array([[0.2, 0.5, 1.0, float("nan")]] * 4, dtype=numpy.float32))
    levels = Image.fromarray(numpy.array([[0.5, 100.0, 300.0, -4.0]] * 4, dtype=numpy.float32))
    assert unit.mode == levels.mode == "F" and Image.open(io.BytesIO(encoded(unit, "TIFF"))).mode == "F"
    got = [[out.getpixel((x, 0))[0] for x in range(4)] for out in
           (data.process_image(encoded(unit, "TIFF"), 1, 100000), data.process_image(levels, 1, 100000))]
    assert got == [[51, 128, 255, 0], [0, 100, 255, 0]]


# ---------------------------------------------------------------------------------------------- loader

def test_loader_order_is_the_documented_permutation_and_resumes_at_the_saved_batch(tmp_path, toy):
    """Epoch e visits rows in torch.randperm(n, seed * 1_000_003 + e) (seed 1; seed 7's epoch 1: 7_000_022, where
    seed 1 cannot tell the product from seed * (1_000_003 + e)), in floor(10 / 3) = 3 batches of 3 with drop_last
    (ceil: 4 without); a state saved at (epoch 1, batch 2) resumes with exactly that batch, and a state of another
    seed, shuffle or row count is refused."""
    pd.DataFrame([{"problem": f"What is {i}?", "answer": str(i)} for i in range(10)]).to_parquet(tmp_path / "t.parquet")
    make = lambda **kw: loader(toy["text_model"], str(tmp_path / "t.parquet"), batch_size=3, **kw)
    perm = [torch.randperm(10, generator=torch.Generator().manual_seed(1_000_003 + e)).tolist() for e in range(3)]
    expected = [perm[e][3 * b:3 * b + 3] for e in range(3) for b in range(3)]
    straight = make()
    got = [next(straight) for _ in range(7)]
    assert [[p["index"] for p in batch] for batch in got] == expected[:7]
    assert [p["uid"] for p in got[3]] == [f"1-{i}" for i in perm[1][0:3]]
    whole = list(straight.epoch())  # epoch 2 (the current one) from its start, the position (2, 1) unmoved
    assert [[p["index"] for p in b] for b in whole] == expected[6:9] and whole[2][0]["uid"] == f"2-{perm[2][6]}"
    assert (straight.current_epoch, straight.batch) == (2, 1)
    resumed = make()
    resumed.load_state_dict({**straight.state_dict(), "epoch": 1, "batch": 2})
    assert [[p["index"] for p in next(resumed)] for _ in range(2)] == expected[5:7] and resumed.current_epoch == 2
    for key, value in (("seed", 2), ("shuffle", False), ("num_rows", 11)):  # another order: refused
        with pytest.raises(ValueError, match=f"saved with {key}={value}, now it is"):
            resumed.load_state_dict({**straight.state_dict(), key: value})
    kept_tail = make(drop_last=False)
    assert kept_tail.batches_per_epoch == 4
    assert [[p["index"] for p in batch] for batch in kept_tail.epoch()][3] == [perm[0][9]]
    seven = make(cfg=config(seed=7))
    seven.load_state_dict({**seven.state_dict(), "epoch": 1})
    order = torch.randperm(10, generator=torch.Generator().manual_seed(7_000_022)).tolist()
    assert [p["index"] for p in next(seven)] == order[:3]


def test_format_template_is_stripped_and_no_empty_text_part_reaches_the_chat_template(tmp_path, toy):
    """The format template file is read stripped (blank lines and indent around it gone), and `<image>` at the
    start of the prompt gives [image, text], not an empty text part first (a template may render every part)."""
    (tmp_path / "f.jinja").write_text("\n\n  {{ content }} Think.\n\n\n")
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{% for c in m['content'] %}[{{ c['type'] }}:"
                                         "{{ c.get('text', '<|image_pad|>') }}]{% endfor %}{% endfor %}")
    cfg = config(format_prompt=str(tmp_path / "f.jinja"), override_chat_template=str(tmp_path / "chat.jinja"))
    builder = data.PromptBuilder(cfg, data.load_processor(toy["vl_model"], cfg)[0], toy["vl_model"])
    row = {"problem": "<image>What?", "answer": "x", "images": [png(56, 56)]}
    assert builder.prompt_text(row, "r0")[0] == "[image:<|image_pad|>][text:What? Think.]"


def test_a_tokenizer_without_a_chat_template_is_an_error_naming_the_key(tmp_path, toy):
    """A base model's tokenizer has no chat template: an error at load naming the folder and
    data.override_chat_template (transformers' own came at the first row, naming neither); with the key set it
    loads."""
    shutil.copytree(toy["text_model"], tmp_path / "base", ignore=lambda d, names: ["chat_template.jinja"])
    with pytest.raises(data.DataError, match=re.escape(f"{tmp_path / 'base'} has no chat template (a base model?): "
                                                       "set data.override_chat_template")):
        data.load_processor(str(tmp_path / "base"), config())
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    processor, _ = data.load_processor(str(tmp_path / "base"),
                                       config(override_chat_template=str(tmp_path / "chat.jinja")))
    assert processor.chat_template == (tmp_path / "chat.jinja").read_text()


def test_a_format_template_must_use_content_and_nothing_else(tmp_path, toy):
    """`{{ question }}` for `{{ content }}` rendered '' for every row (the question silently gone): an error at
    start-up naming data.format_prompt and the file, as is any other variable (only `content` is given)."""
    for body in ("Solve: {{ question }}\nAnswer in \\boxed{}.", "{{ content }} Hint: {{ hint }}", "Solve it."):
        (tmp_path / "f.jinja").write_text(body)
        with pytest.raises(data.DataError, match=re.escape(f"data.format_prompt ({tmp_path / 'f.jinja'})")):
            builder(toy["text_model"], config(format_prompt=str(tmp_path / "f.jinja")))
    for name in ("math", "r1v", "dapo"):  # the shipped templates use `content` only
        built = builder(toy["text_model"], config(format_prompt=f"configs/format/{name}.jinja"))
        assert "What is 3 + 4?" in built.prompt_text({"problem": "What is 3 + 4?", "answer": "7"}, "r0")[0]


def test_a_chat_template_or_system_prompt_that_changes_the_placeholders_fails_at_start_up(tmp_path, toy):
    """A chat template that writes a message's content list as text (no <|image_pad|>), or a system prompt holding
    <|image_pad|>, passed the start-up check and failed at the first batch blaming the row."""
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    row = {"problem": "<image>What?", "answer": "red", "images": [png(56, 56)]}
    text_row = {"problem": "What?", "answer": "red"}
    over = builder(toy["vl_model"], config(override_chat_template=str(tmp_path / "chat.jinja")))
    assert over.prompt_text(text_row, "r0")[0] == chat("What?")  # text rows are unchanged
    with pytest.raises(data.DataError, match=r"r0: the chat template gave 0 <\|image_pad\|> for 1 image.*"
                                             "data.override_chat_template"):
        over.prompt_text(row, "r0")
    with pytest.raises(data.DataError, match="r0: .*1 <\\|image_pad\\|> for 0 image.*data.system_prompt"):
        builder(toy["vl_model"], config(system_prompt="Images come as <|image_pad|>.")).prompt_text(text_row, "r0")
    pd.DataFrame([row, row]).to_parquet(tmp_path / "set.parquet")
    with pytest.raises(data.DataError, match="set.parquet row 0: the chat template gave 0"):
        data.check_rows(data.load_rows(str(tmp_path / "set.parquet"), config()), over)


def test_an_empty_list_answer_is_no_answer(toy):
    """str([]) is '[]', which passed the blank-answer check and became the ground truth."""
    text = builder(toy["text_model"])
    for answer in ([], (), {}):
        with pytest.raises(data.DataError, match=re.escape(f"r3: no answer in column 'answer' ({answer!r})")):
            text.prompt_text({"problem": "Q?", "answer": answer}, "r3")
    assert text.build({"problem": "Q?", "answer": 0}, 3, "r3")["ground_truth"] == "0"


def test_numeric_answers_keep_their_written_form_and_nan_is_no_answer(toy, tmp_path):
    """A CSV column of integers with one blank cell (or jsonl answers 3 and 2.5) comes back as floats: the ground
    truth read '7.0' for '7', which an exact-match reward scores 0; a NaN answer became the ground truth 'nan'."""
    text = builder(toy["text_model"])
    assert [text.build({"problem": "Q?", "answer": a}, 0, "r0")["ground_truth"] for a in (7.0, 2.5, 7, -0.0)] == \
        ["7", "2.5", "7", "0"]
    with pytest.raises(data.DataError, match=re.escape("r1: no answer in column 'answer' (nan)")):
        text.prompt_text({"problem": "Q?", "answer": float("nan")}, "r1")
    (tmp_path / "a.csv").write_text("problem,answer\nWhat is 3+4?,7\nmissing?,\nx?,2\n")
    rows = data.load_rows(str(tmp_path / "a.csv"), config(skip_bad_rows=True))
    assert [text.build(rows[i], i, f"r{i}")["ground_truth"] for i in (0, 2)] == ["7", "2"]
    # prompt and answer cells as written: type guessing read 007 as 7, 3.10 as 3.1, 1e3 as 1000 and NA as missing;
    # other columns keep their guessed types (a reward may compare extra["level"] with a number)
    (tmp_path / "b.csv").write_text("problem,answer,level\nNA,007,1\nb?, 3.10,\nc?,1e3,2.5\nd?,NA,3\n")
    rows = data.load_rows(str(tmp_path / "b.csv"), config())
    assert [(rows[i]["problem"], rows[i]["answer"], rows[i]["level"]) for i in range(4)] == \
        [("NA", "007", 1.0), ("b?", "3.10", None), ("c?", "1e3", 2.5), ("d?", "NA", 3.0)]  # " 3.10": space skipped
    assert [text.build(rows[i], i, f"r{i}")["ground_truth"] for i in range(4)] == ["007", "3.10", "1e3", "NA"]


def test_a_list_answer_reaches_the_reward_as_it_is(toy):
    """EasyR1 passes the answer column's value as it is; a list of accepted answers became its repr "['4', 'four']",
    which a reward written for EasyR1 (`any(... for gold in ground_truth)`) walks character by character."""
    text = builder(toy["text_model"])
    assert text.build({"problem": "Q?", "answer": ["4", "four"]}, 0, "r0")["ground_truth"] == ["4", "four"]
    got = text.build({"problem": "Q?", "answer": {"low": 1, "high": 2}}, 0, "r0")["ground_truth"]
    assert got == {"low": 1, "high": 2}


def test_a_broken_format_prompt_is_a_data_error_naming_the_file(toy, tmp_path):
    """A template syntax error was a jinja2 traceback without the file's name, and a missing file a FileNotFoundError:
    neither the one-line error the command line prints for data problems."""
    (tmp_path / "bad.jinja").write_text("{{ content ")
    with pytest.raises(data.DataError, match=r"data.format_prompt \(.*bad.jinja\) line 1: unexpected end of template"):
        builder(toy["text_model"], config(format_prompt=str(tmp_path / "bad.jinja")))


# ---------------------------------------------------------------------------------------------- what mutants showed

def test_qwen2_5_vl_video_times_follow_the_sampled_fps(toy):
    """32 frames at 4 fps sampled at video_fps 1: 8 frames, 4 temporal patches of 2 frames = 2 s each. Qwen2.5-VL
    places patch t at t x 2 s x tokens_per_second (4 in the toy's config) -> time rows 0, 8, 16, 24 (at 2 fps a
    patch is 1 s, the default, which hid a dropped second_per_grid_ts); the text after the video continues past its
    largest position (k + 24, the video's first token at k) at k + 25 on all three rows."""
    b = builder(toy["vl_model"], config(min_pixels=3136, max_pixels=3136, max_prompt_length=8192, video_fps=1.0))
    p = b.build({"problem": "<video>Which colour comes last?", "answer": "red",
                 "videos": [clip(32, size=(56, 56), fps=4)]}, 0, "r0")
    assert p["multi_modal_inputs"]["video_grid_thw"].tolist() == [[4, 4, 4]]
    pad = b.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    k, n = p["prompt_ids"].index(pad), p["prompt_ids"].count(pad)
    assert sorted({t - k for t in p["position_ids"][1, k:k + n].tolist()}) == [0, 8, 16, 24]
    assert p["position_ids"][1:, k + n].tolist() == [k + 25] * 3


def test_video_times_follow_an_overridden_tokens_per_second(toy):
    """data.py builds positions from the config it is handed: trainer.py's, with model.override_config applied, as
    vLLM applies it. tokens_per_second 8 (the toy's: 4) doubles the time rows above: 0, 16, 32, 48."""
    from transformers import AutoConfig

    from modeling import apply_overrides
    hf_config = AutoConfig.from_pretrained(toy["vl_model"])
    apply_overrides(hf_config, {"vision_config": {"tokens_per_second": 8}})
    cfg = config(min_pixels=3136, max_pixels=3136, max_prompt_length=8192, video_fps=1.0)
    b = data.PromptBuilder(cfg, data.load_processor(toy["vl_model"], cfg)[0], hf_config)
    p = b.build({"problem": "<video>Which colour comes last?", "answer": "red",
                 "videos": [clip(32, size=(56, 56), fps=4)]}, 0, "r0")
    pad = b.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    k, n = p["prompt_ids"].index(pad), p["prompt_ids"].count(pad)
    assert sorted({t - k for t in p["position_ids"][1, k:k + n].tolist()}) == [0, 16, 32, 48]


def test_a_video_file_cut_after_its_header_is_an_error_and_one_without_a_frame_count_reads(tmp_path):
    """An MP4 whose index comes first (faststart) cut to half: the header announces 16 frames, fewer decode -> an
    error, not fewer frames under the header's indices. A Matroska file announces no frame count: its 8 frames
    at 4 fps are counted and sampled at 2 fps, indices round(linspace(0, 7, 4)) = [0, 2, 5, 7]."""
    import av

    path = str(tmp_path / "fast.mp4")
    with av.open(io.BytesIO(clip(16, fps=4))) as src, av.open(path, "w", format="mp4",
                                                            options={"movflags": "faststart"}) as dst:
        out = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.dts is not None:
                packet.stream = out
                dst.mux(packet)
    whole = open(path, "rb").read()
    with pytest.raises(ValueError, match="of the 16 frames its container lists decode"):
        data.process_video(whole[:len(whole) // 2], 3136, 12544, 4.0)
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as c:
        s = c.add_stream("mpeg4", rate=4)
        s.width = s.height = 56
        s.pix_fmt = "yuv420p"
        for i in range(8):
            c.mux(s.encode(av.VideoFrame.from_image(Image.new("RGB", (56, 56), COLOR_LIST[i % 8]))))
        c.mux(s.encode())
    frames, meta = data.process_video(buf.getvalue(), 3136, 12544, 2.0)
    assert frames.shape == (4, 56, 56, 3) and meta["total_num_frames"] == 8 and meta["frames_indices"] == [0, 2, 5, 7]


def test_big_endian_16_bit_and_a_features_bytes_beside_its_path(toy, tmp_path):
    """I;16B greys v -> v // 257 like I;16: 1000 -> 3, 63000 -> 245 (not white). An HF Image feature's dict holds
    the bytes and the file's bare name: the bytes are read. A video path is looked up under data.image_dir."""
    grey = Image.frombytes("I;16B", (8, 8), (numpy.arange(64).reshape(8, 8) * 1000).astype(">u2").tobytes())
    out = data.process_image(grey, 1, 10**6)
    assert out.getpixel((1, 0)) == (3, 3, 3) and out.getpixel((7, 7)) == (245, 245, 245)
    assert data.process_image({"bytes": png(56, 56), "path": "img_0001.png"}, 3136, 12544).size == (56, 56)
    (tmp_path / "c.mp4").write_bytes(clip(8, fps=4))
    prompt = builder(toy["vl_model"], config(image_dir=str(tmp_path))).build(
        {"problem": "<video>Q?", "answer": "a", "videos": ["c.mp4"]}, 0, "r0")
    assert prompt["videos"][0].shape == (4, 56, 56, 3)  # 8 frames at 4 fps sampled at 2 fps


def test_a_loader_with_a_pixel_dtype_casts_the_pixel_values_only(tmp_path, toy):
    """trainer.py asks for bf16 pixel values where every pass computes in bf16: the processor's fp32 ones rounded,
    the grids (integers) as they were; a video's pixel values too."""
    rows = [{"problem": "<image>Which colour, <video>?", "answer": "red", "images": [png(90, 60, (13, 170, 91))],
             "videos": [clip(4, size=(64, 64), fps=2)]}]
    pd.DataFrame(rows).to_parquet(tmp_path / "m.parquet")
    (fp32,), (bf16,) = (next(loader(toy["vl_model"], str(tmp_path / "m.parquet"), batch_size=1, pixel_dtype=dtype))
                        for dtype in (None, torch.bfloat16))
    fp32, bf16 = fp32["multi_modal_inputs"], bf16["multi_modal_inputs"]
    assert set(fp32) == set(bf16) == {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"}
    for key in ("pixel_values", "pixel_values_videos"):
        assert fp32[key].dtype == torch.float32 and bf16[key].dtype == torch.bfloat16
        assert torch.equal(bf16[key], fp32[key].to(torch.bfloat16)) and not torch.equal(bf16[key].float(), fp32[key])
    for key in ("image_grid_thw", "video_grid_thw"):
        assert torch.equal(bf16[key], fp32[key]) and bf16[key].dtype == fp32[key].dtype


def test_a_prompts_video_frames_are_bounded_by_its_models_merged_patch(toy):
    """The builder bounds video frames for the model's merged patch of patch_size x merge_size pixels (the toy's
    Qwen2.5-VL: 14 x 2 = 28): two 1000 x 1000 frames under max_pixels 10^6 get 768 x 28^2 = 602112 pixels,
    s = sqrt(0.602112) = 0.77596 -> 775 x 775 (a 14-pixel patch would give 150528: 387 x 387)."""
    b = builder(toy["vl_model"], config(max_pixels=10**6, max_prompt_length=8192))
    p = b.build({"problem": "<video>Which colour?", "answer": "red",
                 "videos": [[png(1000, 1000, COLOR_LIST[0]), png(1000, 1000, COLOR_LIST[1])]]}, 0, "r0")
    assert p["videos"][0].shape == (2, 775, 775, 3)
