"""rollout.py on Qwen2-VL and Qwen3-VL: each engine's log-probs equal a transformers forward of data.py's prompts
(two images, a video, text) for a tiny random model of the family. Equal log-probs mean the engine saw the same
tokens at the same positions as the actor will: for vLLM, which expands each raw placeholder itself (Qwen3-VL: a
timestamp before each temporal patch), that its expansion and data.py's agree. The toy's family, Qwen2.5-VL, is
checked in tests/test_rollout.py."""

import json
import os

import pytest
import torch

import rollout
from conftest import leave_rank, run_ranks
from test_data import builder, clip, png
from test_data import config as data_config
from test_data_families import tiny_family
from test_rollout import HF_TOL, VLLM_TOL, config, reference_logprobs

FAMILIES = ["qwen2_vl", "qwen3_vl"]
TEXT_FAMILIES = {"granite": {"logits_scaling": 8.0}, "cohere": {"logit_scale": 0.0625},
                 "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}}


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_engine_on_the_family(family, toy, tmp_path):
    gap = sample_family(family, "hf", toy["vl_model"], str(tmp_path))
    assert gap < HF_TOL, f"max |logp_rollout - logp_reference| = {gap}"


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_engine_on_the_family(family, toy, tmp_path):
    """In a process of its own: vLLM's sleep-mode allocator allows one engine per process. On one H200 (vLLM 0.24)
    every log-prob was within 1e-6 of transformers'; a Qwen3-VL video prompt with the chat template's pair of
    vision tokens kept around its placeholder (transformers 5's processor keeps it, vLLM drops it) was 0.042 off."""
    pytest.importorskip("vllm", reason="vLLM is not installed (GPU extra: requirements-gpu.txt)")
    if not torch.cuda.is_available():
        pytest.skip("the vLLM engine needs a CUDA GPU")
    assert run_ranks(sample_family, [(family, "vllm", toy["vl_model"], str(tmp_path))], timeout=600) == [0]
    gap = json.load(open(tmp_path / "gap.json"))
    assert gap < VLLM_TOL, f"max |logp_rollout - logp_reference| = {gap}"


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_vllm_engine_on_text_families(family, toy, tmp_path):
    """Text families whose forward changes the logits (Granite, Cohere: the actor applies the same change, checked
    in tests/test_actor_families.py) and a mixture of experts, whose experts transformers holds fused and the engine
    splits as transformers saves them: vLLM's log-probs equal transformers' forward."""
    pytest.importorskip("vllm", reason="vLLM is not installed (GPU extra: requirements-gpu.txt)")
    if not torch.cuda.is_available():
        pytest.skip("the vLLM engine needs a CUDA GPU")
    assert run_ranks(sample_text_family, [(family, toy["text_model"], str(tmp_path))], timeout=600) == [0]
    gap = json.load(open(tmp_path / "gap.json"))
    assert gap < VLLM_TOL, f"max |logp_rollout - logp_reference| = {gap}"


def sample_text_family(family, toy_model, folder):
    """Two sampled responses to each of two prompts from vLLM on a tiny `family` text model, the weights streamed
    under transformers' in-memory names; the largest |logp - reference| written to folder/gap.json."""
    import shutil

    from test_actor_families import tiny_text_family

    model = tiny_text_family(family, folder, **TEXT_FAMILIES[family])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(os.path.join(toy_model, name), folder)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29522")
    engine = rollout.make_rollout(config(name="vllm", gpu_memory_utilization=0.05), folder, max_prompt_length=32,
                                  max_response_length=8, device="cuda")
    engine.load_weights(iter(model.state_dict().items()))
    prompts = [{"uid": u, "prompt_ids": ids, "raw_prompt_ids": ids} for u, ids in (("a", [5, 17, 40, 99, 3]),
                                                                                    ("b", [60, 61, 62]))]
    gap = max((torch.tensor(r["logprobs"]) - reference_logprobs(model, prompts[r["prompt_index"]], r["response_ids"],
                                                                1.0, banned=())).abs().max().item()
              for r in engine.generate(prompts, n=2, max_tokens=8, seed=3))
    with open(os.path.join(folder, "gap.json"), "w") as f:
        json.dump(gap, f)
    leave_rank()


def sample_family(family, name, toy_model, folder):
    """Two sampled responses to each of three data.py prompts from the `name` engine on a tiny `family` model;
    -> the largest |logp - reference| (vllm: written to folder/gap.json, in a spawned process)."""
    path = os.path.join(folder, family)
    model, _ = tiny_family(family, path, {"vl_model": toy_model})
    build = builder(path, data_config(min_pixels=4096, max_pixels=16384, max_prompt_length=1024)).build
    rows = [{"problem": "<image>What is <image> 3 + 4?", "answer": "7", "images": [png(64, 64), png(200, 90)]},
            {"problem": "What is 3 + 4?", "answer": "7"},
            {"problem": "<video>Which colour, <image>?", "answer": "red", "images": [png(64, 64)],
             "videos": [clip(8, size=(64, 64), fps=4)]}]
    prompts = [build(row, i, f"r{i}") for i, row in enumerate(rows)]
    device = "cuda" if name == "vllm" else "cpu"
    if name == "vllm":
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29521")
    cfg = config(name=name, limit_images=2, limit_videos=1, gpu_memory_utilization=0.05)  # 7 GB of 140
    engine = rollout.make_rollout(cfg, path, max_prompt_length=1024, max_response_length=8, device=device)
    engine.load_weights(iter(model.state_dict().items()))  # vLLM starts from random weights
    responses = engine.generate(prompts, n=2, max_tokens=8, seed=3)
    assert [r["uid"] for r in responses] == ["0-0", "0-0", "0-1", "0-1", "0-2", "0-2"]
    gap = max((torch.tensor(r["logprobs"]) - reference_logprobs(model, prompts[r["prompt_index"]], r["response_ids"],
                                                                1.0)).abs().max().item() for r in responses)
    if name == "hf":
        return gap
    with open(os.path.join(folder, "gap.json"), "w") as f:  # closed before leave_rank's os._exit
        json.dump(gap, f)
    leave_rank()
