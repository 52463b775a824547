"""The offline toy world: tiny random-init models and synthetic tasks, so everything runs with no download.

    python toy.py [--root .toy]      # builds (or reuses) the toy world and prints where it went
    python toy.py --vl-3b DIR        # a random-init 3B-sized Qwen2.5-VL with the toy tokenizer (GPU timing)
    python toy.py --vl-7b DIR        # the same, 7B-sized

What it builds, deterministically from a seed, cached under `root`:

  vl_model/     a tiny random-init Qwen2.5-VL (text: 2 layers, hidden 64; vision: 2 blocks, hidden 32), a Hugging
                Face folder with a real fast tokenizer (build_tokenizer), the Qwen2-VL image and video processors
                and the EOS list in generation_config.json (AutoProcessor, AutoModelForImageTextToText load it).
  text_model/   the same tokenizer and a tiny Qwen2 causal LM (`AutoModelForCausalLM`).
  vl_warm/, text_warm/   the two after warm_start: they answer `<answer>blue</answer>` + EOS, the content at
                chance; the toy configs start from these.
  colors/       train.parquet / test.parquet in the Geometry3K schema (`problem` with `<image>`, `answer`,
                `images` as a list of {"bytes": png}): name the colour of the square.
  sums/         the same, text only: "What is 1 + 2?" -> "3" (digits 0-2, sums equally often).
  video_colors/ the same with `videos` (MP4 bytes, 4 frames at 2 fps) and `<video>`: the square's colour in most
                frames (3 of the 4).

From the warm starts, GRPO lifts greedy validation accuracy past 0.9 within minutes on two CPU cores (README,
"Measured"). The toy world is not a stage: data and weights on disk, read through a real model's code paths.
"""

import argparse
import io
import json
import os
import random
import shutil
import tempfile

# Bump when anything below changes what is written, so stale caches are rebuilt.
TOY_VERSION = 16

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
COLORS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
TASK_WORDS = ("system user assistant You are a helpful What colour color is the shape square of answer Answer "
              "think boxed final and put in Solve following problem step by").split()
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                     r"""\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen's chat template, shortened: no default system prompt (toy prompts stay short), images and
# videos as vision_start + pad + vision_end, the generation prompt "<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WARM_STEPS = {"colors": 300, "sums": 600}  # supervised warm-start steps (warm_start)
SUM_DIGITS = 2           # sums task: a + b with a, b in 0..SUM_DIGITS
IMAGE_SIDE = 56          # 56 x 56 pixels -> 4 x 4 patches of 14 -> 2 x 2 = 4 image tokens
VIDEO_FRAMES, VIDEO_FPS = 4, 2  # toy clips: 2 seconds
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def ensure_toy(root=".toy", seed=0):
    """{name: absolute folder} of the toy world under `root`, built unless this version is there already.
    Concurrent callers are safe: each builds in a temporary folder and renames it into place."""
    root = os.path.abspath(root)
    names = ("vl_model", "text_model", "colors", "sums", "vl_warm", "text_warm", "video_colors")
    paths = {name: os.path.join(root, name) for name in names}
    stamp = os.path.join(root, "VERSION")
    if _built(stamp, seed):
        return paths
    os.makedirs(os.path.dirname(root) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".toy-build-", dir=os.path.dirname(root) or ".")
    os.chmod(tmp, 0o755)  # a usual folder once in place (mkdtemp makes it 0700), as merge.py's output
    tokenizer = build_tokenizer()
    build_text_model(os.path.join(tmp, "text_model"), tokenizer, seed)  # first: the VL processor marks the tokenizer
    build_vl_model(os.path.join(tmp, "vl_model"), tokenizer, seed)        # as its own (processor_class)
    _write_task(os.path.join(tmp, "colors"), colors_row, random.Random(seed), n_train=512, n_test=64)
    _write_task(os.path.join(tmp, "sums"), sums_row, random.Random(seed + 1), n_train=512, n_test=64)
    _write_task(os.path.join(tmp, "video_colors"), video_colors_row, random.Random(seed + 3), n_train=256, n_test=32)
    warm_start(os.path.join(tmp, "vl_model"), os.path.join(tmp, "vl_warm"), "colors", seed)
    warm_start(os.path.join(tmp, "text_model"), os.path.join(tmp, "text_warm"), "sums", seed)
    with open(os.path.join(tmp, "VERSION"), "w") as f:
        f.write(f"{TOY_VERSION} {seed}\n")
    if not _built(stamp, seed):  # else another build finished first: others may be reading its identical copy
        old = tempfile.mkdtemp(prefix=".toy-old-", dir=os.path.dirname(root) or ".")
        try:
            os.rename(root, os.path.join(old, "toy"))  # an older version, or a build cut short
        except FileNotFoundError:
            pass
        try:
            os.rename(tmp, root)
        except OSError:  # another build took the place meanwhile
            pass
        shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return paths


def _built(stamp, seed):
    return os.path.exists(stamp) and open(stamp).read().strip() == f"{TOY_VERSION} {seed}"


def build_tokenizer(pad_to=None):
    """A real fast tokenizer built the way Qwen's is (byte-level BPE, Qwen2's split regex, NFC), trained on the
    toy tasks' text so that the answer words (the four colours, the digits) are one token each. Its alphabet is
    printable ASCII, space and newline (167 tokens in all; other characters are dropped): a small vocabulary gives a
    random-init model a fair chance of naming a colour at all. `pad_to`: fill the vocabulary up to this size with
    placeholders "<t167>", ... that text never encodes to, so ids sampled from a full-size random model decode."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    model.normalizer = normalizers.NFC()
    model.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    model.decoder = decoders.ByteLevel()
    alphabet = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # byte-level symbols of ' ' and '\n'
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(SPECIAL_TOKENS) + 64, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False)
    model.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    if pad_to:
        state = json.loads(model.to_str())
        state["model"]["vocab"].update({f"<t{i}>": i for i in range(model.get_vocab_size(), pad_to)})
        model = Tokenizer.from_str(json.dumps(state))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                        unk_token=None, clean_up_tokenization_spaces=False)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _tokenizer_corpus():
    # Colour words most often, with and without a leading space, so each becomes one token first (with " red" as
    # "Ġ" + "red" the policy learned three colours and never the fourth).
    colors = [" " + " ".join(COLORS), "\n".join(COLORS)] * 8
    lines = [" ".join(TASK_WORDS), "\n".join(TASK_WORDS), "What colour is the square?", "<|im_start|>assistant\n"] * 2
    lines += [f"What is {a} + {b}?" for a in range(10) for b in range(10)]
    lines += ["<think> </think> <answer> </answer> \\boxed{} Answer: $"]
    return (colors + lines) * 50


# Qwen2.5-VL shapes: the toy (fp32, untied, small images); for timing the loop on a GPU, Qwen2.5-VL-3B-Instruct's
# (bf16, tied; 3.8 B parameters, 7.5 GB on disk) and Qwen2.5-VL-7B-Instruct's (bf16, untied; 8.3 B, 16.6 GB).
QWEN_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                   fullatt_block_indexes=[7, 15, 23, 31])
QWEN_ROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
VL_SHAPES = {
    "toy": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32768,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, window_size=56,
                    fullatt_block_indexes=[1]),
        tied=False, dtype="float32", pixels=dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)),
    "3b": dict(
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_parameters=QWEN_ROPE),
        vision=dict(QWEN_VISION, out_hidden_size=2048), tied=True, dtype="bfloat16", pixels={}),
    "7b": dict(
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, max_position_embeddings=32768, rope_parameters=QWEN_ROPE),
        vision=dict(QWEN_VISION, out_hidden_size=3584), tied=False, dtype="bfloat16", pixels={}),
}


def build_vl_model(path, tokenizer, seed, shape="toy", device="cpu"):
    """A random-init Qwen2.5-VL of VL_SHAPES[shape] with `tokenizer`, saved as a Hugging Face folder with its
    processor and generation config. For "3b" pass build_tokenizer(pad_to=151936), for "7b" pad_to=152064: Qwen's
    vocabulary sizes."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor)

    s = VL_SHAPES[shape]
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), **s["text"], **({"tie_word_embeddings": True} if s["tied"] else {}),
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(**s["vision"], patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=s["tied"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).to(getattr(torch, s["dtype"]))
    model.save_pretrained(path)
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**s["pixels"]), video_processor=Qwen2VLVideoProcessor(**s["pixels"]),
        tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    _generation_config(ids).save_pretrained(path)
    return path


def build_text_model(path, tokenizer, seed):
    """A random-init Qwen2 causal LM of the toy VL model's text shape (no mrope), saved with `tokenizer`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    shape = {k: v for k, v in VL_SHAPES["toy"]["text"].items() if k != "rope_parameters"}
    config = Qwen2Config(
        vocab_size=len(tokenizer), **shape, tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    torch.manual_seed(seed + 1)
    Qwen2ForCausalLM(config).float().save_pretrained(path)
    tokenizer.save_pretrained(path)
    _generation_config(ids).save_pretrained(path)


def _generation_config(ids):
    from transformers import GenerationConfig

    # Like Qwen's: two EOS ids, the chat end and the document end.
    return GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"],
                            bos_token_id=ids["<|endoftext|>"], do_sample=True, temperature=1.0)


def color_image(color, rng):
    """A 56 x 56 image: a grey background of random shade and one square of `color` (40 to 56 pixels a side)."""
    from PIL import Image

    shade = rng.randint(90, 160)
    img = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (shade, shade, shade))
    side = rng.randint(40, 56)
    x, y = rng.randint(0, IMAGE_SIDE - side), rng.randint(0, IMAGE_SIDE - side)
    img.paste(Image.new("RGB", (side, side), COLORS[color]), (x, y))
    return img


def colors_row(rng):
    color = rng.choice(sorted(COLORS))
    buf = io.BytesIO()
    color_image(color, rng).save(buf, format="PNG")
    return {"problem": "<image>What colour is the square?", "answer": color,
            "images": [{"bytes": buf.getvalue(), "path": None}]}


def sums_row(rng):
    total = rng.randint(0, 2 * SUM_DIGITS)  # every sum equally often: no one answer is worth always giving
    a = rng.randint(max(0, total - SUM_DIGITS), min(SUM_DIGITS, total))
    return {"problem": f"What is {a} + {total - a}?", "answer": str(total)}


def video_colors_row(rng):
    """Which colour is the square in most frames: VIDEO_FRAMES frames (a toy image each), all but one of one
    colour, the odd one of another, in random order. At data.video_fps = VIDEO_FPS every frame is sampled:
    2 temporal patches of 2 x 2 merged patches, 8 video tokens."""
    color, other = rng.sample(sorted(COLORS), 2)
    colors = [color] * (VIDEO_FRAMES - 1) + [other]
    rng.shuffle(colors)
    clip = video_bytes([color_image(c, rng) for c in colors], VIDEO_FPS)
    return {"problem": "<video>What colour is the square in most frames?", "answer": color,
            "videos": [{"bytes": clip, "path": None}]}


def warm_start(src, dst, task, seed, batch_size=32, lr=3e-3):
    """Supervised fine-tuning of the model in `src` (saved to `dst`, with its tokenizer, processor and generation
    config) on `task`'s prompts, answered in the toy format with RANDOM labels: `<answer>blue</answer>` + EOS.
    It learns the format and the answer vocabulary but not the content (answers at chance), like the
    instruction-tuned model a real GRPO run starts from. Loss: mean cross-entropy over the response tokens (EOS
    included); AdamW. Random labels teach whatever trains to ignore the input, so:
      - colours: the prompt shows the grey background without a square, and only the top trains (last decoder
        layer, final norm, head; training everything made learning the true colours several times slower);
      - sums: everything trains, but every other batch asks a difference with TRUE labels ("What is 3 - 1?" -> 2),
        so the digits stay worth reading (the random batches ask the task's own sums, else the differences carry
        over to them)."""
    import torch
    from PIL import Image
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    rng = random.Random(seed + 2)
    torch.manual_seed(seed + 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float sums on any machine (and faster for a model this small)
    is_vl = task == "colors"
    model = (AutoModelForImageTextToText if is_vl else AutoModelForCausalLM).from_pretrained(src, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(src) if is_vl else AutoTokenizer.from_pretrained(src)
    tokenizer = processor.tokenizer if is_vl else processor
    top = f"layers.{model.config.get_text_config().num_hidden_layers - 1}."
    for name, param in model.named_parameters():
        param.requires_grad_(not is_vl or name == "lm_head.weight" or "visual" not in name and (
            top in name or name.endswith("norm.weight") and "layers." not in name))
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    prompts = {}  # question -> chat-templated prompt (the template is slow to render)
    for step in range(WARM_STEPS[task]):
        texts, images, answers = [], [], []
        for _ in range(batch_size):
            if is_vl:
                shade = rng.randint(90, 160)  # the background alone: no square whose colour to learn to ignore
                images.append(Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (shade, shade, shade)))
                question, answer = "What colour is the square?", rng.choice(sorted(COLORS))
            elif step % 2:  # a true difference, 0 to 2 * SUM_DIGITS
                x = rng.randint(0, 2 * SUM_DIGITS)
                y = rng.randint(0, x)
                question, answer = f"What is {x} - {y}?", str(x - y)
            else:  # a sum with a random answer
                a, b = rng.randint(0, SUM_DIGITS), rng.randint(0, SUM_DIGITS)
                question, answer = f"What is {a} + {b}?", str(rng.randint(0, 2 * SUM_DIGITS))
            if question not in prompts:
                content = [{"type": "image"}, {"type": "text", "text": question}] if is_vl else question
                prompts[question] = processor.apply_chat_template([{"role": "user", "content": content}],
                                                                  add_generation_prompt=True, tokenize=False)
            answers.append(f"<answer>{answer}</answer><|im_end|>")
            texts.append(prompts[question] + answers[-1])
        inputs = processor(text=texts, images=images, return_tensors="pt") if is_vl else \
            processor(texts, return_tensors="pt")  # every toy prompt and answer has one length: no padding
        labels = torch.full_like(inputs["input_ids"], -100)  # [batch, tokens]: loss on the answer and EOS only
        n = len(tokenizer(answers[0])["input_ids"])
        labels[:, -n:] = inputs["input_ids"][:, -n:]
        model(**inputs, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.set_num_threads(threads)
    shutil.copytree(src, dst)
    model.save_pretrained(dst)


def video_bytes(frames, fps):
    """An MP4 of RGB frames (PIL images of one even size), MPEG-4 Part 2: an encoder every FFmpeg (and PyAV) has."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(frame)))
        container.mux(stream.encode())  # flush
    return buf.getvalue()


def _write_task(path, make_row, rng, n_train, n_test):
    """train.parquet (the first n_train rows) and test.parquet (the next n_test) of make_row(rng) rows."""
    import pandas as pd

    rows = [make_row(rng) for _ in range(n_train + n_test)]
    os.makedirs(path, exist_ok=True)
    pd.DataFrame(rows[:n_train]).to_parquet(os.path.join(path, "train.parquet"))
    pd.DataFrame(rows[n_train:]).to_parquet(os.path.join(path, "test.parquet"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".toy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vl-3b", metavar="DIR", help="instead: build a random-init 3B-sized Qwen2.5-VL in DIR")
    parser.add_argument("--vl-7b", metavar="DIR", help="instead: build a random-init 7B-sized Qwen2.5-VL in DIR")
    args = parser.parse_args()
    if args.vl_3b or args.vl_7b:
        import torch

        shape, vocab = ("3b", 151936) if args.vl_3b else ("7b", 152064)
        print(build_vl_model(args.vl_3b or args.vl_7b, build_tokenizer(pad_to=vocab), args.seed, shape,
                             "cuda" if torch.cuda.is_available() else "cpu"))
    else:
        print(json.dumps(ensure_toy(args.root, args.seed), indent=2))
