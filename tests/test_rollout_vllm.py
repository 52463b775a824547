"""rollout.py's vLLM engine without vLLM or a GPU: a stand-in vLLM module records what the engine hands it (init
arguments, requests, sampling parameters) and models the sleep mode's allocator. The engine's log-probs on real vLLM
are checked by tests/test_rollout.py's engine tests, and override_config's effect by the last test here, where vLLM
and a GPU are present."""

import json
import os
import random
import sys
import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

import modeling
import rollout
import toy as toy_world
from conftest import leave_rank, run_ranks
from test_rollout import ENDOFTEXT, IM_END, IMAGE_PAD, VIDEO_PAD, VLLM_TOL, config, make_prompt, reference_logprobs


def fake_vllm(monkeypatch):
    """A stand-in vLLM module; -> the dict where its LLM records its init kwargs and requests. Sleep mode as vLLM's
    CuMemAllocator does it: sleep() releases every allocation (one already released is an error), wake_up(tags)
    maps those tags again; the prefix and encoder cache resets are listed in calls["resets"]."""
    calls = {"resets": []}

    class FakeLLM:
        def __init__(self, **kwargs):
            calls["init"], calls["awake"] = kwargs, {"weights", "kv_cache"}
            model = types.SimpleNamespace(load_weights=lambda named: list(named))
            runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(model=model))
            executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=runner))
            self.llm_engine = types.SimpleNamespace(model_executor=executor,
                                                    reset_encoder_cache=lambda: calls["resets"].append("encoder"))

        def sleep(self, level):
            assert calls["awake"] == {"weights", "kv_cache"}, f"sleep() with only {calls['awake']} mapped"
            calls["awake"] = set()

        def wake_up(self, tags=None):
            calls["awake"] |= set(tags or ("weights", "kv_cache"))

        def reset_prefix_cache(self):
            calls["resets"].append("prefix")

        def generate(self, requests, params, use_tqdm):
            calls["requests"] = requests
            step = {IM_END: types.SimpleNamespace(logprob=-0.5)}
            done = types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[IM_END], logprobs=[step])])
            return [done] * len(requests)

    parallel_state = types.SimpleNamespace(model_parallel_is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw: kw))
    monkeypatch.setitem(sys.modules, "vllm.distributed", types.SimpleNamespace(parallel_state=parallel_state))
    return calls


def test_vllm_sleeps_whole_after_a_weight_sync_without_generation(toy, monkeypatch):
    """The engine's settings (processed log-probs, the context, dtype, override_config as hf_overrides); load_weights
    wakes only the weights; a sleep() right after (no wake_up, no generate) must still release them, which vLLM's
    sleep does only for a wholly awake engine. Each sleep empties the prefix and encoder caches, which hold results
    of the weights before the next sync."""
    calls = fake_vllm(monkeypatch)
    engine = rollout.make_rollout(config(name="vllm", override_config={"rms_norm_eps": 0.5}), toy["vl_model"],
                                  max_prompt_length=64, max_response_length=8, device="cuda")
    init = calls["init"]  # the log-probs after temperature (the ratio's denominator), 64 + 8 tokens of context
    assert (init["logprobs_mode"], init["max_model_len"], init["dtype"]) == ("processed_logprobs", 72, "float32")
    assert init["hf_overrides"] == {"text_config": {"rms_norm_eps": 0.5}} and init["load_format"] == "dummy"
    assert calls["awake"] == set()  # asleep from the start
    engine.load_weights(iter([]))
    assert calls["awake"] == {"weights"}
    engine.sleep()
    assert calls["awake"] == set() and calls["resets"] == ["prefix", "encoder"]
    engine.wake_up()
    engine.sleep()
    assert calls["awake"] == set() and calls["resets"] == ["prefix", "encoder"] * 2


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_vllm_requests_carry_videos_and_limit_them_as_the_data_does(family, toy, tmp_path, monkeypatch):
    """No GPU needed: a stand-in vLLM records what the engine hands it. Videos go as multi_modal_data
    {"video": ...}; for Qwen3-VL each with its metadata and do_sample_frames False (frames are sampled
    already), as EasyR1 sends them; for Qwen2.5-VL the metadata goes as the processor's video_metadata (vLLM
    0.24 drops it from a (video, metadata) pair there, and the processor then takes 24 fps for the time
    positions); for Qwen2-VL, whose temporal positions count frame pairs, not seconds, the frames alone;
    limit_mm_per_prompt allows as many videos as the data has (0 without), and limit_images images (0: none named,
    vLLM's default)."""
    import numpy
    from transformers import AutoConfig, Qwen2VLConfig, Qwen3VLConfig

    calls = fake_vllm(monkeypatch)
    path = toy["vl_model"]
    if family != "qwen2_5_vl":
        path = str(tmp_path / family)
        family_config = Qwen3VLConfig if family == "qwen3_vl" else Qwen2VLConfig
        family_config(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD).save_pretrained(path)
    assert AutoConfig.from_pretrained(path).model_type == family
    frames = numpy.zeros((4, 56, 56, 3), numpy.uint8)
    metadata = {"fps": 2.0, "duration": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3],
                "video_backend": "pyav"}
    prompts = [{"uid": "v", "raw_prompt_ids": [1, 3, VIDEO_PAD, 4, 9], "images": [], "videos": [frames, frames],
                "video_metadata": [metadata, metadata]},
               {"uid": "t", "raw_prompt_ids": [1, 9], "images": [], "videos": [], "video_metadata": []}]
    for limit, images in ((0, 0), (2, 1)):
        cfg = config(name="vllm", limit_images=images)
        if limit:
            cfg.limit_videos = limit  # the trainer sets it from the data
        engine = rollout.make_rollout(cfg, path, max_prompt_length=64, max_response_length=8, device="cuda",
                                      tokenizer_path=toy["vl_model"])
        assert calls["init"]["limit_mm_per_prompt"] == ({"video": 2, "image": 1} if limit else {"video": 0})
    engine.load_weights(iter([]))
    out = engine.generate(prompts, n=1, max_tokens=4, seed=0)
    assert [r["response_ids"] for r in out] == [[IM_END], [IM_END]]
    video, text = calls["requests"]
    assert "multi_modal_data" not in text and video["prompt_token_ids"] == [1, 3, VIDEO_PAD, 4, 9]
    sent = video["multi_modal_data"]["video"]
    if family == "qwen3_vl":
        assert [m for _, m in sent] == [{**metadata, "do_sample_frames": False}] * 2
        sent = [v for v, _ in sent]
    assert len(sent) == 2 and all(v is frames for v in sent)
    kwargs = {"video_metadata": [metadata, metadata]} if family == "qwen2_5_vl" else None
    assert video.get("mm_processor_kwargs") == kwargs and "mm_processor_kwargs" not in text
    with pytest.raises(ValueError, match="max_tokens=0"):  # not max_response_length
        engine.generate(prompts, n=1, max_tokens=0)
    with pytest.raises(ValueError, match="prompt 1 .uid t. has an empty raw_prompt_ids"):
        engine.generate([prompts[0], {**prompts[1], "raw_prompt_ids": []}], n=1, max_tokens=4)


def test_vllm_refuses_a_context_longer_than_the_model_before_starting(toy, monkeypatch):
    """prompt + response (or worker.rollout.max_model_len) beyond the model's max_position_embeddings (32768 for
    the toy) is an error naming the keys and the model, raised before vLLM is imported (vLLM's own check fails
    later, inside a Ray worker, as a pydantic error); VLLM_ALLOW_LONG_MAX_MODEL_LEN lets it through, as in vLLM.
    A text config whose rope_parameters carry a scaling factor (YaRN x 2: 65536 positions) goes to vLLM, whose own
    check scales the limit, with the whole context and the rope parameters as hf_overrides."""
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}
    calls = fake_vllm(monkeypatch)
    rollout.make_rollout(config(name="vllm", override_config={"rope_parameters": yarn}), toy["vl_model"],
                         max_prompt_length=32768, max_response_length=4096, device="cuda")
    assert calls["init"]["max_model_len"] == 36864
    rope = calls["init"]["hf_overrides"]["text_config"]["rope_parameters"]
    assert rope == {"mrope_section": [2, 3, 3], "rope_theta": 10000.0, **yarn}
    for cfg, length in ((config(name="vllm"), 36864), (config(name="vllm", max_model_len=40000), 40000)):
        with pytest.raises(ValueError, match=f"context of {length} tokens .worker.rollout.max_model_len, else "
                                             r"data.max_prompt_length \+ max_response_length. exceeds the 32768"):
            rollout.make_rollout(cfg, toy["vl_model"], max_prompt_length=32768, max_response_length=4096,
                                 device="cuda")
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    monkeypatch.setitem(sys.modules, "vllm", None)  # the import is the next thing that runs: it fails
    with pytest.raises(ImportError, match="needs vLLM"):
        rollout.make_rollout(config(name="vllm"), toy["vl_model"], max_prompt_length=32768, max_response_length=4096,
                             device="cuda")


def test_vllm_sampling_params_of_each_request(toy, monkeypatch):
    """One request per sample, seeded derive_seed(seed, i, j), with the settings, the EOS list and the -100 ban."""
    fake_vllm(monkeypatch)
    prompts = [{"uid": "x", "raw_prompt_ids": [1, 9]}, {"uid": "y", "raw_prompt_ids": [1, 10]}]
    for ignore_eos, stop in ((False, [IM_END, ENDOFTEXT]), (True, [])):
        engine = rollout.make_rollout(config(name="vllm", ignore_eos=ignore_eos), toy["vl_model"],
                                      max_prompt_length=64, max_response_length=8, device="cuda")
        with pytest.raises(RuntimeError, match="load_weights"):
            engine.generate(prompts, n=1)
        engine.load_weights(iter([]))
        seen, generate = [], engine.llm.generate
        engine.llm.generate = lambda reqs, params, use_tqdm: seen.append((reqs, params)) or generate(reqs, params, 0)
        out = engine.generate(prompts, n=2, temperature=0.5, top_p=0.9, top_k=7, max_tokens=3, seed=4)
        assert [r["uid"] for r in out] == ["x", "x", "y", "y"]
        (requests, params), = seen
        assert [r["prompt_token_ids"] for r in requests] == [[1, 9], [1, 9], [1, 10], [1, 10]]
        assert params == [dict(n=1, temperature=0.5, top_p=0.9, top_k=7, max_tokens=3, logprobs=0, detokenize=False,
                               seed=rollout.derive_seed(4, i, j), ignore_eos=ignore_eos, stop_token_ids=stop,
                               logit_bias={IMAGE_PAD: -100.0, VIDEO_PAD: -100.0}) for i in (0, 1) for j in (0, 1)]
    with pytest.raises(ValueError, match="n=0"):
        engine.generate(prompts, n=0)
    with pytest.raises(KeyError, match=r"prompt 1 lacks \['uid'\]"):
        engine.generate([prompts[0], {"raw_prompt_ids": [1]}])


def test_vllm_samples_from_the_model_with_its_override_config(toy, tmp_path):
    """With vLLM and a GPU: override_config {rms_norm_eps: 0.5} reaches vLLM's model (as hf_overrides): its fp32
    log-probs equal those of a transformers forward of the model built with it, and stay far from the model
    without it (0.35 apart on this toy). In a process of its own: vLLM's sleep-mode allocator allows one engine per
    process, and test_rollout.py's may be alive."""
    pytest.importorskip("vllm", reason="vLLM is not installed (GPU extra: requirements-gpu.txt)")
    if not torch.cuda.is_available():
        pytest.skip("the vLLM engine needs a CUDA GPU")
    assert run_ranks(sample_with_override, [(toy["vl_model"], str(tmp_path / "gaps.json"))], timeout=600) == [0]
    gaps = json.load(open(tmp_path / "gaps.json"))
    assert gaps["with"] < VLLM_TOL and gaps["without"] > 0.1, gaps


def sample_with_override(path, out):
    """The vLLM engine with override_config {rms_norm_eps: 0.5}: -> out, the largest |logp - reference| against
    transformers' model with the override and without it."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29519")
    plain = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    changed_config = AutoConfig.from_pretrained(path)
    modeling.apply_overrides(changed_config, {"rms_norm_eps": 0.5})
    changed = AutoModelForImageTextToText.from_pretrained(path, config=changed_config, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    prompts = [make_prompt(processor, changed, "What colour is the square?",
                           toy_world.color_image("red", random.Random(0)), "a"),
               make_prompt(processor, changed, "What is 3 + 4?", None, "b")]
    cfg = config(name="vllm", override_config={"rms_norm_eps": 0.5}, gpu_memory_utilization=0.05)  # 7 GB of 140
    engine = rollout.make_rollout(cfg, path, max_prompt_length=64, max_response_length=8, device="cuda")
    engine.load_weights(iter(plain.state_dict().items()))
    responses = engine.generate(prompts, n=2, max_tokens=8, seed=3)
    gaps = {name: max((torch.tensor(r["logprobs"]) - reference_logprobs(model, prompts[r["prompt_index"]],
                                                                      r["response_ids"], 1.0)).abs().max().item()
                      for r in responses) for name, model in (("with", changed), ("without", plain))}
    with open(out, "w") as f:  # closed before leave_rank's os._exit
        json.dump(gaps, f)
    leave_rank()


@pytest.mark.parametrize("family, changes, split", [
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "mlp.experts.3.gate_proj"),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), "block_sparse_moe.experts.3.w1")])
def test_vllm_gets_a_mixture_of_experts_weights_as_transformers_saves_them(family, changes, split, toy, tmp_path,
                                                                          monkeypatch):
    """transformers holds a mixture's experts fused ([experts, 2 x inner, hidden]) and saves one tensor per expert,
    as vLLM reads them: the weight sync hands vLLM exactly the saved file's names and tensors (before, the fused
    in-memory names, which vLLM's loader for checkpoints does not know; then Mixtral's router still went under its
    in-memory name mlp.gate, where vLLM's Mixtral has block_sparse_moe.gate)."""
    from safetensors.torch import load_file

    model = _tiny_text_folder(family, tmp_path, toy, **changes)
    got = _streamed(model, tmp_path, monkeypatch)
    saved = load_file(tmp_path / "model.safetensors")
    assert f"model.layers.0.{split}.weight" in saved and got.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(got[name], tensor), name


def test_vllm_gets_qwen2_5_vl_weights_under_their_saved_names(toy, monkeypatch):
    """transformers 5 holds Qwen2.5-VL as model.language_model.* and model.visual.*, and saves the checkpoint layout
    (model.layers.*, visual.*) that the hub's models have and vLLM reads: the sync streams that layout."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    got = _streamed(AutoModelForImageTextToText.from_pretrained(toy["vl_model"]), toy["vl_model"], monkeypatch)
    saved = load_file(os.path.join(toy["vl_model"], "model.safetensors"))
    assert "visual.blocks.0.attn.qkv.weight" in saved and got.keys() == saved.keys()
    assert all(torch.equal(got[name], tensor) for name, tensor in saved.items())


def test_a_tensor_that_the_save_changes_under_its_own_name_goes_changed(toy, tmp_path, monkeypatch):
    """Only a save that keeps the tensor itself is taken for a rename; one that changes it under the same name (a
    transpose or a rope permutation, in some families' conversions) goes through the conversion at every sync.
    Stand-in: a save that transposes lm_head.weight."""
    model = _tiny_text_folder("qwen3", tmp_path, toy)
    save = rollout.revert_weight_conversion
    monkeypatch.setattr(rollout, "revert_weight_conversion", lambda m, tensors: {
        k: v.t() if k == "lm_head.weight" else v for k, v in save(m, tensors).items()})
    assert torch.equal(_streamed(model, tmp_path, monkeypatch)["lm_head.weight"], model.lm_head.weight.t())


def _tiny_text_folder(family, path, toy, **changes):
    """A tiny random text model of `family` saved in `path` with the toy's tokenizer; -> the model."""
    from test_actor_families import tiny_text_family

    model = tiny_text_family(family, str(path), **changes)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        open(os.path.join(path, name), "wb").write(open(os.path.join(toy["text_model"], name), "rb").read())
    return model


def _streamed(model, folder, monkeypatch):
    """{name: tensor} that the stand-in vLLM engine on `folder` receives from one weight sync of `model`'s state."""
    fake_vllm(monkeypatch)
    engine = rollout.make_rollout(config(name="vllm"), str(folder), max_prompt_length=32, max_response_length=8,
                                  device="cuda")
    got = {}
    monkeypatch.setattr(rollout._vllm_internals(engine.llm)["model"], "load_weights", got.update)
    engine.load_weights(iter(model.state_dict().items()))
    return got
