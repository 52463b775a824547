"""data.py's sources beyond test_data.py: Hugging Face Image / Video features left to data.py to decode, and a
folder with one subfolder per split (the hub's and DatasetDict.save_to_disk's layouts)."""

import io
import json
import re

import datasets
import pandas as pd
import pyarrow.ipc
import pyarrow.parquet
import pytest
from PIL import Image

import data
from test_data import builder, clip, config, png

ROWS = [{"problem": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(4)]


def rotated_jpeg():
    """A 120x60 JPEG, left half red, right half blue, with EXIF orientation 6: shown 60x120, red on top."""
    photo = Image.new("RGB", (120, 60), (255, 0, 0))
    photo.paste((0, 0, 255), (60, 0, 120, 60))
    exif = photo.getexif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    photo.save(buf, format="JPEG", exif=exif, quality=95)
    return buf.getvalue()


def image_feature_sources(tmp_path):
    """The same three rows as a parquet and an arrow file with images: List(Image()) and a video:
    List(Video()), as the hub writes them: an EXIF-rotated JPEG, junk bytes, a relative path with bytes None."""
    features = datasets.Features({"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "images": datasets.List(datasets.Image()), "videos": datasets.List(datasets.Video())})
    rows = {"problem": ["<image><video>Q?", "<image>Q?", "<image>Q?"], "answer": ["a", "b", "c"],
            "images": [[{"bytes": rotated_jpeg(), "path": None}], [{"bytes": b"junk", "path": None}],
                       [{"bytes": None, "path": "x.png"}]],
            "videos": [[{"bytes": clip(4, fps=2), "path": None}], [], []]}
    table = datasets.Dataset.from_dict(rows, features=features).data.table  # its schema carries the features
    pyarrow.parquet.write_table(table, tmp_path / "hub.parquet")  # datasets' writers would embed x.png's bytes
    with pyarrow.ipc.new_stream(tmp_path / "hub.arrow", table.schema) as stream:  # as save_to_disk writes
        stream.write_table(table)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "x.png").write_bytes(png(70, 50, (10, 200, 30)))
    return [tmp_path / "hub.parquet", tmp_path / "hub.arrow"]


def test_image_and_video_features_are_decoded_by_data_py_naming_the_row(tmp_path, toy, monkeypatch):
    """datasets decoded these when a row was read: a bare PIL error for the junk image (no file, no row, no
    skip_bad_rows), x.png looked for in the working directory (image_dir ignored), and a Video feature needs
    torchcodec. Now the rows hold {"bytes", "path"} and data.py decodes them: the same pixels as before."""
    monkeypatch.chdir(tmp_path)  # x.png is not in the working directory: only image_dir finds it
    cfg = config(image_dir=str(tmp_path / "img"))
    vl = builder(toy["vl_model"], cfg)
    for path in image_feature_sources(tmp_path):
        rows = data.load_rows(str(path), cfg)
        assert rows[1]["images"] == [{"bytes": b"junk", "path": None}], path
        first = vl.build(rows[0], 0, rows.where(0))
        # Stored 120x60, EXIF orientation 6: shown 60x120 (7200 px: in [3136, 12544], kept), red on top; the
        # pixels of the image datasets decoded before, and of PIL's own decoding.
        before = datasets.Image().decode_example({"bytes": rotated_jpeg(), "path": None})
        assert first["images"][0].size == (60, 120) and first["images"][0].getpixel((30, 0))[0] > 240
        assert first["images"][0].tobytes() == data.process_image(before, 3136, 12544).tobytes() == \
            data.process_image(Image.open(io.BytesIO(rotated_jpeg())), 3136, 12544).tobytes()
        assert first["videos"][0].shape == (4, 56, 56, 3)  # 4 frames at 2 fps: all 4 sampled, 56x56 kept
        third = vl.build(rows[2], 2, rows.where(2))  # img/x.png, 70x50 = 3500 px: in range, kept
        assert third["images"][0].size == (70, 50) and third["images"][0].getpixel((0, 0)) == (10, 200, 30)
        with pytest.raises(data.DataError, match=rf"{path.name} row 1: image 0 of column 'images' is unreadable"):
            data.check_rows(rows, vl)
        assert data.check_rows(rows, vl, skip_bad=True) == [0, 2]


@pytest.mark.parametrize("layout", ["parquet", "save_to_disk"])
def test_a_folder_with_one_subfolder_per_split(tmp_path, layout):
    """ds/train/data-00000-of-00001.parquet (the hub's layout) or DatasetDict.save_to_disk's ds/train/*.arrow: the
    split is matched against the folders under ds too; save_to_disk's own json files are no data."""
    splits = {"train": ROWS[:3], "test": ROWS[3:], "pretrain": ROWS[:1]}  # pretrain: not a word starting 'train'
    if layout == "parquet":
        for split, rows in splits.items():
            (tmp_path / "ds" / split).mkdir(parents=True)
            pd.DataFrame(rows).to_parquet(tmp_path / "ds" / split / "data-00000-of-00001.parquet")
    else:
        datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in splits.items()}).save_to_disk(
            str(tmp_path / "ds"))
    for split in ("train", "test"):
        rows = data.load_rows(f"{tmp_path / 'ds'}@{split}", config())
        assert [rows[i] for i in range(len(rows))] == splits[split], split
        assert rows.where(0).startswith(str(tmp_path / "ds" / split / "data-00000-of-00001."))


def test_a_file_belongs_to_the_split_its_own_name_says_before_its_folders(tmp_path):
    """fold/test_v2/train.parquet went into @train (its name) and @test (its folder): test rows trained on. The
    innermost part of the path naming a split decides: the file's name, else its nearest folder."""
    files = {"train.parquet": ROWS[:1], "test.parquet": ROWS[1:2], "test_v2/train.parquet": ROWS[2:3],
             "test_v2/data.parquet": ROWS[3:]}
    for name, rows in files.items():
        (tmp_path / "fold" / name).parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_parquet(tmp_path / "fold" / name)
    for split, want in (("train", ROWS[:1] + ROWS[2:3]), ("test", ROWS[1:2] + ROWS[3:])):
        rows = data.load_rows(f"{tmp_path / 'fold'}@{split}", config())
        assert sorted(map(str, (rows[i] for i in range(len(rows))))) == sorted(map(str, want)), split


def test_rows_over_several_files_name_each_files_own_row_and_count_items_of_non_null_cells():
    """Row 3 of a source of 3 + 2 rows is b.parquet's row 0 (what errors name); a column of nulls holds no video,
    one non-null cell makes images_per_prompt 1 (the rollout's limit per prompt)."""
    rows = data.Rows("src", [("a.parquet", datasets.Dataset.from_dict({"x": [1, 2, 3]})),
                             ("b.parquet", datasets.Dataset.from_dict({"x": [4, 5]}))])
    assert [rows.where(i) for i in (2, 3, 4)] == ["a.parquet row 2", "b.parquet row 0", "b.parquet row 1"]
    nulls = data.Rows("s", [("a", datasets.Dataset.from_dict({"videos": [None, None], "images": [None, "p"]}))])
    assert (nulls.most_items("videos"), nulls.most_items("images")) == (0, 1)
    large = pyarrow.table({"images": pyarrow.array([["a", "b", "c"], ["d"]], pyarrow.large_list(pyarrow.string()))})
    assert data.Rows("s", [("a", datasets.Dataset(large))]).most_items("images") == 3  # a large_list counts its items
    empty = pyarrow.table({"images": pyarrow.array([None, None], pyarrow.list_(pyarrow.string()))})  # a list type
    assert data.Rows("s", [("a", datasets.Dataset(empty))]).most_items("images") == 0  # of nulls only: no image
    assert not data._of_split("ScienceQAtrain.parquet", "train")  # a capital before the word: no word boundary


def test_settings_that_would_go_wrong_quietly_are_errors(toy, tmp_path):
    """min_pixels above max_pixels (images would be scaled up past max_pixels); a file without the answer column;
    a prompt over max_prompt_length given to PromptBuilder.build directly (the loader filters first); and
    override_chat_template reaching the tokenizer load_processor returns as well as the processor."""
    with pytest.raises(ValueError, match="min_pixels=12544 is larger than data.max_pixels=3136"):
        builder(toy["vl_model"], config(min_pixels=12544, max_pixels=3136))
    pd.DataFrame({"problem": ["Q?"], "solution": ["4"]}).to_parquet(tmp_path / "t.parquet")
    with pytest.raises(data.DataError, match=r"no column \['answer'\]"):
        data.load_rows(str(tmp_path / "t.parquet"), config())
    question = {"problem": "What is two plus two?", "answer": "4"}
    n = len(builder(toy["vl_model"], config()).build(question, 0, "r0")["prompt_ids"])  # one token over is refused
    with pytest.raises(data.DataError, match=f"is {n} tokens with images and videos expanded, more than "
                                             f"max_prompt_length={n - 1}"):
        builder(toy["vl_model"], config(max_prompt_length=n - 1)).build(question, 0, "r0")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    processor, tokenizer = data.load_processor(toy["vl_model"], config(override_chat_template=str(template)))
    assert processor.chat_template == tokenizer.chat_template == template.read_text()


def test_a_split_word_ends_at_a_non_letter_and_datasets_keywords_count(tmp_path, caplog):
    """MathVista's data/testmini-*.parquet is no test file (it was: a word starting with test); as datasets' split
    keywords, eval is test, training train, dev validation; the files taken are logged."""
    for name, rows in (("test-00000-of-00001", ROWS[:2]), ("testmini-00000-of-00001", ROWS[2:3]),
                       ("eval_2", ROWS[3:]), ("training", ROWS), ("dev", ROWS[:1]), ("devil_val", ROWS[1:2])):
        pd.DataFrame(rows).to_parquet(tmp_path / f"{name}.parquet")
    caplog.set_level("INFO", logger="data")
    taken = {split: [p.rsplit("/", 1)[1] for p, _ in data.load_rows(f"{tmp_path}@{split}", config()).parts]
             for split in ("test", "train", "validation", "testmini")}
    assert taken == {"test": ["eval_2.parquet", "test-00000-of-00001.parquet"], "train": ["training.parquet"],
                     "validation": ["dev.parquet", "devil_val.parquet"],
                     "testmini": ["testmini-00000-of-00001.parquet"]}
    assert f"{tmp_path}@test: 2 file(s): eval_2.parquet, test-00000-of-00001.parquet" in caplog.messages


def test_a_chat_template_json_gives_its_template_not_its_json_text(toy, tmp_path):
    """A model folder's chat_template.json as data.override_chat_template: its "chat_template" string is the template
    (the JSON text itself was rendered as one: every prompt in braces and quotes); any other .json is an error."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))
    processor, tokenizer = data.load_processor(toy["vl_model"], config(override_chat_template=str(
        tmp_path / "chat_template.json")))
    assert processor.chat_template == tokenizer.chat_template == template
    for text in ('{"template": "x"}', '{"chat_template": [1]}', "not json", "[]"):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(data.DataError, match=f"template={tmp_path / 'bad.json'}: a .json file needs"):
            data.load_processor(toy["vl_model"], config(override_chat_template=str(tmp_path / "bad.json")))


def test_grounding_tokens_may_be_written_in_a_prompt_chat_and_vision_tokens_not(toy):
    """Qwen2-VL's grounding prompts write <|object_ref_start|> ... <|box_end|>, special tokens of its tokenizer that
    no chat template writes: they were refused as forged turns. Chat, EOS, pad and vision tokens still are."""
    processor, _ = data.load_processor(toy["vl_model"], config())
    grounding = ["<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>"]
    tokenizer = processor.tokenizer  # extra special tokens, as Qwen2-VL's tokenizer has them
    tokenizer.add_special_tokens({"additional_special_tokens": tokenizer.all_special_tokens + grounding})
    built = data.PromptBuilder(config(), processor, toy["vl_model"])
    prompt = "Find <|object_ref_start|>the cat<|object_ref_end|> at <|box_start|>(1,2),(3,4)<|box_end|>"
    assert prompt in built.prompt_text({"problem": prompt, "answer": "a"}, "r0")[0]
    for token in ("<|im_start|>", "<|endoftext|>", "<|vision_end|>", "<|video_pad|>"):
        with pytest.raises(data.DataError, match=re.escape(f"r0: the prompt has ['{token}'] written in it")):
            built.prompt_text({"problem": f"Q {token}?", "answer": "a"}, "r0")


def test_images_in_a_column_the_keys_do_not_name_are_said(tmp_path, caplog):
    """A hub dataset's `image` column beside data.image_key=images (the default): the rows were text only, silently
    (as in EasyR1). Said now, naming the column; not when the keys name a column of the file, images or their paths
    (another is then unused by choice; paths beside an image column were said to leave the rows text only)."""
    image = {"bytes": png(56, 56), "path": None}
    datasets.Dataset.from_list([{**ROWS[0], "image": image}]).cast_column("image", datasets.Image()).to_parquet(
        tmp_path / "hub.parquet")
    pd.DataFrame([{**ROWS[0], "pics": [image]}]).to_parquet(tmp_path / "raw.parquet")
    pd.DataFrame([{**ROWS[0], "images": [image], "pics": [image]}]).to_parquet(tmp_path / "both.parquet")
    pd.DataFrame([{**ROWS[0], "images": ["a.png"], "pics": [image]}]).to_parquet(tmp_path / "paths.parquet")
    for name, said in (("hub", "['image']"), ("raw", "['pics']"), ("both", None), ("paths", None)):
        caplog.clear()
        data.load_rows(str(tmp_path / f"{name}.parquet"), config())
        assert [m for m in caplog.messages if "hold images" in m] == ([] if said is None else [
            f"{tmp_path / name}.parquet: column(s) {said} hold images or videos, but data.image_key='images' and "
            "video_key='videos' name none of them: rows are text only"])


def test_a_template_that_fails_is_a_data_error_not_a_jinja_traceback(tmp_path, toy):
    """A format_prompt that parses but fails on a row, an override with a syntax error, one that raises: each was a
    jinja2 traceback from the start-up check (inside transformers for the chat template), now a DataError."""
    row = {"problem": "What is 3 + 4?", "answer": "7"}
    (tmp_path / "f.jinja").write_text("{{ content.foo.bar }}")  # parses, and uses only `content`
    fmt = builder(toy["text_model"], config(format_prompt=str(tmp_path / "f.jinja")))
    with pytest.raises(data.DataError, match=r"r3: data.format_prompt \(.*f.jinja\) failed on this row: Undefined"):
        fmt.prompt_text(row, "r3")
    (tmp_path / "syntax.jinja").write_text("{% for m in messages %}{{ m.content }\n")
    (tmp_path / "raise.jinja").write_text("{{ raise_exception('no system message') }}")
    for model in ("text_model", "vl_model"):
        with pytest.raises(data.DataError, match=r"data.override_chat_template \(.*syntax.jinja\) line 1: unexpected"):
            builder(toy[model], config(override_chat_template=str(tmp_path / "syntax.jinja")))
        raising = builder(toy[model], config(override_chat_template=str(tmp_path / "raise.jinja")))
        with pytest.raises(data.DataError, match=r"r3: data.override_chat_template \(.*raise.jinja\) failed on this "
                           "row: TemplateError: no system message"):
            raising.prompt_text(row, "r3")
    pd.DataFrame([row] * 2).to_parquet(tmp_path / "rows.parquet")  # the start-up check names the row
    with pytest.raises(data.DataError, match=r"rows.parquet row 0: data.format_prompt .* failed on this row"):
        data.check_rows(data.load_rows(str(tmp_path / "rows.parquet"), fmt.cfg), fmt)


def test_a_missing_files_message_gives_only_the_hints_that_apply(tmp_path, toy, monkeypatch):
    """A missing image at an absolute path was told how relative paths are looked up (data.image_dir); a data file
    that is nowhere, looked for from the project's folder, named that folder twice."""
    row = {"problem": "<image>Q?", "answer": "a", "images": [{"bytes": None, "path": str(tmp_path / "x.png")}]}
    with pytest.raises(data.DataError, match=r"row 0: image 0 .* FileNotFoundError: .*x\.png'$"):
        builder(toy["vl_model"]).build(row, 0, "row 0")
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: (_ for _ in ()).throw(ConnectionError()))
    monkeypatch.chdir(data.HERE)
    with pytest.raises(data.DataError, match=rf"\(looked in {re.escape(data.HERE)}\) nor loadable from the hub"):
        data.load_rows("no/such_set@train", config())


def test_an_empty_json_list_with_whitespace_inside_has_no_rows(tmp_path):
    """'[\\n]' or '[ ]' is as empty as '[]': said so, naming the file, not datasets' 'corresponds to no data'."""
    (tmp_path / "spaced.json").write_text("[\n]\n")
    with pytest.raises(data.DataError, match=rf"{tmp_path / 'spaced.json'} has no rows$"):
        data.load_rows(str(tmp_path / "spaced.json"), config())
