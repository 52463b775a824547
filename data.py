"""data.py: from a dataset on disk or on the hub to model-ready prompts, images and videos included.

    processor, tokenizer = load_processor(tokenizer_path, cfg.data)
    train = PromptLoader(cfg.data.train_files, cfg.data, processor, model_path, batch_size=512, shuffle=True,
                         drop_last=True, prefetch=True)
    batch = next(train)              # a list of prompt dicts, forever; train.current_epoch, train.batches_per_epoch
    for batch in val.epoch(): ...    # one whole epoch in order, the position unmoved (validation)
    state = train.state_dict()       # ints and bools; train.load_state_dict(state) resumes exactly there

Pieces, usable alone: load_rows, check_rows, PromptBuilder (.build -> prompt, .measure -> length),
process_image, process_video. Bad input raises DataError (a ValueError) that names the file and row.

The prompt dict (one per row; read by rollout.py, trainer.py, actor.py), built lazily per batch, ragged:
    uid                 str         f"{epoch}-{index}": unique within one loader (trainer.py renames training ones)
    index               int         row number in the source (over all its files, before filtering)
    prompt_ids          list[int]   chat-templated prompt, image and video placeholders EXPANDED (for the actor)
    raw_prompt_ids      list[int]   the same UNexpanded: one <|image_pad|> / <|video_pad|> each (for vLLM)
    prompt_text         str         the chat-templated prompt text (unexpanded)
    images              list[PIL.Image]  the resized RGB images, in order ([] for text-only rows)
    videos              list[ndarray]    each video's sampled, resized frames, uint8 [T, H, W, 3], in order
    video_metadata      list[dict]  per video: the source's fps, duration, total_num_frames, frames_indices,
                                    video_backend (for Qwen3-VL's timestamps, Qwen2.5-VL's seconds per patch)
    multi_modal_inputs  dict        the processor's tensors for exactly these images and videos: pixel_values
                                    [patches, dim], image_grid_thw [n_images, 3], pixel_values_videos
                                    [patches, dim], video_grid_thw [n_videos, 3] (those present); {} for text;
                                    pixel values fp32, or the loader's pixel_dtype
    position_ids        LongTensor  [4, P] for Qwen2/2.5/3-VL (row 0 = 0..P-1, rows 1-3 = the model's own
                                    get_rope_index, re-based by trained_positions), [1, P] for text models
    ground_truth        str         the answer column as written (CSV: the cell's text; parquet or json numbers: a
                                    whole float as an integer; a list or dict as it is)
    extra               dict        the row's other columns, untouched
The same decoded pixels go to the rollout engine and, through the processor, to the actor.

Reads cfg.data (config.py's DataConfig; keys documented in configs/geo3k.yaml). Relative paths (sources,
templates) are tried from the working directory, then from this file's folder.
"""

import atexit
import bisect
import collections.abc
import concurrent.futures
import contextlib
import copy
import dataclasses
import io
import itertools
import json
import logging
import math
import multiprocessing
import os
import re
import threading

import datasets
import jinja2
import jinja2.meta
import numpy
import pandas
import pyarrow.compute
import pyarrow.parquet
import torch
from PIL import Image, ImageOps
from transformers import AutoConfig, AutoModel, AutoProcessor, AutoTokenizer

logger = logging.getLogger(__name__)
HERE = os.path.dirname(os.path.abspath(__file__))
FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),  # datasets'
               "test": ("test", "testing", "eval", "evaluation")}  # split keywords: a folder's files by their words
MM_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")  # the actor's inputs
_MEASURING = None  # (rows, builder) while check_rows measures: its forked workers inherit it
_EXITING = threading.Event()  # set at exit: a prefetch stops after its row (_stop_prefetching)


class DataError(ValueError):
    """Bad input data; the message names the file and row and says what to change."""


def load_processor(tokenizer_path, cfg, trust_remote_code=False):
    """(processor, tokenizer): a vision model's AutoProcessor, or for a text model the tokenizer as both.
    cfg.override_chat_template, when set, replaces both chat templates: both lay out a prompt alike."""
    config = AutoConfig.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    auto = AutoProcessor if getattr(config, "vision_config", None) is not None else AutoTokenizer
    processor = auto.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    tokenizer = getattr(processor, "tokenizer", processor)
    if path := cfg.override_chat_template:  # a .jinja file, or a model's chat_template.json: {"chat_template": ...}
        text = _read_text(path, "data.override_chat_template")
        if path.endswith(".json"):
            try:
                text = json.loads(text)["chat_template"] + ""  # a string, not the JSON text rendered as a template
            except (ValueError, TypeError, KeyError):
                raise DataError(f"data.override_chat_template={path}: a .json file needs a \"chat_template\" string")
        processor.chat_template = tokenizer.chat_template = text
        try:  # else compiled at the first row: a jinja2 traceback from inside transformers; said now, with its line
            tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"data.override_chat_template ({path}) line {e.lineno}: {e.message}") from None
        except Exception:  # one that wants other messages: the rows' check names the row it fails on
            pass
    if getattr(processor, "chat_template", None) is None:  # transformers' error would come at the first row
        raise DataError(f"{tokenizer_path} has no chat template (a base model?): set data.override_chat_template "
                        "to a Jinja file that lays out the system and user messages and the generation prompt")
    return processor, tokenizer


class PromptLoader(collections.abc.Iterator):
    """Batches of prompt dicts from a source, forever, its rows loaded and checked at start-up (load_rows, check_rows).
    A batch's prompts are built when it is asked for or, with `prefetch`, in a daemon thread while the previous batch
    trains (with the loader's own copy of the processor: no tokenizer shared). Epoch e visits the kept rows in the
    order torch.randperm(n, generator seeded seed * 1_000_003 + e) (file order without shuffle), cut into batches of
    `batch_size` (-1: all rows); drop_last drops the short tail. state_dict() saves the position (current_epoch,
    batch): a resumed loader yields the batches an uninterrupted one would. `pixel_dtype`: the dtype of the prompts'
    multi_modal_inputs float tensors (None: the processor's fp32), cast as each prompt is built."""

    def __init__(self, files, cfg, processor, model, *, batch_size, shuffle, drop_last, trust_remote_code=False,
                 prefetch=False, pixel_dtype=None):
        processor = copy.deepcopy(processor) if prefetch else processor
        self.builder = PromptBuilder(cfg, processor, model, trust_remote_code)
        self.rows = load_rows(files, cfg)
        self.indices = check_rows(self.rows, self.builder, cfg.filter_overlong_prompts_workers, cfg.skip_bad_rows)
        self.videos_per_prompt = self.rows.most_items(cfg.video_key)  # for the rollout engine's limits
        self.images_per_prompt = self.rows.most_items(cfg.image_key)
        self.batch_size = len(self.indices) if batch_size == -1 else batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, cfg.seed, drop_last
        self.batches_per_epoch = (math.floor if drop_last else math.ceil)(len(self.indices) / self.batch_size)
        self.current_epoch, self.batch = 0, 0  # the position of the next batch
        if self.batches_per_epoch == 0:
            raise DataError(f"{files}: {len(self.indices)} rows, fewer than one batch of {batch_size}")
        self.prefetch, self.pending, self.lock = prefetch, None, threading.Lock()  # pending: ((epoch, batch), future)
        self.pixel_dtype = pixel_dtype

    def __next__(self):
        position, (built, future) = (self.current_epoch, self.batch), self.pending or (None, None)
        self.pending = None
        batch = future.result() if built == position else self._make_batch(*position)  # a build's error raises here
        self.batch = (self.batch + 1) % self.batches_per_epoch
        self.current_epoch += self.batch == 0
        if self.prefetch:  # the next batch, built while this one trains; a daemon thread: exit waits for a row at most
            self.pending = ((self.current_epoch, self.batch), concurrent.futures.Future())
            threading.Thread(target=self._build_into, args=self.pending, name="prefetch", daemon=True).start()
        return batch

    def epoch(self):
        """The batches of one whole epoch (the current one), without moving the position: validation."""
        return (self._make_batch(self.current_epoch, b) for b in range(self.batches_per_epoch))

    def state_dict(self):
        return {"epoch": self.current_epoch, "batch": self.batch, "num_rows": len(self.indices),
                "batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last}

    def load_state_dict(self, state):
        now = self.state_dict()
        for key in ("num_rows", "batch_size", "shuffle", "seed", "drop_last"):
            if state.get(key, now[key]) != now[key]:  # drop_last: states of older versions lack it
                raise ValueError(f"{self.rows.name}: the loader state was saved with {key}={state[key]}, now it is "
                                 f"{now[key]}; resuming continues the same order only with the same data and config")
        self.current_epoch, self.batch = state["epoch"], state["batch"]  # a prefetched batch of elsewhere is unused

    def _build_into(self, position, future):  # the prefetch thread's work
        try:
            future.set_result(self._make_batch(*position))
        except BaseException as e:
            future.set_exception(e)

    def _make_batch(self, epoch, b):
        order = self.indices
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = [self.indices[k] for k in torch.randperm(len(order), generator=generator).tolist()]
        batch = []
        with self.lock:  # one build at a time: the background thread's and a caller's (epoch(), a resumed loader)
            for i in order[b * self.batch_size:(b + 1) * self.batch_size]:
                if _EXITING.is_set():
                    raise RuntimeError("the interpreter is exiting")
                prompt = self.builder.build(self.rows[i], i, self.rows.where(i))
                if self.pixel_dtype is not None:
                    prompt["multi_modal_inputs"] = {k: v.to(self.pixel_dtype) if v.is_floating_point() else v
                                                    for k, v in prompt["multi_modal_inputs"].items()}
                batch.append({**prompt, "uid": f"{epoch}-{i}"})
        return batch


@atexit.register
def _stop_prefetching():
    """At exit, before daemon threads are stopped: a prefetch ends after the row it builds (or within 5 s). A daemon
    thread inside torch when the interpreter ends aborts it ('terminate called without an active exception')."""
    _EXITING.set()
    for thread in threading.enumerate():
        if thread.name == "prefetch":
            thread.join(timeout=5)


def check_rows(rows, builder, workers=1, skip_bad=False):
    """Indices of the rows to train on, every row measured at start-up by `workers` processes, its images and
    videos decoded, so a bad row fails here, not mid-run (where it would fail again after every resume):
      - a bad row (unreadable image or video, no or empty answer, empty prompt, placeholder count mismatch, a chat,
        EOS, pad or vision token written in it): DataError naming the file and row, or with skip_bad skipped, counted;
      - a row longer than max_prompt_length: dropped and counted with filter_overlong_prompts, else a bad row."""
    global _MEASURING
    cfg, limit, _MEASURING = builder.cfg, builder.cfg.max_prompt_length, (rows, builder)
    workers = max(1, min(workers, len(rows)))
    try:  # per row: its length, or the error message of a bad row
        if workers == 1:
            lengths = [_measure_row(i) for i in range(len(rows))]
        else:  # only indices and results are pickled; a worker that dies raises BrokenProcessPool (a Pool would hang)
            with concurrent.futures.ProcessPoolExecutor(workers, multiprocessing.get_context("fork"),
                                                        torch.set_num_threads, (1,)) as pool:
                lengths = list(pool.map(_measure_row, range(len(rows)), chunksize=-(-len(rows) // (4 * workers))))
    finally:
        _MEASURING = None
    if not cfg.filter_overlong_prompts:  # an overlong row is then a bad row
        lengths = [n if isinstance(n, str) or n <= limit else _overlong(rows.where(i), n, limit)
                   for i, n in enumerate(lengths)]
    bad = [i for i, n in enumerate(lengths) if isinstance(n, str)]
    kept = [i for i, n in enumerate(lengths) if not isinstance(n, str) and n <= limit]
    overlong = [i for i, n in enumerate(lengths) if not isinstance(n, str) and n > limit]
    if bad and not skip_bad:
        raise DataError(f"{lengths[bad[0]]} (set data.skip_bad_rows: true to skip such rows)")
    if bad:
        logger.warning(f"{rows.name}: skipped {len(bad)} of {len(rows)} rows as bad (data.skip_bad_rows); the first: "
                       + " | ".join(lengths[i] for i in bad[:3]))
    if cfg.filter_overlong_prompts:
        first = ", ".join(f"{rows.where(i)} ({lengths[i]})" for i in overlong[:3])
        (logger.warning if overlong else logger.info)(
            f"{rows.name}: dropped {len(overlong)} of {len(rows) - len(bad)} rows as longer than max_prompt_length="
            f"{limit} tokens (image and video tokens included)"
            f"{f'; the first: {first}; raise max_prompt_length or lower max_pixels to keep them' if overlong else ''}")
    if not kept:
        raise DataError(f"{rows.name}: no row left: {len(overlong)} longer than max_prompt_length={limit}, "
                        f"{len(bad)} bad")
    return kept


def _measure_row(i):
    rows, builder = _MEASURING
    try:
        return builder.measure(rows[i], rows.where(i))
    except DataError as e:
        return str(e)


def _overlong(where, length, limit):
    return (f"{where}: the prompt is {length} tokens with images and videos expanded, more than max_prompt_length="
            f"{limit}; set filter_overlong_prompts: true to drop them, or raise max_prompt_length / lower max_pixels")


class PromptBuilder:
    """One row -> one prompt dict. Holds the processor (the tokenizer for text models), the format template
    and, for Qwen-VL models, a weightless copy of the model whose get_rope_index gives the mrope rows. `model`: its
    folder or hub id, or its loaded config (trainer.py's, with model.override_config applied as vLLM applies it)."""

    def __init__(self, cfg, processor, model, trust_remote_code=False):
        if cfg.min_pixels > cfg.max_pixels:
            raise ValueError(f"data.min_pixels={cfg.min_pixels} is larger than data.max_pixels={cfg.max_pixels}")
        self.cfg, self.processor, self.tokenizer = cfg, processor, getattr(processor, "tokenizer", processor)
        self.image_processor, self.rope_model, self.video_span = getattr(processor, "image_processor", None), None, None
        if self.image_processor is not None:
            # on the meta device: get_rope_index reads only the config, so positions are the model's own per family
            config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code) \
                if isinstance(model, (str, os.PathLike)) else model
            with torch.device("meta"):
                self.rope_model = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
            if not hasattr(self.rope_model, "get_rope_index"):
                raise ValueError(f"{type(self.rope_model).__name__} has no get_rope_index: data.py builds "
                                 "position ids for Qwen2-VL, Qwen2.5-VL, Qwen3-VL and text models only")
            # Qwen3-VL's processor puts each temporal patch in its own <|vision_start|> ... <|vision_end|> after its
            # timestamp; the chat template's pair around <|video_pad|> is dropped, as vLLM does (the model never saw it)
            self.video_span = (f"{processor.vision_start_token}{processor.video_token}{processor.vision_end_token}"
                               if config.model_type in ("qwen3_vl", "qwen3_vl_moe") else None)
        if cfg.format_prompt:  # checked: a mistyped `{{ question }}` would silently render '' for every row
            env = jinja2.Environment(undefined=jinja2.StrictUndefined)
            try:
                ast = env.parse(_read_text(cfg.format_prompt, "data.format_prompt").strip())
            except jinja2.TemplateSyntaxError as e:
                raise DataError(f"data.format_prompt ({cfg.format_prompt}) line {e.lineno}: {e.message}") from None
            if (names := jinja2.meta.find_undeclared_variables(ast)) != {"content"}:
                raise DataError(f"data.format_prompt ({cfg.format_prompt}) must use {{{{ content }}}}, the row's "
                                f"prompt, and no other variable; it uses {sorted(names)}")
        self.template = cfg.format_prompt and env.from_string(ast)
        own = {self.tokenizer.eos_token, self.tokenizer.pad_token, getattr(processor, "image_token", None),
               getattr(processor, "video_token", None)}  # these and the chat template's are never in a prompt
        self.special_tokens = [t for t in self.tokenizer.all_special_tokens  # (Qwen2-VL's <|box_start|> may be)
                               if t in own or t in str(processor.chat_template)]

    def build(self, row, index, where):
        """The prompt dict (keys at the top of the module). `where` ("file row j") goes into errors."""
        cfg = self.cfg
        text, raw_ids, out, images, frames, metadata = self.encode(row, where)
        ids = out["input_ids"][0]  # [P]
        if len(ids) > cfg.max_prompt_length:
            raise DataError(_overlong(where, len(ids), cfg.max_prompt_length))
        position_ids = torch.arange(len(ids)).unsqueeze(0)  # [1, P]
        if self.rope_model is not None:
            mrope, _ = self.rope_model.get_rope_index(  # mm_token_type_ids: text 0, image 1, video 2
                input_ids=ids.unsqueeze(0), mm_token_type_ids=out["mm_token_type_ids"],
                image_grid_thw=out.get("image_grid_thw"), video_grid_thw=out.get("video_grid_thw"),
                second_per_grid_ts=out.get("second_per_grid_ts"),  # Qwen2.5-VL: temporal patch / sampled fps
                attention_mask=torch.ones_like(ids).unsqueeze(0))  # [3, 1, P]
            mrope = trained_positions(mrope[:, 0], out["mm_token_type_ids"][0])  # [3, P]
            position_ids = torch.cat([position_ids, mrope.to(position_ids.dtype)])  # [4, P]
        skip, answer = {cfg.prompt_key, cfg.answer_key, cfg.image_key, cfg.video_key}, row[cfg.answer_key]
        # '7', not '7.0': type inference makes an integer column float (jsonl's 3 beside 2.5; CSV answers are text)
        if not isinstance(answer, (list, dict)):  # a list or dict as it is, as in EasyR1
            answer = str(int(answer) if isinstance(answer, float) and answer.is_integer() else answer)
        return {"uid": f"0-{index}", "index": index, "prompt_ids": ids.tolist(), "raw_prompt_ids": raw_ids,
                "prompt_text": text, "images": images, "videos": frames, "video_metadata": metadata,
                "multi_modal_inputs": {k: out[k] for k in MM_KEYS if k in out}, "position_ids": position_ids,
                "ground_truth": answer, "extra": {k: v for k, v in row.items() if k not in skip}}

    def encode(self, row, where):
        """(text, raw_ids, the processor's output, resized images, each video's frames, their metadata)."""
        cfg = self.cfg
        text, raw_images, raw_videos = self.prompt_text(row, where)
        images = self.decode(where, "image", raw_images, process_image, cfg.min_pixels, cfg.max_pixels, cfg.image_dir)
        ip = self.image_processor  # video frames are bounded in merged patches of patch_size x merge_size pixels
        videos = self.decode(where, "video", raw_videos, process_video, cfg.min_pixels, cfg.max_pixels, cfg.video_fps,
                             cfg.image_dir, ip and ip.patch_size * ip.merge_size)
        frames, metadata = [f for f, _ in videos], [m for _, m in videos]
        raw_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.image_processor is None:
            return text, raw_ids, {"input_ids": torch.tensor([raw_ids])}, images, frames, metadata
        # Frames are sampled already: the processor must not sample again (Qwen3-VL's would), and reads the
        # metadata for Qwen3-VL's timestamps and Qwen2.5-VL's seconds per temporal patch.
        video_kwargs = {"videos": frames, "do_sample_frames": False, "video_metadata": metadata} if videos else {}
        text_in = text.replace(self.video_span, self.processor.video_token) if videos and self.video_span else text
        try:
            out = self.processor(text=[text_in], images=images or None, add_special_tokens=False, return_tensors="pt",
                                 **video_kwargs)
        except Exception as e:
            raise DataError(f"{where}: the processor failed on this row: {e!r}") from e
        return text, raw_ids, out, images, frames, metadata

    def decode(self, where, kind, items, fn, *args):
        """[fn(item, *args) for each item]; an item that fails is a DataError naming the row, item and column."""
        out = []
        for k, item in enumerate(items):
            try:
                out.append(fn(item, *args))
            except Exception as e:
                path = item.get("path") if isinstance(item, dict) else item  # an absolute one: no lookup to explain
                relative = isinstance(e, FileNotFoundError) and isinstance(path, str) and not os.path.isabs(path)
                hint = (f" (a relative path is looked up under data.image_dir={self.cfg.image_dir!r}; null: the "
                        f"working directory {os.getcwd()})" if relative else "")
                raise DataError(f"{where}: {kind} {k} of column '{getattr(self.cfg, kind + '_key')}' is unreadable: "
                                f"{type(e).__name__}: {e}{hint}") from e  # str: a missing file's path too
        return out

    def measure(self, row, where):
        """The length build() will give, checking the row on the way (a truncated image fails here): the unexpanded
        text's tokens plus, per image, its tokens less the one placeholder, from the image processor's
        get_number_of_image_patches at process_image's size (no resize, no processor call)."""
        text, images, videos = self.prompt_text(row, where)
        if videos:  # a video's tokens depend on its decoded frames (and Qwen3-VL's timestamps): encoded whole
            return len(self.encode(row, where)[2]["input_ids"][0])
        n = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        for k, image in enumerate(self.decode(where, "image", images, _open_image, self.cfg.image_dir)):
            width, height = _target_size(*image.size, self.cfg.min_pixels, self.cfg.max_pixels)
            try:  # the processor's resize refuses some shapes (an aspect ratio over 200)
                patches = self.image_processor.get_number_of_image_patches(height, width, {})
            except ValueError as e:
                raise DataError(f"{where}: image {k} ({image.width}x{image.height}) cannot be processed: {e}") from e
            n += patches // self.image_processor.merge_size ** 2 - 1
        return n

    def prompt_text(self, row, where):
        """(chat-templated text with one placeholder per image and video, the row's images, its videos; unopened),
        checking the prompt, answer and placeholders. The prompt goes through the format template (`content`), then
        `<image>` and `<video>` marks split it into parts in order; an optional system message comes first."""
        cfg = self.cfg
        content = row.get(cfg.prompt_key)
        if not isinstance(content, str) or not content.strip():
            raise DataError(f"{where}: no prompt text in column '{cfg.prompt_key}' ({content!r}; a string is needed)")
        answer = row.get(cfg.answer_key)  # the reward compares with it: None, NaN, blank, [], () or {} is no answer
        if answer is None or isinstance(answer, float) and math.isnan(answer) or not str(answer).strip() \
                or isinstance(answer, (list, tuple, dict)) and not answer:
            raise DataError(f"{where}: no answer in column '{cfg.answer_key}' ({answer!r})")
        if self.template:
            try:  # a runtime error of the template ({{ content.foo.bar }} with StrictUndefined): this row's
                content = self.template.render(content=content)
            except jinja2.TemplateError as e:
                raise DataError(f"{where}: data.format_prompt ({cfg.format_prompt}) failed on this row: "
                                f"{type(e).__name__}: {e}") from None
        if found := [token for token in self.special_tokens if token in content]:  # a vision token miscounts images
            raise DataError(f"{where}: the prompt has {sorted(found)} written in it, the model's own tokens (is it "
                            "already chat-templated?); remove them, marking images and videos <image> and <video>")
        images, videos = _as_list(row.get(cfg.image_key)), _as_list(row.get(cfg.video_key))
        for kind, key, items in (("image", cfg.image_key, images), ("video", cfg.video_key, videos)):
            if content.count(f"<{kind}>") != len(items):
                column = f"column '{key}'" + ("" if key in row else " (none such)")
                raise DataError(f"{where}: {len(items)} {kind}(s) in {column} but {content.count(f'<{kind}>')} "
                                f"<{kind}> placeholder(s) in the prompt; put one <{kind}> where each {kind} goes")
            if items and self.image_processor is None:
                raise DataError(f"{where}: the row has {kind}s but the model is text-only (no image processor)")
        if images or videos:  # [{"type": "image"}, {"type": "text", "text": ...}, {"type": "video"}, ...]
            content = [{"type": piece[1:-1]} if piece in ("<image>", "<video>") else {"type": "text", "text": piece}
                       for piece in re.split(r"(<image>|<video>)", content) if piece]
        messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        messages.append({"role": "user", "content": content})
        try:  # the chat template's own raise_exception, or an undefined name in an override
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError as e:
            source = (f"data.override_chat_template ({cfg.override_chat_template})" if cfg.override_chat_template
                      else "the model's chat template")
            raise DataError(f"{where}: {source} failed on this row: {type(e).__name__}: {e}") from None
        for kind, items in (("image", images), ("video", videos)) if self.image_processor is not None else ():
            if (n := text.count(token := getattr(self.processor, f"{kind}_token"))) != len(items):
                raise DataError(f"{where}: the chat template gave {n} {token} for {len(items)} {kind}(s): "
                                "data.override_chat_template or data.system_prompt must keep one per image and video")
        return text, images, videos


def trained_positions(mrope, types):
    """The mrope rows as Qwen2-VL and Qwen2.5-VL were trained (and as vLLM computes them): each run of text, image
    or video tokens starts one past the largest position before it, keeping its own (t, h, w) offsets (transformers
    >= 5.3 starts text after a video inside the video's time positions: huggingface/transformers#45381).
    mrope [3, P]; types [P]: 0 text, 1 image, 2 video. Qwen3-VL (one time step per block) is unchanged."""
    out, start, bounds = torch.empty_like(mrope), 0, [0] + (torch.diff(types).nonzero()[:, 0] + 1).tolist()
    for a, b in zip(bounds, bounds[1:] + [len(types)]):
        out[:, a:b] = mrope[:, a:b] - mrope[:, a:a + 1] + start  # the run's offsets from its first token
        start = int(out[:, a:b].max()) + 1
    return out


def process_image(image, min_pixels, max_pixels, image_dir=None):
    """An RGB PIL image resized by _target_size to at most max_pixels and at least min_pixels, aspect ratio kept.

    `image`: a PIL image, {"bytes": ...} / {"path": ...} (HF parquet), bytes, or a path (relative: joined to
    image_dir). Made RGB as a viewer shows it: transparency over white (as transformers and vLLM do), 16-bit grey
    v -> v // 257 (PIL would clip at 255), as is a 32-bit "I" image with values over 255 (PIL opens 16-bit PGM so);
    a 32-bit float image in [0, 1] (torchvision's and matplotlib's range) x 255, any other taken as 0..255 levels."""
    image = _open_image(image, image_dir)
    if image.mode == "F":  # 32-bit float: PIL's convert clips it to 0..255, so [0, 1] images came out black
        values = numpy.nan_to_num(numpy.asarray(image))
        image = Image.fromarray((values * (255 if values.max() <= 1 else 1)).round().clip(0, 255).astype(numpy.uint8))
    if image.mode.startswith("I;16") or image.mode == "I" and image.getextrema()[1] > 255:
        image = Image.fromarray((numpy.asarray(image).clip(0, 65535) // 257).astype(numpy.uint8))
    if image.has_transparency_data:  # RGBA, LA, PA, or a palette's / RGB's transparent colour
        image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA"))
    image = image.convert("RGB") if image.mode != "RGB" else image
    return image.resize(_target_size(image.width, image.height, min_pixels, max_pixels))  # same size: PIL copies


def process_video(video, min_pixels, max_pixels, fps, image_dir=None, factor=28):
    """(frames uint8 [T, H, W, 3] RGB, metadata as in the prompt dict): the video decoded with PyAV, sampled at
    `fps` frames per second (sample_frame_indices), each frame resized as process_image resizes an image, but
    within qwen-vl-utils' per-frame bound (EasyR1's reader), for T frames kept and merged patches of f x f pixels
    (`factor`: 28 for Qwen2/2.5-VL, 32 for Qwen3-VL): 768 patches, fewer for a long video, at least 1.05 min_pixels:
        max_pixels <- min(max_pixels, max(min(768 f^2, 0.9 x 128000 f^2 x 2 / T), int(1.05 min_pixels)))
    `video`: a path (relative: joined to image_dir), bytes, or {"bytes": ...} / {"path": ...}. A file whose
    frames do not all decode (truncated, corrupt) raises. Or a list of frames (each as process_image takes an
    image), read as qwen-vl-utils reads one: every frame, the last repeated to an even count, at `fps`."""
    import av  # PyAV, only for video rows

    def bound(count):  # the per-frame max_pixels for `count` frames (above)
        return min(max_pixels, max(min(768 * factor**2, 0.9 * 128000 * factor**2 * 2 / count), int(1.05 * min_pixels)))

    if isinstance(video, (list, tuple, numpy.ndarray)):
        if not len(video):
            raise ValueError("an empty list of frames")
        cap = bound(len(video) + len(video) % 2)
        frames = [numpy.asarray(process_image(frame, min_pixels, cap, image_dir)) for frame in video]
        frames += frames[-1:] * (len(frames) % 2)
        sizes = [f"{f.shape[1]}x{f.shape[0]}" for f in frames]
        if odd := next((i for i, size in enumerate(sizes) if size != sizes[0]), None):
            raise ValueError(f"frame {odd} is {sizes[odd]} after resizing, frame 0 {sizes[0]}: one size for a video")
        return numpy.stack(frames), {"fps": fps, "duration": len(frames) / fps, "total_num_frames": len(frames),
                                     "frames_indices": list(range(len(frames))), "video_backend": "frames"}
    with av.open(_source(video, image_dir)) as container:
        if not container.streams.video:
            raise ValueError(f"no video stream in the file, only {[s.type for s in container.streams]}")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        if total < 1 or rate <= 0:
            raise ValueError(f"no frames or no frame rate in the video stream ({total} frames at {rate} fps)")
        indices = sample_frame_indices(total, rate, fps)
        wanted, frames, decoded, cap = set(indices), [], 0, bound(len(indices))
        container.seek(0)
        for i, frame in enumerate(itertools.islice(container.decode(stream), indices[-1] + 1)):
            if i in wanted:
                frames.append(numpy.asarray(process_image(frame.to_image(), min_pixels, cap)))
            decoded = i + 1
    if len(frames) < len(indices):
        raise ValueError(f"only {decoded} of the {total} frames its container lists decode: truncated or corrupt")
    return numpy.stack(frames), {"fps": rate, "duration": total / rate, "total_num_frames": total,  # [T, H, W, 3]
                                 "frames_indices": indices, "video_backend": "pyav"}


def sample_frame_indices(total, rate, fps):
    """Which of `total` frames at `rate` fps to keep for `fps` sampled frames per second, as qwen-vl-utils
    (EasyR1's video reader) picks them:
        T = total / rate * fps, clamped to [min(4, total), min(768, total)], rounded down to an even count
            (the temporal patch of 2 frames), at least 1;
        indices = round(linspace(0, total - 1, T)).
    The sampled rate the model sees is T / total * rate."""
    count = max(1, int(min(max(total / rate * fps, min(4, total)), min(768, total))) // 2 * 2)
    return torch.linspace(0, total - 1, count).round().long().tolist()


def _target_size(width, height, min_pixels, max_pixels):
    """(width, height) scaled by s = sqrt(max_pixels / (w h)) with sides rounded down, or by s = sqrt(min_pixels /
    (w h)) with sides rounded up, so each bound holds (an upscale may pass max_pixels when the two are closer than a
    side's rounding); a size in range is kept."""
    if width * height > max_pixels:
        s = math.sqrt(max_pixels / (width * height))
        return max(1, int(width * s)), max(1, int(height * s))
    if width * height < min_pixels:
        s = math.sqrt(min_pixels / (width * height))
        return math.ceil(width * s), math.ceil(height * s)
    return width, height


def _open_image(image, image_dir):
    """A decoded PIL image from any accepted form, turned upright by its EXIF orientation as a viewer (and datasets'
    Image feature) shows it; a truncated body fails here; a file is closed once read (exif_transpose copies)."""
    if isinstance(image, Image.Image):
        return ImageOps.exif_transpose(image)
    with Image.open(_source(image, image_dir, "an image")) as opened:
        return ImageOps.exif_transpose(opened)


def _source(item, image_dir, what="a video"):
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    if isinstance(item, (bytes, bytearray)):
        return io.BytesIO(item)
    if isinstance(item, str) and item:
        return os.path.join(image_dir, item) if image_dir else item
    kinds = "a PIL image, {'bytes': ...}, bytes or a path" if what == "an image" else "{'bytes': ...}, bytes or a path"
    raise TypeError(f"{what} must be {kinds}, not {type(item).__name__}")


class Rows:
    """A source's rows as plain dicts: rows[i], len(rows), rows.where(i) = "<file> row <j>" for errors."""

    def __init__(self, name, parts):
        self.name, self.parts = name, parts  # parts: [(file or hub id, datasets.Dataset)]
        self.starts = [0, *itertools.accumulate(len(part) for _, part in parts)]  # part k: starts[k] <= i < starts[k+1]

    def __len__(self):
        return self.starts[-1]

    def __getitem__(self, i):
        k = bisect.bisect_right(self.starts, i) - 1
        return self.parts[k][1][i - self.starts[k]]

    def where(self, i):
        k = bisect.bisect_right(self.starts, i) - 1
        return f"{self.parts[k][0]} row {i - self.starts[k]}"

    def most_items(self, key):
        """The most items in column `key` of one row (0 where no file has it), read from Arrow, nothing decoded."""
        most = 0
        for column in [part.data.column(key) for _, part in self.parts if key in part.column_names]:
            if pyarrow.types.is_list(column.type) or pyarrow.types.is_large_list(column.type):
                most = max(most, pyarrow.compute.max(pyarrow.compute.list_value_length(column)).as_py() or 0)
            else:  # one item per row
                most = max(most, int(column.null_count < len(column)))
        return most


def load_rows(spec, cfg):
    """Rows of `spec`, one of:
      - a local .parquet/.json/.jsonl/.csv/.arrow file (its one split is train, as datasets names it: `file@train`);
      - a local folder, `folder@split`: every such file under it with a word of its name or of a folder under `folder`
        that names split (default train; datasets' keywords: training is train, eval test, dev validation): `train`
        takes geo_train.parquet, training-0.jsonl and train/data-0.arrow, not pretrain_test.parquet (nor save_to_disk's
        dataset_info.json, state.json), `test` not testmini.parquet;
      - a hub dataset, `name@split`, through datasets.load_dataset (split default train).
    The prompt and answer columns must exist in every file."""
    if not spec:
        raise DataError("no data source: set data.train_files and data.val_files")
    path, split = spec, None
    if "@" in spec and "/" not in spec.rpartition("@")[2] and _local_path(spec) is None:  # a@b.parquet is a file
        path, split = spec.rsplit("@", 1)
    local = _local_path(path)
    if local is None:
        try:
            parts = [(f"{path}@{split or 'train'}", datasets.load_dataset(path, split=split or "train"))]
        except Exception as e:
            where = " and ".join(dict.fromkeys([os.getcwd(), HERE]))  # one folder when run from beside data.py
            raise DataError(f"'{spec}' is neither a local file or folder (looked in {where}) "
                            f"nor loadable from the hub: {e!r}") from e
    elif os.path.isfile(local):
        if split not in (None, "train"):
            raise DataError(f"'{spec}': a file has one split, train; drop '@{split}' or point at the folder")
        parts = [(local, _read_file(local, (cfg.prompt_key, cfg.answer_key)))]
        if parts[0][1] is None:
            raise DataError(f"{local} has no rows")
    else:
        split = split or "train"
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(local) for f in names  # train/, *_train.*
                       if os.path.splitext(f)[1] in FILE_BUILDERS and f not in ("dataset_info.json", "state.json")
                       and _of_split(os.path.relpath(os.path.join(d, f), local), split))
        if not files:
            raise DataError(f"{spec}: no {'/'.join(FILE_BUILDERS)} file in {local} has a name or folder word naming "
                            f"{split!r}")
        logger.info(f"{spec}: {len(files)} file(s): {', '.join(os.path.relpath(f, local) for f in files[:8])}")
        parts = [(f, _read_file(f, (cfg.prompt_key, cfg.answer_key))) for f in files]
        for f in [f for f, part in parts if part is None]:
            logger.warning(f"{f} has no rows; skipped")
        parts = [(f, part) for f, part in parts if part is not None]
        if not parts:
            raise DataError(f"'{spec}' has no rows: every file with '{split}' in its name under {local} is empty")
    for name, part in parts:
        if missing := [key for key in (cfg.prompt_key, cfg.answer_key) if key not in part.column_names]:
            raise DataError(f"{name}: no column {missing} (columns: {part.column_names}); "
                            "set data.prompt_key / data.answer_key to the right names")
        media = {c for c, f in part.features.items() if isinstance(item := getattr(f, "feature", f), (datasets.Image,
                 datasets.Video)) or isinstance(item, dict) and "bytes" in item}  # an image or video (list) column
        if media and not {cfg.image_key, cfg.video_key} & {*part.column_names}:  # else they name one, e.g. of paths
            logger.warning(f"{name}: column(s) {sorted(media)} hold images or videos, but data.image_key="
                           f"{cfg.image_key!r} and video_key={cfg.video_key!r} name none of them: rows are text only")
    rows = Rows(spec, [(name, _undecoded(part)) for name, part in parts])
    if len(rows) == 0:
        raise DataError(f"'{spec}' has no rows")
    return rows


def _of_split(relpath, split):
    """Whether a dataset folder's file at `relpath` is of `split`: the innermost part of the path with a split's word
    (between non-letters: testmini is no test) decides (fold/test_v2/train.parquet is train only)."""
    words = SPLIT_WORDS.get(split, (split,))
    for part in reversed(relpath.split(os.sep)):
        if found := {w for w in (*words, *sum(SPLIT_WORDS.values(), ()))
                     if re.search(rf"(?<![a-zA-Z]){re.escape(w)}(?![a-zA-Z])", part)}:
            return bool(found & set(words))
    return False


def _read_file(path, text_columns=()):
    """The file as a datasets.Dataset, or None when it has no rows (an empty file, a parquet file of zero rows, a
    blank or `[]` json/jsonl file): the caller then names the file, which datasets' error would not. A csv file's
    `text_columns` are read as written, its other columns with their types guessed (as datasets reads them)."""
    extension = os.path.splitext(path)[1]
    if extension not in FILE_BUILDERS:
        raise DataError(f"{path}: not a {', '.join(FILE_BUILDERS)} file")
    if extension == ".parquet" and os.path.getsize(path) > 0:
        with contextlib.suppress(Exception):  # not parquet at all: datasets' error below says so, naming the file
            if pyarrow.parquet.read_metadata(path).num_rows == 0:
                return None
    elif os.path.getsize(path) <= 4096:  # an empty file of any kind, a blank or `[]` json file
        with open(path, "rb") as f:
            if b"".join(f.read().split()) in (b"", b"[]"):  # also "[ ]", "[\n]"
                return None
    try:
        if extension == ".csv":  # prompt and answer as written ("007", "1e3", "NA" stay text); a blank cell: None
            return datasets.Dataset.from_pandas(pandas.read_csv(path, dtype=dict.fromkeys(text_columns, str),
                                                                keep_default_na=False, na_values=[""],
                                                                skipinitialspace=True))  # "q, 7": "7"
        return datasets.load_dataset(FILE_BUILDERS[extension], data_files=path, split="train")
    except Exception as e:
        raise DataError(f"{path}: not readable as a {extension} file: {e.__cause__ or e!r}") from e  # the parser's


def _undecoded(part):
    """`part` with its Image and Video features, in lists and dicts too, set to decode=False (its Arrow data as is):
    rows then hold {"bytes", "path"} for process_image / process_video: image_dir applies, a bad one names its row."""
    def visit(f):
        if isinstance(f, (datasets.Image, datasets.Video)):
            return dataclasses.replace(f, decode=False)
        if isinstance(f, (datasets.List, datasets.LargeList)):
            return dataclasses.replace(f, feature=visit(f.feature))
        return {k: visit(v) for k, v in f.items()} if isinstance(f, dict) else f
    return datasets.Dataset(part.data, datasets.DatasetInfo(features=datasets.Features(visit(part.features))))


def _local_path(path):
    """`path` if it exists, else the same relative to this file's folder, else None."""
    return next((os.path.abspath(p) for p in (path, os.path.join(HERE, path)) if os.path.exists(p)), None)


def _read_text(path, key):
    local = _local_path(path)
    if local is None or not os.path.isfile(local):
        where = " and ".join(dict.fromkeys([os.getcwd(), HERE]))  # one folder when run from beside data.py
        raise DataError(f"{key}: file not found: {path} (looked in {where})")
    with open(local) as f:
        return f.read()


def _as_list(value):
    """A column value as a list of items: None -> [], a list/tuple/array -> list, anything else (one image, path,
    or a wrong value, which then fails to decode naming its row) -> [it]."""
    return [] if value is None else list(value) if isinstance(value, (list, tuple, numpy.ndarray)) else [value]
