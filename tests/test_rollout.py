"""rollout.py on the toy models: grouping, EOS and truncation, the placeholder ban, log-probs against an
independent forward, batched == one-by-one, seeds, weight loading, text-only models.

The `engine` fixture runs every engine test with the transformers engine and, where vLLM and a GPU are
present, again with the vLLM engine. Weights are forced through load_weights: a huge constant added to one
embedding dimension makes the final normed hidden state ~ sqrt(hidden) * e_0 at every position, so the logit
of token t is ~ 8 * lm_head[t, 0]: setting that column picks which tokens the model prefers.
"""

import importlib.util
import math
import os
import random
import re
import shutil
import types

import pytest
import torch

import rollout

torch.set_num_threads(1)
IM_END, ENDOFTEXT, IMAGE_PAD, VIDEO_PAD = 2, 0, 5, 6  # toy tokenizer ids (checked in the fixture)
HF_TOL, VLLM_TOL = 1e-4, 2e-3  # |logp_rollout - logp_reference|: fp32 CPU transformers; fp32 vLLM kernels
VLLM_VIDEO_TOL = 5e-3  # vLLM's fp32 video path: up to 0.0027 from transformers here, text-only prompts exact


def config(**changes):
    cfg = dict(name="hf", n=2, temperature=1.0, top_p=1.0, top_k=-1, seed=1, limit_images=1, dtype="fp32",
               ignore_eos=False, gpu_memory_utilization=0.3, enforce_eager=True, enable_chunked_prefill=False,
               tensor_parallel_size=1, max_model_len=None, max_num_batched_tokens=4096, disable_log_stats=True,
               disable_tqdm=True, val_override_config={"temperature": 0.6, "top_p": 0.95, "n": 1})
    cfg.update(changes)
    return types.SimpleNamespace(**cfg)


@pytest.fixture(scope="module")
def world(toy):
    """The toy VL model as an independent reference (plain transformers), its processor and three prompts."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import toy as toy_world

    processor = AutoProcessor.from_pretrained(toy["vl_model"])
    tok = processor.tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<|image_pad|>", "<|video_pad|>")] \
        == [IM_END, ENDOFTEXT, IMAGE_PAD, VIDEO_PAD]
    reference = AutoModelForImageTextToText.from_pretrained(toy["vl_model"], dtype=torch.float32).eval()
    images = [toy_world.color_image(color, random.Random(0)) for color in ("red", "blue")]  # 56 x 56 -> 4 tokens
    prompts = [make_prompt(processor, reference, "What colour is the square?", images[0], "a"),
               make_prompt(processor, reference, "What is 3 + 4?", None, "b"),
               make_prompt(processor, reference, "Answer: what colour is the shape of the square?", images[1], "c")]
    assert len({len(p["prompt_ids"]) for p in prompts}) == 3  # different lengths: left padding is exercised
    base = {name: t.clone() for name, t in reference.state_dict().items()}
    return types.SimpleNamespace(processor=processor, reference=reference, prompts=prompts, base=base)


def make_prompt(processor, model, question, image, uid):
    """A prompt dict as data.py makes it, by hand: expanded and raw ids, pixels, [4, P] positions."""
    content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    enc = processor(text=[text], images=[image] if image else None, return_tensors="pt")
    ids = enc["input_ids"]
    P = ids.shape[1]
    if image:
        mrope, _ = model.model.get_rope_index(ids, mm_token_type_ids=enc["mm_token_type_ids"],
                                              image_grid_thw=enc["image_grid_thw"])
        mrope = mrope[:, 0]
    else:
        mrope = torch.arange(P).expand(3, P)
    return {"uid": uid, "prompt_ids": ids[0].tolist(), "raw_prompt_ids": processor.tokenizer(text)["input_ids"],
            "images": [image] if image else [],
            "multi_modal_inputs": {k: enc[k] for k in ("pixel_values", "image_grid_thw") if image},
            "position_ids": torch.cat([torch.arange(P)[None], mrope])}


@pytest.fixture(scope="module", params=["hf", "vllm"])
def engine(request, toy, world):
    if request.param == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (GPU extra: requirements-gpu.txt)")
        if not torch.cuda.is_available():
            pytest.skip("the vLLM engine needs a CUDA GPU")
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT="29517").items():
            os.environ.setdefault(key, value)
    device = "cuda" if request.param == "vllm" else "cpu"
    eng = rollout.make_rollout(config(name=request.param, limit_videos=1), toy["vl_model"], max_prompt_length=64,
                               max_response_length=8, device=device)
    eng.tolerance = VLLM_TOL if request.param == "vllm" else HF_TOL
    yield eng
    del eng


def fresh(engine, world, prefer=None):
    """Reload the base weights, optionally with `prefer` = {token id: lm_head weight} forcing those tokens."""
    weights = dict(world.base)
    if prefer:
        emb, head = weights["model.language_model.embed_tokens.weight"].clone(), weights["lm_head.weight"].clone()
        emb[:, 0] += 1000.0
        head[:, 0] = 0.0
        for token, w in prefer.items():
            head[token, 0] = w
        weights.update({"model.language_model.embed_tokens.weight": emb, "lm_head.weight": head})
    engine.load_weights(iter(weights.items()))
    engine.wake_up()


def reference_logprobs(model, prompt, response_ids, temperature, top_k=-1, top_p=1.0,
                       banned=(IMAGE_PAD, VIDEO_PAD)):
    """log p(response token | prefix) from ONE plain forward of prompt + response (the model computes its
    own mrope positions), with the ban, temperature, top-k and top-p applied as the rollout documents."""
    ids = torch.tensor([prompt["prompt_ids"] + response_ids])
    kwargs = dict(prompt.get("multi_modal_inputs") or {})
    if hasattr(model.config, "vision_config"):
        kwargs["mm_token_type_ids"] = (ids == IMAGE_PAD).long() + 2 * (ids == VIDEO_PAD).long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0].float()
    P, T = len(prompt["prompt_ids"]), len(response_ids)
    z = logits[P - 1:P - 1 + T].clone()                                          # [T, vocab]
    z[:, list(banned)] = float("-inf")
    z = z / temperature if temperature > 0 else z
    if top_k > 0:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    for row in z if top_p < 1.0 else []:  # top-p: keep the likeliest tokens until their mass reaches top_p
        probs = row.softmax(-1).tolist()  # (and the ties of the last one kept)
        mass, last = 0.0, None
        for token in sorted(range(len(probs)), key=lambda t: -probs[t]):
            if mass >= top_p and probs[token] < last:
                row[token] = float("-inf")
            else:
                last = probs[token]
            mass += probs[token]
    return z.log_softmax(-1).gather(1, torch.tensor(response_ids)[:, None])[:, 0]


def test_n_responses_per_prompt_grouped_in_order(engine, world):
    fresh(engine, world)
    out = engine.generate(world.prompts, n=3, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=6, seed=11)
    assert len(out) == 9
    assert [r["prompt_index"] for r in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r["uid"] for r in out] == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    for r in out:
        assert set(r) == {"prompt_index", "uid", "response_ids", "logprobs", "finish_reason"}
        assert 1 <= len(r["response_ids"]) <= 6 and len(r["logprobs"]) == len(r["response_ids"])
        assert all(lp <= 0.0 and lp > -1e9 for lp in r["logprobs"])
        ends_with_eos = r["response_ids"][-1] in (IM_END, ENDOFTEXT)
        assert r["finish_reason"] == ("stop" if ends_with_eos else "length")
        assert ends_with_eos or len(r["response_ids"]) == 6
        assert not any(t in (IM_END, ENDOFTEXT) for t in r["response_ids"][:-1])  # nothing after the first EOS


@pytest.mark.parametrize("eos", [IM_END, ENDOFTEXT])
def test_stops_at_either_eos_of_the_generation_config(engine, world, eos):
    fresh(engine, world, prefer={eos: 5.0})  # logit ~ 40 for this EOS: p ~ 1
    out = engine.generate(world.prompts, n=2, temperature=1.0, max_tokens=8, seed=0)
    for r in out:
        assert r["response_ids"] == [eos] and r["finish_reason"] == "stop"
        assert abs(r["logprobs"][0]) < 1e-3


def test_truncated_responses_are_marked_length(engine, world):
    red = world.processor.tokenizer.convert_tokens_to_ids("red")
    fresh(engine, world, prefer={red: 5.0})
    out = engine.generate(world.prompts, n=2, temperature=1.0, max_tokens=5, seed=0)
    for r in out:
        assert r["response_ids"] == [red] * 5 and r["finish_reason"] == "length"


def test_mixed_eos_and_length_in_one_batch(engine, world):
    """A word at p ~ 0.9 and an EOS at p ~ 0.1: some rows stop early while others run to max_tokens."""
    red = world.processor.tokenizer.convert_tokens_to_ids("red")
    fresh(engine, world, prefer={red: 5.0, ENDOFTEXT: 4.75})
    out = engine.generate(world.prompts, n=4, temperature=1.0, max_tokens=6, seed=3)
    reasons = {r["finish_reason"] for r in out}
    assert reasons == {"stop", "length"}
    for r in out:
        expected = [red] * (len(r["response_ids"]) - 1) + ([ENDOFTEXT] if r["finish_reason"] == "stop" else [red])
        assert r["response_ids"] == expected


def test_placeholder_tokens_are_never_emitted(engine, world):
    """Image and video pads are made by far the likeliest tokens; they must still never be sampled."""
    red = world.processor.tokenizer.convert_tokens_to_ids("red")
    fresh(engine, world, prefer={IMAGE_PAD: 10.0, VIDEO_PAD: 10.0, red: 2.0})
    out = engine.generate(world.prompts, n=4, temperature=2.0, max_tokens=6, seed=5)
    emitted = {t for r in out for t in r["response_ids"]}
    assert IMAGE_PAD not in emitted and VIDEO_PAD not in emitted
    assert red in emitted  # the next best token took over


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.0, -1, 1.0), (1.3, 5, 1.0),
                                                     (1.0, -1, 0.3)])
def test_logprobs_equal_an_independent_forward(engine, world, temperature, top_k, top_p):
    """With top-k/top-p the log-probs are of the truncated distribution that was sampled from."""
    fresh(engine, world)
    out = engine.generate(world.prompts, n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=8,
                          seed=7)
    worst = 0.0
    for r in out:
        expected = reference_logprobs(world.reference, world.prompts[r["prompt_index"]], r["response_ids"],
                                      temperature, top_k, top_p)
        worst = max(worst, (torch.tensor(r["logprobs"]) - expected).abs().max().item())
    assert worst < engine.tolerance, f"max |logp_rollout - logp_reference| = {worst}"


def test_video_prompts_logprobs_equal_an_independent_forward(engine, world):
    """Video, image + video and text prompts in one batch, as data.py makes them (sampled frames and their
    metadata, the processor's tensors, the model's own positions with the video's temporal ones). The time
    positions are checked on the transformers engine only: wrong ones (24 or 2 fps for 1) move this toy's log-probs
    by 0.0003-0.0016, within vLLM's own distance from transformers on video prompts (up to 0.0027, whatever the
    fps: its vision path). On vLLM this checks that each video arrives, in its place; what rollout.py hands vLLM
    for the time positions is checked by test_vllm_requests_carry_videos_and_limit_them_as_the_data_does."""
    import numpy

    import toy as toy_world

    processor, model, rng = world.processor, world.reference, random.Random(1)
    frames = numpy.stack([numpy.asarray(toy_world.color_image(c, rng)) for c in ("red", "red", "blue", "red")])
    metadata = {"fps": 1.0, "duration": 4.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3],
                "video_backend": "pyav"}  # 1 fps: 2 s per temporal patch, not the default 1 s
    prompts = []
    for uid, content, image in (("v", [{"type": "video"}, {"type": "text", "text": "What colour?"}], None),
                                ("iv", [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Same?"}],
                                 toy_world.color_image("green", rng))):
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        enc = processor(text=[text], images=[image] if image else None, videos=[frames], video_metadata=[metadata],
                        do_sample_frames=False, return_tensors="pt")
        mm = {k: enc[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                  "second_per_grid_ts") if k in enc}
        mrope, _ = model.model.get_rope_index(enc["input_ids"], mm_token_type_ids=enc["mm_token_type_ids"],
                                              image_grid_thw=mm.get("image_grid_thw"),
                                              video_grid_thw=mm["video_grid_thw"],
                                              second_per_grid_ts=mm["second_per_grid_ts"])
        P = enc["input_ids"].shape[1]
        assert (mrope[0, 0] != mrope[1, 0]).any()  # the temporal row differs: a wrong one would show
        prompts.append({"uid": uid, "prompt_ids": enc["input_ids"][0].tolist(),
                        "raw_prompt_ids": processor.tokenizer(text)["input_ids"], "images": [image] if image else [],
                        "videos": [frames], "video_metadata": [metadata], "multi_modal_inputs": mm,
                        "position_ids": torch.cat([torch.arange(P)[None], mrope[:, 0]])})
    fresh(engine, world)
    out = engine.generate(prompts + [world.prompts[1]], n=2, temperature=1.0, max_tokens=6, seed=3)
    assert [r["uid"] for r in out] == ["v", "v", "iv", "iv", "b", "b"]
    worst = max((torch.tensor(r["logprobs"]) - reference_logprobs(model, (prompts + [world.prompts[1]])[
        r["prompt_index"]], r["response_ids"], 1.0)).abs().max().item() for r in out)
    tolerance = VLLM_VIDEO_TOL if engine.tolerance == VLLM_TOL else engine.tolerance
    assert worst < tolerance, f"max |logp_rollout - logp_reference| = {worst}"


def test_batched_left_padded_equals_one_by_one_greedy(engine, world):
    fresh(engine, world)
    settings = dict(n=1, temperature=0.0, max_tokens=8, seed=0)
    together = engine.generate(world.prompts, **settings)
    alone = [engine.generate([p], **settings)[0] for p in world.prompts]
    for a, b in zip(together, alone):
        assert a["response_ids"] == b["response_ids"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < engine.tolerance


def test_same_seed_same_responses_other_seed_other_responses(engine, world):
    fresh(engine, world)
    step = lambda seed: engine.generate(world.prompts, n=2, temperature=1.0, max_tokens=8, seed=seed)
    s1, s2 = rollout.derive_seed(1, 0, 0), rollout.derive_seed(1, 1, 0)  # (config seed, step, rank)
    first, again, other = step(s1), step(s1), step(s2)
    ids = lambda out: [r["response_ids"] for r in out]
    assert ids(first) == ids(again)
    assert ids(first) != ids(other)
    # The same prompt twice in one call: its samples draw from different streams (EasyR1 reused them).
    twice = engine.generate([world.prompts[0], world.prompts[0]], n=2, temperature=1.0, max_tokens=8, seed=s1)
    assert ids(twice)[:2] != ids(twice)[2:]


def test_load_weights_changes_the_output_and_rejects_unknown_names(engine, world):
    fresh(engine, world)
    settings = dict(n=1, temperature=0.0, max_tokens=4, seed=0)
    before = engine.generate(world.prompts, **settings)
    blue = world.processor.tokenizer.convert_tokens_to_ids("blue")
    fresh(engine, world, prefer={blue: 5.0})
    assert all(r["response_ids"] == [blue] * 4 for r in engine.generate(world.prompts, **settings))
    fresh(engine, world)
    assert [r["response_ids"] for r in engine.generate(world.prompts, **settings)] == \
        [r["response_ids"] for r in before]
    if isinstance(engine, rollout.HFRollout):  # vLLM's own loader reports unknown names its own way
        with pytest.raises(KeyError, match="model.language_model.no_such.weight"):
            engine.load_weights(iter([("model.language_model.no_such.weight", torch.zeros(1))]))
        with pytest.raises(ValueError, match="lm_head.weight"):
            engine.load_weights(iter([("lm_head.weight", world.base["lm_head.weight"].T)]))  # same size, transposed


def test_sleep_and_wake_up_keep_the_weights(engine, world):
    fresh(engine, world)
    settings = dict(n=1, temperature=0.0, max_tokens=4, seed=0)
    before = engine.generate(world.prompts, **settings)
    engine.sleep()
    engine.wake_up()
    assert [r["response_ids"] for r in engine.generate(world.prompts, **settings)] == \
        [r["response_ids"] for r in before]


def test_text_only_model(toy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(toy["text_model"])
    reference = AutoModelForCausalLM.from_pretrained(toy["text_model"], dtype=torch.float32).eval()
    engine = rollout.make_rollout(config(), toy["text_model"], max_prompt_length=32, max_response_length=6,
                                  device="cpu")
    texts = ["<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n", "What is 1 + 2?"]
    prompts = [{"uid": f"t{i}", "prompt_ids": tok(t)["input_ids"]} for i, t in enumerate(texts)]
    out = engine.generate(prompts, n=2, temperature=0.8, max_tokens=6, seed=2)
    assert [r["prompt_index"] for r in out] == [0, 0, 1, 1]
    for r in out:
        expected = reference_logprobs(reference, prompts[r["prompt_index"]], r["response_ids"], 0.8, banned=())
        assert (torch.tensor(r["logprobs"]) - expected).abs().max().item() < HF_TOL


def test_sampler_draws_from_the_processed_distribution():
    """4000 rows of the same logits, each with its own generator: frequencies match softmax(z / T) with the
    banned token at 0 and top-k's dropped token at 0 (3 sigma ~ 0.023 at p = 0.5)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 5.0]]).repeat(4000, 1)
    generators = [torch.Generator().manual_seed(i) for i in range(4000)]
    token, logp = rollout._sample_next(logits.clone(), [4], 2.0, 1.0, 3, generators)
    expected = torch.tensor([2.0, 1.0, 0.0]).div(2.0).softmax(-1)  # token 4 banned, token 3 cut by top-3
    frequencies = torch.bincount(token, minlength=5).float() / 4000
    assert (frequencies[:3] - expected).abs().max() < 0.025 and frequencies[3:].sum() == 0
    assert torch.allclose(logp, expected.log()[token], atol=1e-6)


def test_sampling_settings_merge_and_reject_unknown_keys():
    cfg = config(temperature=1.0, top_p=1.0, n=5)
    assert rollout.sampling_settings(cfg) == {"n": 5, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    assert rollout.sampling_settings(cfg, cfg.val_override_config) == \
        {"n": 1, "temperature": 0.6, "top_p": 0.95, "top_k": -1}
    with pytest.raises(ValueError, match="temprature"):
        rollout.sampling_settings(cfg, {"temprature": 0.5})


def test_derive_seed_is_stable_and_separates_its_inputs():
    """Stable across processes: two interpreters with different string-hash seeds (where hash() of a str differs)
    give the value this process gets, for string parts too."""
    import subprocess
    import sys

    code = "import rollout; print(rollout.derive_seed('run', 1, 'rank0'), rollout.derive_seed(1, 2, 3))"
    here = [str(rollout.derive_seed("run", 1, "rank0")), str(rollout.derive_seed(1, 2, 3))]
    for hash_seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(rollout.__file__), check=True,
                             capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert out.stdout.split() == here, (hash_seed, out.stdout, here)
    seeds = {rollout.derive_seed(1, step, rank) for step in range(50) for rank in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2 ** 62 for s in seeds)
    import hashlib  # and the documented value, so that a run's streams stay those of earlier versions

    assert rollout.derive_seed(1, 2, 3) == int.from_bytes(hashlib.blake2b(b"(1, 2, 3)", digest_size=8).digest(),
                                                          "little") >> 2


def test_bad_inputs_fail_with_clear_errors(toy, world):
    with pytest.raises(ValueError, match="worker.rollout.name"):
        rollout.make_rollout(config(name="sglang"), toy["vl_model"], max_prompt_length=8, max_response_length=8,
                             device="cpu")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="requirements-gpu.txt"):
            rollout.make_rollout(config(name="vllm"), toy["vl_model"], max_prompt_length=8, max_response_length=8,
                                 device="cpu")
    engine = rollout.make_rollout(config(), toy["vl_model"], max_prompt_length=64, max_response_length=4, device="cpu")
    with pytest.raises(KeyError, match="prompt 0 lacks"):
        engine.generate([{"uid": "x"}], n=1)
    for key, value, bound in (("top_p", 0.0, "(in (0, 1])"), ("temperature", -0.5, "(>= 0)"),  # every one listed
                              ("temperature", float("nan"), "(>= 0)")):  # NaN: every log-prob was NaN
        with pytest.raises(ValueError, match=re.escape(f"{key}={value} {bound}")):
            engine.generate(world.prompts, n=1, **{key: value})
    assert len(engine.generate(world.prompts, n=1, top_p=0.5)) == 3  # the same call in range: top_p was the cause
    no_positions = {k: v for k, v in world.prompts[0].items() if k != "position_ids"}
    with pytest.raises(ValueError, match="position_ids"):
        engine.generate([no_positions], n=1)


def test_top_p_keeps_or_drops_tied_tokens_together():
    """Tokens of equal probability are kept or dropped together (as top-k keeps its ties), whatever order a sort
    puts them in: [1, 0, 0] at top_p 0.6 keeps all three (p = 0.58 before the tied pair, < 0.6); a sort-order
    cut kept one of the pair and never sampled the other."""
    for logits, kept in (([1.0, 0.0, 0.0], [0, 1, 2]), ([0.0, 1.0, 0.0, 0.0, 0.0], [0, 1, 2, 3, 4]),
                         ([0.0, 0.0, 2.0, -1.0], [2])):
        z = torch.tensor(logits)
        expected = torch.full_like(z, float("-inf"))
        expected[kept] = z[kept].log_softmax(-1)
        generators = [torch.Generator().manual_seed(i) for i in range(2000)]
        token, logp = rollout._sample_next(z.repeat(2000, 1), [], 1.0, 0.6, -1, generators)
        assert sorted(set(token.tolist())) == kept, logits
        assert torch.allclose(logp, expected[token], atol=1e-6)


def test_empty_prompts_image_prompts_without_mrope_rows_and_max_tokens_0_are_errors(toy, world):
    """An empty prompt (alone it failed deep in the embedding; beside others it was sampled from padding), an image
    prompt whose position_ids has only the text row (its image tokens got text positions, silently) and
    max_tokens=0 (it meant max_response_length) are errors naming the prompt or the setting."""
    engine = rollout.make_rollout(config(), toy["vl_model"], max_prompt_length=64, max_response_length=4,
                                  device="cpu")
    for prompts in ([{"uid": "e", "prompt_ids": []}], [world.prompts[1], {"uid": "e", "prompt_ids": []}]):
        with pytest.raises(ValueError, match=f"prompt {len(prompts) - 1} .uid e. has an empty prompt_ids"):
            engine.generate(prompts, n=1, max_tokens=2)
    image = world.prompts[0]
    text_row = {**image, "position_ids": torch.arange(len(image["prompt_ids"]))[None]}
    with pytest.raises(ValueError, match=r"prompt 1 \(uid a\): position_ids of shape \(1, \d+\), expected "
                                         r"\(4, \d+\); image"):  # only (4, P): (1, P) is for text prompts
        engine.generate([world.prompts[1], text_row], n=1, max_tokens=2)
    text_only = {**world.prompts[1], "position_ids": torch.arange(len(world.prompts[1]["prompt_ids"]))[None]}
    assert len(engine.generate([text_only], n=1, max_tokens=2)) == 1  # a text prompt's one row is all four alike
    for lost in ({}, None, "tensor ids"):  # its placeholders were embedded as text: answered without the image
        ids = torch.tensor(image["prompt_ids"]) if lost == "tensor ids" else image["prompt_ids"]
        with pytest.raises(ValueError, match=r"prompt 0 \(uid a\): image or video placeholders in prompt_ids but no "
                                             "multi_modal_inputs"):
            engine.generate([{**image, "prompt_ids": ids, "multi_modal_inputs": lost if lost != "tensor ids" else {}}],
                            n=1, max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens=0"):
        engine.generate(world.prompts, n=1, max_tokens=0)


def test_eos_list_is_the_models_generation_config_with_a_separate_tokenizer_folder(toy, world, tmp_path):
    """With model.tokenizer_path set to a folder of tokenizer files only, the EOS list still comes from the
    model's generation_config.json ([<|im_end|>, <|endoftext|>], as vLLM and the saved checkpoints read it): a
    response ends at <|endoftext|>, which the tokenizer alone (eos <|im_end|>) ran past."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json"):
        shutil.copy(os.path.join(toy["vl_model"], name), tmp_path / name)
    engine = rollout.make_rollout(config(), toy["vl_model"], max_prompt_length=64, max_response_length=4,
                                  device="cpu", tokenizer_path=str(tmp_path))
    fresh(engine, world, prefer={ENDOFTEXT: 5.0})
    out = engine.generate(world.prompts, n=1, temperature=1.0, max_tokens=4, seed=0)
    assert [(r["response_ids"], r["finish_reason"]) for r in out] == [([ENDOFTEXT], "stop")] * 3


def test_tensor_parallel_ranks_bring_their_own_prompts():
    """world 4, tensor_parallel_size 2: the driver hands every rank its own share, each TP group's vLLM engine
    gathers its two ranks' shares and generates each prompt n times exactly once (8 prompts x n=3: 12 requests
    per engine, not 24), and every response comes back to the driver under its own prompt. (In SPMD vLLM both
    ranks of a TP group submit the same requests to their one engine.)"""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import workers

    world, tp, n = 4, 2, 3
    requests = {rank: [] for rank in range(world)}  # per rank: the prompt ids it submitted to its TP group's engine
    barriers, shared = [threading.Barrier(tp) for _ in range(world // tp)], {}  # one per TP group

    class FakeLLM:
        def __init__(self, rank):
            self.rank = rank

        def generate(self, reqs, params, use_tqdm=False):
            requests[self.rank] += [r["prompt_token_ids"][0] for r in reqs]
            done = types.SimpleNamespace
            out = []
            for r in reqs:
                ids = [r["prompt_token_ids"][0], IM_END]  # the prompt's first id, then EOS
                out.append(done(outputs=[done(token_ids=ids, logprobs=[{t: done(logprob=-1.0)} for t in ids])]))
            return out

    def make_engine(rank):
        engine = rollout.VLLMRollout.__new__(rollout.VLLMRollout)
        engine.cfg, engine.max_response_length, engine.eos_ids = config(), 4, [IM_END]
        engine.bias, engine.synced, engine.asleep, engine.llm = None, True, set(), FakeLLM(rank)
        engine.SamplingParams = lambda **kw: kw

        def gather(prompts, seed):  # what torch.distributed.all_gather_object does within the TP group
            shared[rank] = prompts
            barriers[rank // tp].wait()
            peers = [shared[r] for r in range(rank // tp * tp, rank // tp * tp + tp)]
            barriers[rank // tp].wait()
            return [p for part in peers for p in part], sum(len(p) for p in peers[:rank % tp]), seed

        engine._gather_tp_group = gather
        return engine

    engines = [make_engine(rank) for rank in range(world)]
    pool = ThreadPoolExecutor(world)

    class FakeWorker:
        def __init__(self, rank):
            self.generate = types.SimpleNamespace(
                remote=lambda prompts, sampling: pool.submit(engines[rank].generate, prompts, n=n, seed=0))

    group = workers.WorkerGroup.__new__(workers.WorkerGroup)
    group.world, group.tp, group.workers, group.vllm = world, tp, [FakeWorker(r) for r in range(world)], True
    group._get = lambda refs, what: [f.result(timeout=30) for f in refs]
    prompts = [{"uid": f"u{i}", "raw_prompt_ids": [100 + i, 7]} for i in range(8)]
    responses = group.generate(prompts, {})
    pool.shutdown()

    assert requests[0] == requests[1] and requests[2] == requests[3]  # TP peers submit the same requests
    assert sorted(requests[0] + requests[2]) == sorted([100 + i for i in range(8)] * n)  # each prompt n times, once
    assert len(requests[0]) == len(requests[2]) == 4 * n
    assert [r["prompt_index"] for r in responses] == [i for i in range(8) for _ in range(n)]
    assert all(r["response_ids"][0] == 100 + r["prompt_index"] and r["uid"] == f"u{r['prompt_index']}"
               for r in responses)


def test_trust_remote_code_reaches_every_load_of_the_transformers_engine(toy, tmp_path, monkeypatch):
    """worker.rollout.trust_remote_code (handed over by the trainer from the model section) goes to each load the
    engine makes itself: config, generation config (the model folder's, else the tokenizer folder's), tokenizer and
    model. The loaders are replaced in rollout's namespace, so transformers' own inner loads are not counted."""
    seen = []

    def recorded(name, load):
        def from_pretrained(*args, **kwargs):
            seen.append((name, kwargs.get("trust_remote_code")))
            return load(*args, **kwargs)
        return types.SimpleNamespace(from_pretrained=from_pretrained)

    for name in ("AutoConfig", "GenerationConfig", "AutoTokenizer", "AutoModelForImageTextToText",
                 "AutoModelForCausalLM"):
        monkeypatch.setattr(rollout, name, recorded(name, getattr(rollout, name).from_pretrained))
    bare = shutil.copytree(toy["text_model"], tmp_path / "text", ignore=shutil.ignore_patterns("generation_config*"))
    for path, tokenizer, loads in (
            (toy["vl_model"], toy["vl_model"], ["AutoConfig", "GenerationConfig", "AutoTokenizer",
                                                "AutoModelForImageTextToText"]),
            (str(bare), toy["text_model"], ["AutoConfig", "GenerationConfig", "GenerationConfig", "AutoTokenizer",
                                            "AutoModelForCausalLM"])):
        seen.clear()
        rollout.make_rollout(config(trust_remote_code=True), path, max_prompt_length=32, max_response_length=4,
                             device="cpu", tokenizer_path=tokenizer)
        assert sorted(seen, key=str) == sorted(((name, True) for name in loads), key=str), (path, seen)


def test_each_row_races_on_its_own_seeded_stream_in_batches_of_two(toy, world):
    """Sample j of prompt i is argmax p / E, E ~ Exp(1) from derive_seed(seed, i, j)'s generator, split in batches."""
    engine = rollout.make_rollout(config(), toy["vl_model"], max_prompt_length=64, max_response_length=4,
                                  device="cpu", batch_size=2)
    out = engine.generate(world.prompts, n=2, temperature=1.0, max_tokens=1, seed=9)
    assert [r["prompt_index"] for r in out] == [0, 0, 1, 1, 2, 2]
    for k, r in enumerate(out):
        prompt, ids = world.prompts[k // 2], torch.tensor([world.prompts[k // 2]["prompt_ids"]])
        with torch.no_grad():
            z = world.reference(input_ids=ids, mm_token_type_ids=(ids == IMAGE_PAD).long(),
                                **prompt["multi_modal_inputs"]).logits[0, -1].float()
        z[[IMAGE_PAD, VIDEO_PAD]] = float("-inf")
        generator = torch.Generator().manual_seed(rollout.derive_seed(9, k // 2, k % 2))
        race = torch.empty_like(z).exponential_(generator=generator)
        assert r["response_ids"][0] == (z.softmax(-1) / race).argmax().item(), k


def test_decoding_stops_once_every_row_ended_unless_ignore_eos(toy, world):
    """<|endoftext|> (the 2nd EOS) first everywhere: one forward; with ignore_eos all max_response_length of them."""
    for ignore_eos, forwards in ((False, 1), (True, 5)):
        engine = rollout.make_rollout(config(ignore_eos=ignore_eos), toy["vl_model"], max_prompt_length=64,
                                      max_response_length=5, device="cpu")
        fresh(engine, world, prefer={ENDOFTEXT: 5.0})
        calls, forward = [], engine.model.forward
        engine.model.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
        out = engine.generate(world.prompts, n=1, seed=0)
        assert len(calls) == forwards and [r["response_ids"] for r in out] == [[ENDOFTEXT]] * 3


def test_response_is_cut_after_the_first_eos_of_any_kind():
    """The first EOS of any kind in the list ends the response, even if another follows; without one: "length"."""
    r = rollout._response(1, "u", [7, ENDOFTEXT, 8, IM_END], [-1.0, -2.0, -3.0, -4.0], [IM_END, ENDOFTEXT])
    assert r == {"prompt_index": 1, "uid": "u", "response_ids": [7, ENDOFTEXT], "logprobs": [-1.0, -2.0],
                 "finish_reason": "stop"}
    assert rollout._response(0, "u", (7, 8), [-1.0, -2.0], [IM_END])["finish_reason"] == "length"


def test_sampler_edges_top_k_of_all_but_one_and_top_p_mass_reached_exactly():
    """top_k = vocab - 1 drops the least likely token; top_p 0.5 on [0.5, 0.25, 0.25] keeps the first alone, as top_k
    1 does (log-prob 0); a top_p above 1 is refused."""
    gens = [torch.Generator().manual_seed(i) for i in range(300)]
    token, logp = rollout._sample_next(torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(300, 1), [], 1.0, 1.0, 3, gens)
    assert 0 not in token.tolist() and torch.allclose(logp, torch.tensor([1.0, 2.0, 3.0]).log_softmax(-1)[token - 1])
    token, logp = rollout._sample_next(torch.tensor([[2.0, 1.0, 1.0]]).log().repeat(300, 1), [], 1.0, 0.5, -1, gens)
    assert token.tolist() == [0] * 300 and logp.abs().max() < 1e-6
    token, logp = rollout._sample_next(torch.tensor([[2.0, 1.0, 1.0]]).log().repeat(300, 1), [], 1.0, 1.0, 1, gens)
    assert token.tolist() == [0] * 300 and logp.abs().max() < 1e-6
    with pytest.raises(ValueError, match=r"top_p=1.2 \(in \(0, 1\]\)"):
        rollout._check_sampling([], 1, 1.0, 1.2, 4, "prompt_ids")


def test_eos_list_from_the_tokenizer_folders_generation_config_when_the_model_has_none(toy, tmp_path):
    """A model folder without generation_config.json: the EOS list comes from the tokenizer folder's one."""
    shutil.copytree(toy["vl_model"], tmp_path / "m", ignore=lambda d, names: ["generation_config.json"])
    _, _, eos, banned, pad = rollout._load_config(config(), str(tmp_path / "m"), toy["vl_model"])
    assert (eos, banned, pad) == ([IM_END, ENDOFTEXT], [IMAGE_PAD, VIDEO_PAD], ENDOFTEXT)


def test_the_tokenizers_eos_ends_a_response_also_when_the_generation_config_lists_others(toy, world, tmp_path):
    """vLLM stops at the tokenizer's EOS as well as the generation config's (SamplingParams.update_from_generation_
    config): with a generation config of [<|endoftext|>] and a tokenizer whose EOS is <|im_end|>, a response ends at
    <|im_end|> as "stop" in both engines, not run to max_tokens and called truncated."""
    shutil.copytree(toy["vl_model"], tmp_path / "m")
    path = tmp_path / "m" / "generation_config.json"
    path.write_text(re.sub(r'"eos_token_id": \[[^\]]*\]', f'"eos_token_id": [{ENDOFTEXT}]', path.read_text()))
    assert rollout._load_config(config(), str(tmp_path / "m"), str(tmp_path / "m"))[2] == [ENDOFTEXT, IM_END]
    engine = rollout.make_rollout(config(), str(tmp_path / "m"), max_prompt_length=64, max_response_length=4,
                                  device="cpu")
    fresh(engine, world, prefer={IM_END: 5.0})
    out = engine.generate(world.prompts, n=1, temperature=1.0, max_tokens=4, seed=0)
    assert [(r["response_ids"], r["finish_reason"]) for r in out] == [([IM_END], "stop")] * 3


def test_top_p_and_top_k_act_on_the_tempered_distribution_and_top_k_0_is_off():
    """z = [1, 0] at T = 2: softmax(z / T) = [0.6225, 0.3775]; the mass before token 1 (0.6225) is below top_p 0.7,
    so both tokens are kept: logp(0) = log 0.6225 = -0.47408, logp(1) = -0.97408 (on the untempered softmax,
    [0.7311, 0.2689], token 1 would be cut). top_k 0 is off, as -1: z = [1, 0, 2] keeps all three, logp of the
    drawn token 2 = 2 - log(e + 1 + e^2) = -0.40761."""
    gens = [torch.Generator().manual_seed(i) for i in range(2000)]
    token, logp = rollout._sample_next(torch.tensor([[1.0, 0.0]]).repeat(2000, 1), [], 2.0, 0.7, -1, gens)
    assert set(token.tolist()) == {0, 1}
    assert math.isclose(logp[token == 0][0].item(), -0.47408, abs_tol=1e-4)
    assert math.isclose(logp[token == 1][0].item(), -0.97408, abs_tol=1e-4)
    for k in (0, -1):
        token, logp = rollout._sample_next(torch.tensor([[1.0, 0.0, 2.0]]), [], 1.0, 1.0, k,
                                           [torch.Generator().manual_seed(0)])
        assert token.tolist() == [2] and math.isclose(logp.item(), -0.40761, abs_tol=1e-4), k


def test_decoding_stops_once_rows_that_ended_at_different_steps_have_all_ended():
    """Greedy, EOS 9: row 0 says 9 at once, row 1 says 1, 1, 9. Decoding ends after step 2: a prefill and two
    decode forwards (not max_tokens = 6), responses [9] and [1, 1, 9]."""
    engine = rollout.HFRollout.__new__(rollout.HFRollout)
    engine.device, engine.max_response_length, engine.batch_size = torch.device("cpu"), 6, 64
    engine.ignore_eos, engine.position_rows, engine.new_cache = False, 1, lambda: None
    engine.eos_ids, engine.banned_ids, engine.pad_id = [9], [], 0
    engine.model = types.SimpleNamespace(to=lambda d: None)
    calls = []

    def forward(input_ids, mask, positions, cache, mm):  # [2, vocab 10] logits of the next token
        calls.append(step := len(calls))
        logits = torch.zeros(2, 10)
        logits[0, 9 if step == 0 else 1] = 10.0
        logits[1, 9 if step == 2 else 1] = 10.0
        return logits

    engine._forward = forward
    out = engine.generate([{"uid": "a", "prompt_ids": [3]}, {"uid": "b", "prompt_ids": [4]}], n=1, temperature=0)
    assert [r["response_ids"] for r in out] == [[9], [1, 1, 9]] and len(calls) == 3


def test_tp_gather_takes_the_first_ranks_seed_and_this_ranks_offset(monkeypatch):
    """Rank 1 of a TP group of 2; rank 0 brings 3 prompts and seed 11, rank 1 2 prompts and seed 22: the group
    generates the 5 prompts with seed 11 (the same requests on both ranks of the SPMD engine), rank 1's share
    starting at 3."""
    tp = types.SimpleNamespace(world_size=2, rank_in_group=1, cpu_group=None)
    monkeypatch.setattr(rollout, "_vllm_internals", lambda llm: {"tp_group": tp})
    a, b = [{"uid": f"a{i}"} for i in range(3)], [{"uid": f"b{i}"} for i in range(2)]

    def all_gather_object(out, obj, group=None):
        assert obj == (b, 22)
        out[:] = [(a, 11), (b, 22)]

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    engine = rollout.VLLMRollout.__new__(rollout.VLLMRollout)
    engine.llm = None
    assert engine._gather_tp_group(b, 22) == (a + b, 3, 11)


def test_vllm_sample_j_of_prompt_i_is_seeded_as_the_transformers_engine_seeds_it():
    """The vLLM engine sends one request per sample, request k = i * n + j seeded derive_seed(seed, i, j): the
    documented blake2b of repr((seed, i, j)) >> 2, as the transformers engine seeds its rows."""
    import hashlib

    params = []
    engine = rollout.VLLMRollout.__new__(rollout.VLLMRollout)
    engine.cfg, engine.max_response_length, engine.eos_ids = config(), 4, [IM_END]
    engine.bias, engine.synced, engine.asleep, engine.SamplingParams = None, True, set(), lambda **kw: kw
    done = types.SimpleNamespace
    engine.llm = done(generate=lambda reqs, ps, use_tqdm=False: params.extend(ps) or [
        done(outputs=[done(token_ids=[IM_END], logprobs=[{IM_END: done(logprob=-1.0)}])]) for _ in reqs])
    engine._gather_tp_group = lambda prompts, seed: (prompts, 0, seed)
    engine.generate([{"uid": "a", "raw_prompt_ids": [3]}, {"uid": "b", "raw_prompt_ids": [4]}], n=3, seed=7)
    blake = [int.from_bytes(hashlib.blake2b(repr((7, i, j)).encode(), digest_size=8).digest(), "little") >> 2
             for i in range(2) for j in range(3)]
    assert [p["seed"] for p in params] == blake and len(set(blake)) == 6
