"""actor.py, the model side: packing, attention isolation, response-only log-probs, FSDP2 on gloo ranks,
LoRA, checkpoints. The independent reference is a plain transformers forward of ONE sequence at a time
(attn_implementation="sdpa", no packing, full logits).

Tolerances (fp32 on the CPU): log-probs atol 1e-5; gradients rtol 1e-4 + atol 1e-6. Without sequence
isolation the packed log-probs of the toy model are off by ~0.1, so these tolerances can fail.
"""

import os
import sys
import time
import traceback
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import actor  # noqa: E402
import modeling  # noqa: E402
from config import ActorConfig, FSDPConfig, LoraConfig, ModelConfig, OptimConfig  # noqa: E402
from conftest import leave_rank  # noqa: E402

TEMPERATURE = 0.7
LOGP_ATOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


def actor_config(model_path, **overrides):
    """config.ActorConfig for the CPU: fp32 everywhere, no gradient checkpointing, small batches, lr 1e-2."""
    cfg = ActorConfig(global_batch_size=4, max_tokens_per_micro_batch=4096,
                      model=ModelConfig(model_path=model_path, enable_gradient_checkpointing=False),
                      optim=OptimConfig(lr=1e-2, weight_decay=0.0),
                      fsdp=FSDPConfig(torch_dtype="fp32", mp_param_dtype="fp32"))
    for key, value in overrides.items():  # "a.b.c": value
        *parents, leaf = key.split(".")
        target = cfg
        for part in parents:
            target = getattr(target, part)
        setattr(target, leaf, value)
    return cfg


def make_actor(model_path, device="cpu", **overrides):
    return actor.Actor(actor_config(model_path, **overrides), temperature=TEMPERATURE, max_prompt_length=64,
                       max_response_length=8, n_per_prompt=1, training_steps=10, device=device)


# ----------------------------------------------------------------------------------------------
# Samples built the way data.py + the rollout do: processor, get_rope_index, random responses
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vl(toy):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(toy["vl_model"])
    model = AutoModelForImageTextToText.from_pretrained(toy["vl_model"], dtype=torch.float32,
                                                        attn_implementation="sdpa")
    return SimpleNamespace(path=toy["vl_model"], processor=processor, model=model)


def vl_sample(vl, image_size, response_len, seed, text="What colour is the square?"):
    """image_size None = text only. 56x56 -> 4 image tokens (one vision window), 112x56 -> 8 (two windows)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    content = ([{"type": "image"}] if image_size else []) + [{"type": "text", "text": text}]
    prompt = vl.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                              tokenize=False)
    image = [Image.new("RGB", image_size, tuple(torch.randint(0, 255, (3,), generator=g).tolist()))] \
        if image_size else None
    enc = vl.processor(text=[prompt], images=image, return_tensors="pt")
    ids = enc["input_ids"][0]
    mm = {k: enc[k] for k in ("pixel_values", "image_grid_thw") if k in enc}
    mrope, _ = vl.model.model.get_rope_index(ids[None], enc["mm_token_type_ids"], mm.get("image_grid_thw"),
                                             attention_mask=torch.ones_like(ids)[None])
    position_ids = torch.cat([torch.arange(len(ids))[None], mrope[:, 0]])  # [4, P]: text row + t/h/w
    response = torch.randint(10, 160, (response_len,), generator=g).tolist()
    return {"prompt_ids": ids.tolist(), "response_ids": response, "multi_modal_inputs": mm,
            "position_ids": position_ids, "mm_token_type_ids": enc["mm_token_type_ids"]}


def vl_video_sample(vl, frames, response_len, seed, image_size=None):
    """A video prompt (frames [T, H, W, 3] uint8, sampled at 2 fps from a 2 fps clip), optionally with an image
    first. second_per_grid_ts rides along in multi_modal_inputs for the reference forward (the actor ignores it)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    content = ([{"type": "image"}] if image_size else []) + [{"type": "video"}, {"type": "text", "text": "Colour?"}]
    prompt = vl.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                              tokenize=False)
    image = [Image.new("RGB", image_size, (200, 30, 30))] if image_size else None
    metadata = {"fps": 2.0, "total_num_frames": len(frames), "frames_indices": list(range(len(frames)))}
    enc = vl.processor(text=[prompt], images=image, videos=[frames], video_metadata=[metadata],
                       do_sample_frames=False, return_tensors="pt")
    ids = enc["input_ids"][0]
    mm = {k: enc[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                              "second_per_grid_ts") if k in enc}
    mrope, _ = vl.model.model.get_rope_index(ids[None], enc["mm_token_type_ids"], mm.get("image_grid_thw"),
                                             mm["video_grid_thw"], mm["second_per_grid_ts"],
                                             attention_mask=torch.ones_like(ids)[None])
    response = torch.randint(10, 160, (response_len,), generator=g).tolist()
    return {"prompt_ids": ids.tolist(), "response_ids": response, "multi_modal_inputs": mm,
            "position_ids": torch.cat([torch.arange(len(ids))[None], mrope[:, 0]]),
            "mm_token_type_ids": enc["mm_token_type_ids"]}


def text_sample(response_len, seed, prompt_len=9):
    g = torch.Generator().manual_seed(seed)
    return {"prompt_ids": torch.randint(10, 160, (prompt_len,), generator=g).tolist(),
            "response_ids": torch.randint(10, 160, (response_len,), generator=g).tolist()}


def token_weights(samples):
    """Fixed per-token weights w for the test loss sum(w * logp)."""
    return [torch.linspace(-1.0, 1.0, len(s["response_ids"])) * (i + 1) for i, s in enumerate(samples)]


def reference_log_probs(model, sample, is_vl):
    """Plain transformers forward of one sequence, full logits: log softmax(logits / T) at the response."""
    ids = torch.tensor([sample["prompt_ids"] + sample["response_ids"]])
    extra = {}
    if is_vl:
        response_types = torch.zeros(1, len(sample["response_ids"]), dtype=sample["mm_token_type_ids"].dtype)
        extra = {**sample["multi_modal_inputs"],
                 "mm_token_type_ids": torch.cat([sample["mm_token_type_ids"], response_types], 1)}
    logits = model(input_ids=ids, **extra).logits[0].float() / TEMPERATURE  # [L, V]
    p = len(sample["prompt_ids"])
    return torch.log_softmax(logits[p - 1:-1], -1).gather(-1, torch.tensor(sample["response_ids"])[:, None])[:, 0]


def packed_backward(a, samples, weights):
    """sum(w * logp) over this rank's samples through the actor's own micro-batching, backward x world size
    (FSDP averages gradients), so the gradient is that of the loss summed over every rank's samples."""
    modalities = a._modalities(samples)
    for part in a._plan(samples, "update"):
        batch = a._pack(samples, part)
        logp, _ = a._forward(batch, False, modalities)
        w = torch.cat([weights[i] for i in part]).to(logp.device) if part else torch.zeros_like(logp)
        ((logp * w).sum() * a.world).backward()


def full_grads(a):
    return {n: modeling.full_tensor(p.grad, torch.device("cpu")).clone() for n, p in a.hf.named_parameters()
            if p.grad is not None}


def assert_grads_close(got, expected, atol=GRAD_ATOL):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=GRAD_RTOL, atol=atol, msg=name)


def assert_packed_equals_per_sequence(a, model, samples, weights, grad_atol=GRAD_ATOL):
    """The actor's packed log-probs and gradients of sum(w * logp) equal the per-sequence forward of `model` (a
    VL model); returns the reference gradients. `model`'s gradients are left cleared."""
    logps = a.compute_log_probs(samples)
    packed_backward(a, samples, weights)
    model.zero_grad()
    for s, lp, w in zip(samples, logps, weights):
        ref = reference_log_probs(model, s, is_vl=True)
        torch.testing.assert_close(lp, ref.detach(), rtol=0, atol=LOGP_ATOL)
        (ref * w).sum().backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert_grads_close(full_grads(a), expected, grad_atol)
    model.zero_grad()
    return expected


# ----------------------------------------------------------------------------------------------
# No model: packing and balancing by hand
# ----------------------------------------------------------------------------------------------

def test_pack_samples_layout_by_hand():
    s0 = {"prompt_ids": [5, 6, 7], "response_ids": [8, 9],
          "position_ids": torch.tensor([[0, 1, 2], [0, 1, 1], [0, 0, 1], [0, 5, 6]])}
    s1 = {"prompt_ids": [1, 2], "response_ids": [3], "position_ids": torch.tensor([[0, 1]])}
    b = modeling.pack_samples([s0, s1], is_vl=True, image_token_id=99, video_token_id=98, merge=2)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3]]
    assert b["position_ids"].shape == (4, 1, 8)
    assert b["position_ids"][:, 0].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 1, 2, 3, 0, 1, 2],
                                                [0, 0, 1, 2, 3, 0, 1, 2], [0, 5, 6, 7, 8, 0, 1, 2]]
    assert b["cu_seqlens"].tolist() == [0, 5, 8] and b["max_seqlen"] == 5
    assert b["resp_index"].tolist() == [2, 3, 6]  # the token before each response token, per sequence
    assert b["labels"].tolist() == [8, 9, 3]
    assert b["resp_cu_seqlens"].tolist() == [0, 2, 3]
    text = modeling.pack_samples([{"prompt_ids": [4, 4], "response_ids": []}], is_vl=False)
    assert text["position_ids"].tolist() == [[0, 1]] and text["resp_index"].numel() == 0


def test_pack_samples_rejects_mismatched_image_tokens():
    mm = {"pixel_values": torch.zeros(16, 8), "image_grid_thw": torch.tensor([[1, 4, 4]])}  # 16 / 2^2 = 4 tokens
    good = {"prompt_ids": [1, 99, 99, 99, 99, 2], "response_ids": [3], "multi_modal_inputs": mm,
            "position_ids": torch.arange(6).expand(4, -1)}  # stand-in mrope rows
    assert modeling.pack_samples([good], is_vl=True, image_token_id=99, video_token_id=98, merge=2)["mm"][
        "pixel_values"].shape == (16, 8)
    bad = dict(good, prompt_ids=[1, 99, 99, 2], position_ids=torch.arange(4).expand(4, -1))
    with pytest.raises(ValueError, match="sample 0 has 2 pixel_values placeholder"):
        modeling.pack_samples([bad], is_vl=True, image_token_id=99, video_token_id=98, merge=2)


def test_partition_balanced_by_hand():
    assert modeling.partition_balanced([10, 1, 9, 2, 8, 3], 2, equal_size=True) == [[0, 3, 5], [1, 2, 4]]  # 15 / 18
    # largest first into the lightest group: 7 | 7 | 6, then 5 -> 6, 4 -> 7 (first of the ties), 1 -> 7
    assert modeling.partition_balanced([7, 7, 6, 5, 4, 1], 3) == [[0, 4], [1, 5], [2, 3]]
    assert modeling.partition_balanced([3], 3) == [[0], [], []]
    assert modeling.micro_batches_needed([100, 100, 100, 100], 200) == 2
    assert modeling.micro_batches_needed([120, 110, 100], 200) == 3  # 2 groups: 120 | 110 + 100 = 210 > 200
    with pytest.raises(ValueError, match="equal groups"):
        modeling.partition_balanced([1, 2, 3], 2, equal_size=True)


def test_chunked_response_head_equals_full_logits():
    torch.manual_seed(0)
    hidden = torch.randn(11, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    labels = torch.randint(0, 50, (11,))
    logp, ent = modeling.response_log_probs(hidden, head, labels, 0.7, with_entropy=True, chunk=4)
    (logp * torch.arange(11.0)).sum().backward()
    got = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None

    full = torch.log_softmax(head(hidden) / 0.7, -1)  # [11, 50] at once
    naive = full.gather(-1, labels[:, None])[:, 0]
    (naive * torch.arange(11.0)).sum().backward()
    torch.testing.assert_close(logp, naive, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], head.weight.grad, rtol=1e-5, atol=1e-6)


def test_attention_backend_isolates_sequences():
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)  # 4 query heads, 2 KV heads
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = modeling.varlen_attention(q, k, v, cu, 5, causal=True)
    for a, b in ((0, 4), (4, 9)):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1).repeat_interleave(2, 0),
            v[a:b].transpose(0, 1).repeat_interleave(2, 0), is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[a:b], ref, rtol=1e-5, atol=1e-6)


def test_fp32_on_cuda_takes_the_exact_mask_not_a_half_precision_kernel(monkeypatch):
    """flash-attn and torch's varlen_attn take bf16/fp16 only (flash-attn raised on an fp32 run's q, k, v): fp32
    tensors that report CUDA take the per-sequence sdpa; bf16 ones flash-attn when installed, else torch's."""
    class Cuda(torch.Tensor):  # a CPU tensor that says it is on CUDA
        is_cuda = property(lambda self: True)

    called, kernels = [], {"flash": lambda q, *a, **kw: called.append("flash") or q, "torch": None}
    monkeypatch.setattr(modeling, "_kernel", lambda name: kernels[name])
    q, cu = torch.randn(6, 2, 8).as_subclass(Cuda), torch.tensor([0, 3, 6], dtype=torch.int32)
    assert modeling.varlen_attention(q, q, q, cu, 3, True).shape == (6, 2, 8) and called == []
    modeling.varlen_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), cu, 3, True)
    assert called == ["flash"]


# ----------------------------------------------------------------------------------------------
# One process: packed equals per-sequence, micro-batch splits, LoRA
# ----------------------------------------------------------------------------------------------

def test_packed_log_probs_and_grads_equal_per_sequence_vl_mixed(vl):
    samples = [vl_sample(vl, (56, 56), 5, 1), vl_sample(vl, (112, 56), 3, 2), vl_sample(vl, None, 6, 3),
               vl_sample(vl, (56, 112), 4, 4)]
    a = make_actor(vl.path)
    logps, entropies = a.compute_log_probs(samples, with_entropy=True)
    weights = token_weights(samples)
    packed_backward(a, samples, weights)
    vl.model.zero_grad()
    for s, lp, w in zip(samples, logps, weights):
        ref = reference_log_probs(vl.model, s, is_vl=True)
        torch.testing.assert_close(lp, ref.detach(), rtol=0, atol=LOGP_ATOL)
        (ref * w).sum().backward()
    assert all(e.shape == lp.shape and (e > 0).all() for e, lp in zip(entropies, logps))
    expected = {n: p.grad for n, p in vl.model.named_parameters() if p.grad is not None}
    assert any(".visual." in n for n in expected)  # the vision tower is in the comparison
    assert_grads_close(full_grads(a), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_vl_pass_on_the_gpu_equals_the_cpu(vl, tmp_path):
    """The GPU path, FSDP2 on a one-rank group as the trainer runs it (pinned asynchronous copies, the grids on the
    host, modeling.vision_indices), gives the CPU's log-probs (fp32 both) and finite gradients through the vision
    tower; and its forward waits for the GPU (a host sync) only in transformers' own placeholder check and in fp32's
    attention fallback (which reads each layer's sequence bounds: no varlen kernel takes fp32), not while packing,
    not in FSDP2's move of the inputs, not for the tower's index tensors."""
    import torch.distributed as dist
    import warnings

    samples = [vl_sample(vl, (56, 56), 5, 1), vl_sample(vl, (112, 56), 3, 2), vl_sample(vl, None, 6, 3)]
    expected = make_actor(vl.path).compute_log_probs(samples)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rendezvous", world_size=1, rank=0)
    try:
        on_gpu = make_actor(vl.path, device="cuda")
        assert on_gpu.sharded
        for got, want in zip(on_gpu.compute_log_probs(samples), expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
        packed_backward(on_gpu, samples, token_weights(samples))
        grads = full_grads(on_gpu)
        assert any(".visual." in n for n in grads) and all(g.isfinite().all() for g in grads.values())

        syncs = []
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *args, **kw: syncs.append(
                [f.name for f in traceback.extract_stack()] if "synchroniz" in str(message) else None)
            modalities = on_gpu._modalities(samples)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.no_grad():
                    on_gpu._forward(on_gpu._pack(samples, [0, 1, 2]), False, modalities)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        unexpected = [stack[-6:] for stack in syncs if stack and "get_placeholder_mask" not in stack
                      and "set_sync_debug_mode" not in stack and "varlen_attention" not in stack[-3:]]
        assert not unexpected, f"host syncs in the packed forward: {unexpected}"
    finally:
        dist.destroy_process_group()


def test_packed_log_probs_and_grads_equal_per_sequence_vl_videos(vl):
    """Video, image + video, image and text samples packed together: log-probs and gradients equal the plain
    per-sequence forward, whose positions the model computes itself (temporal ones from second_per_grid_ts)."""
    g = torch.Generator().manual_seed(0)
    four = torch.randint(0, 255, (4, 56, 56, 3), generator=g, dtype=torch.uint8).numpy()   # 2 temporal patches
    two = torch.randint(0, 255, (2, 56, 112, 3), generator=g, dtype=torch.uint8).numpy()   # 1, two windows wide
    samples = [vl_video_sample(vl, four, 5, 1), vl_video_sample(vl, two, 3, 2, image_size=(56, 56)),
               vl_sample(vl, (56, 56), 4, 3), vl_sample(vl, None, 6, 4)]
    assert samples[0]["multi_modal_inputs"]["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert len(set(samples[0]["position_ids"][1].tolist())) < len(set(samples[0]["position_ids"][0].tolist()))
    a = make_actor(vl.path)
    assert a._modalities(samples) == ("image", "video")
    weights = token_weights(samples)
    expected = assert_packed_equals_per_sequence(a, vl.model, samples, weights)
    # One sample per micro-batch: those without a video run the tower on the dummy (the ranks' collectives
    # stay paired) and join nothing; the gradient is the same.
    longest = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    alone = make_actor(vl.path, max_tokens_per_micro_batch=longest)
    assert len(alone._plan(samples, "update")) == 4
    packed_backward(alone, samples, weights)
    assert_grads_close(full_grads(alone), expected)


def test_packed_log_probs_and_grads_equal_per_sequence_text(toy):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy["text_model"], dtype=torch.float32, attn_implementation="sdpa")
    samples = [text_sample(4, 1), text_sample(7, 2, prompt_len=3), text_sample(1, 3, prompt_len=12)]
    a = make_actor(toy["text_model"])
    logps = a.compute_log_probs(samples)
    weights = token_weights(samples)
    packed_backward(a, samples, weights)
    for s, lp, w in zip(samples, logps, weights):
        ref = reference_log_probs(model, s, is_vl=False)
        torch.testing.assert_close(lp, ref.detach(), rtol=0, atol=LOGP_ATOL)
        (ref * w).sum().backward()
    assert_grads_close(full_grads(a), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def test_responses_sharing_a_prompt_encode_its_image_once(vl, monkeypatch):
    """Three responses of one image prompt share its pixel tensors (each in a dict of its own, as after Ray hands
    the samples to a worker) beside a second image prompt with two: the plan keeps each prompt's responses together,
    each image goes through the vision tower once per micro-batch, and log-probs and gradients equal the plain
    per-sequence forward."""
    first, second = vl_sample(vl, (56, 56), 5, 1), vl_sample(vl, (112, 56), 3, 2)
    def response(prompt, ids):
        return {**prompt, "response_ids": ids, "multi_modal_inputs": dict(prompt["multi_modal_inputs"])}

    samples = [response(first, first["response_ids"][:k]) for k in (5, 2, 4)] + \
              [response(second, ids) for ids in ([20, 21, 22], [23])]
    samples = [samples[i] for i in (0, 3, 1, 4, 2)]  # interleaved, as a shuffled batch would be
    a = make_actor(vl.path, global_batch_size=5)  # one mini-batch
    assert sorted(map(sorted, a._plan(samples, "update"))) == [[0, 1, 2, 3, 4]]
    tower = modeling.vision_tower(a.hf)
    patches = []
    forward = tower.forward
    monkeypatch.setattr(tower, "forward", lambda x, *args, **kw: patches.append(len(x)) or forward(x, *args, **kw))
    assert_packed_equals_per_sequence(a, vl.model, samples, token_weights(samples))
    grids = [p["multi_modal_inputs"]["image_grid_thw"] for p in (first, second)]
    assert patches == [int(grids[0].prod() + grids[1].prod())] * 2  # log-probs, then backward: each image once
    # a budget that holds one prompt's responses but not both prompts': one micro-batch per prompt
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    budget = max(lengths[0] + lengths[2] + lengths[4], lengths[1] + lengths[3])
    a = make_actor(vl.path, global_batch_size=5, max_tokens_per_micro_batch=budget)
    assert sorted(map(sorted, a._plan(samples, "update"))) == [[0, 2, 4], [1, 3]]


def test_micro_batch_splits_give_the_same_gradient(vl):
    samples = [vl_sample(vl, (56, 56), 5, 1), vl_sample(vl, None, 6, 2), vl_sample(vl, (112, 56), 3, 3),
               vl_sample(vl, None, 2, 4)]
    weights = token_weights(samples)
    longest = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    total = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    grads = {}
    for ways, budget in ((1, total), (2, (total + 1) // 2 + longest), (4, longest)):
        # the 2-way run also recomputes activations (gradient checkpointing): the same gradient again
        a = make_actor(vl.path, max_tokens_per_micro_batch=budget, **{"model.enable_gradient_checkpointing": ways == 2})
        assert len(a._plan(samples, "update")) == ways
        packed_backward(a, samples, weights)
        grads[ways] = full_grads(a)
    assert_grads_close(grads[2], grads[1])
    assert_grads_close(grads[4], grads[1])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_compiled_layers_equal_eager(family, request, monkeypatch):
    """use_torch_compile (the Actor applies it on CUDA only; forced here on the CPU): every decoder layer and
    vision block torch.compiled, under gradient checkpointing, gives the eager log-probs and gradients."""
    if family == "qwen3_vl":
        path, model = request.getfixturevalue("qwen3_vl")
        samples = qwen3_image_samples(model)
    else:
        vl = request.getfixturevalue("vl")
        path = vl.path
        samples = [vl_sample(vl, (56, 56), 5, 1), vl_sample(vl, None, 6, 2), vl_sample(vl, (112, 56), 3, 3)]
    weights = token_weights(samples)
    eager = make_actor(path, **{"model.enable_gradient_checkpointing": True})
    expected = eager.compute_log_probs(samples)
    packed_backward(eager, samples, weights)
    build = modeling.build_model
    monkeypatch.setattr(actor, "build_model", lambda *args: build(*args[:6], True, *args[7:]))  # compile_layers
    compiled = make_actor(path, **{"model.enable_gradient_checkpointing": True})
    assert sum(getattr(m, "_compiled_call_impl", None) is not None for m in compiled.hf.modules()) == \
        len(compiled.hf.model.language_model.layers) + len(compiled.hf.model.visual.blocks)
    for got, want in zip(compiled.compute_log_probs(samples), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=LOGP_ATOL)
    packed_backward(compiled, samples, weights)
    assert_grads_close(full_grads(compiled), full_grads(eager))


def test_text_only_micro_batch_still_runs_the_vision_tower(vl):
    """The deadlock guard: without images, every vision parameter still gets a (zero) gradient, so FSDP's
    reduce-scatters pair up across ranks. freeze_vision_tower takes the tower out of the optimizer."""
    samples = [vl_sample(vl, None, 4, 1)]
    a = make_actor(vl.path)
    packed_backward(a, samples, token_weights(samples))
    vision = {n: p.grad for n, p in a.hf.named_parameters() if ".visual." in f".{n}"}
    assert vision and all(g is not None and not g.any() for g in vision.values())
    frozen = make_actor(vl.path, **{"model.freeze_vision_tower": True})
    optimized = {id(p) for g in frozen.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in optimized for n, p in frozen.hf.named_parameters() if "visual" in n)
    assert any(id(p) in optimized for n, p in frozen.hf.named_parameters() if "layers" in n)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """A tiny random-init Qwen3-VL (interleaved mrope, deepstack features from vision block 0)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("qwen3_vl"))
    Qwen3VLForConditionalGeneration(config).save_pretrained(path)
    return path, Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def qwen3_image_samples(model):
    """Three samples for the tiny Qwen3-VL: an image of 2 x 4 patches, none, 4 x 4 patches."""
    samples = []
    for seed, (rows, response_len) in enumerate([(2, 4), (0, 3), (4, 5)]):  # image of 2 x 4 / none / 4 x 4 patches
        g = torch.Generator().manual_seed(seed)
        grid = torch.tensor([[1, rows, 4]])
        ids = torch.randint(10, 300, (4,), generator=g).tolist() + ([3] + [5] * (rows * 4 // 4) + [4] if rows else [])
        ids += torch.randint(10, 300, (3,), generator=g).tolist()
        pixels = torch.randn(rows * 4, 3 * 2 * 16 * 16, generator=g)  # [patches, channels x 2 x 16 x 16]
        mm = {"pixel_values": pixels, "image_grid_thw": grid} if rows else {}
        types = torch.tensor([[int(t == 5) for t in ids]])
        mrope, _ = model.model.get_rope_index(torch.tensor([ids]), types, mm.get("image_grid_thw"),
                                              attention_mask=torch.ones(1, len(ids)))
        response = torch.randint(10, 300, (response_len,), generator=g).tolist()
        position_ids = torch.cat([torch.arange(len(ids))[None], mrope[:, 0]])  # [4, P]
        samples.append({"prompt_ids": ids, "response_ids": response, "multi_modal_inputs": mm,
                        "position_ids": position_ids, "mm_token_type_ids": types})
    return samples


def test_qwen3_vl_packed_equals_per_sequence(qwen3_vl):
    path, model = qwen3_vl
    samples = qwen3_image_samples(model)
    a = make_actor(path)
    weights = token_weights(samples)
    logps = a.compute_log_probs(samples)
    packed_backward(a, samples, weights)
    for s, lp, w in zip(samples, logps, weights):
        ref = reference_log_probs(model, s, is_vl=True)
        torch.testing.assert_close(lp, ref.detach(), rtol=0, atol=LOGP_ATOL)
        (ref * w).sum().backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any("deepstack" in n for n in expected)
    assert_grads_close(full_grads(a), expected)


def test_qwen3_vl_packed_video_equals_per_sequence(qwen3_vl):
    """Qwen3-VL videos: each temporal patch is its own <vision_start> pads <vision_end> group after a timestamp
    (here 2 text tokens), and get_rope_index splits the video grid per temporal patch."""
    path, model = qwen3_vl
    samples = []
    for seed, (frames, rows, response_len) in enumerate([(2, 2, 4), (0, 0, 3), (3, 4, 5)]):  # temporal patches
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(10, 300, (4,), generator=g).tolist()
        for _ in range(frames):
            ids += torch.randint(10, 300, (2,), generator=g).tolist() + [3] + [6] * (rows * 4 // 4) + [4]
        ids += torch.randint(10, 300, (3,), generator=g).tolist()
        mm = {"pixel_values_videos": torch.randn(frames * rows * 4, 3 * 2 * 16 * 16, generator=g),
              "video_grid_thw": torch.tensor([[frames, rows, 4]])} if frames else {}
        types = torch.tensor([[2 * int(t == 6) for t in ids]])
        mrope, _ = model.model.get_rope_index(torch.tensor([ids]), types, None, mm.get("video_grid_thw"),
                                              attention_mask=torch.ones(1, len(ids)))
        response = torch.randint(10, 300, (response_len,), generator=g).tolist()
        samples.append({"prompt_ids": ids, "response_ids": response, "multi_modal_inputs": mm,
                        "position_ids": torch.cat([torch.arange(len(ids))[None], mrope[:, 0]]),
                        "mm_token_type_ids": types})
    expected = assert_packed_equals_per_sequence(make_actor(path), model, samples, token_weights(samples))
    assert any("deepstack" in n for n in expected)


def test_adamw_bf16_follows_adamw():
    torch.manual_seed(0)
    p_ref, p_bf16 = torch.nn.Parameter(torch.randn(4, 5)), torch.nn.Parameter(torch.randn(4, 5))
    p_bf16.data.copy_(p_ref.data)
    start = p_ref.data.clone()
    ref = torch.optim.AdamW([p_ref], lr=0.1, betas=(0.9, 0.99), weight_decay=0.01)
    ours = modeling.AdamWBF16([p_bf16], lr=0.1, betas=(0.9, 0.99), weight_decay=0.01)
    for _ in range(3):
        grad = torch.randn(4, 5)
        p_ref.grad, p_bf16.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step()
    assert ours.state[p_bf16]["exp_avg"].dtype == torch.bfloat16
    torch.testing.assert_close(p_bf16.data, p_ref.data, rtol=0, atol=5e-3)  # bf16 moments: ~3 significant digits
    assert (p_ref.data - start).abs().mean() > 0.1  # the steps moved the weights 20x more than the tolerance


def test_lora_trains_only_adapters_and_disabled_equals_base(vl):
    samples = [vl_sample(vl, (56, 56), 4, 1), vl_sample(vl, None, 3, 2)]
    base = make_actor(vl.path).compute_log_probs(samples)
    a = make_actor(vl.path, **{"model.lora": LoraConfig(rank=4, alpha=8)})
    trainable = [n for n, p in a.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert not any("visual" in n for n in trainable) and not any("lm_head" in n for n in trainable)
    with torch.no_grad():  # B starts at 0 (adapter = identity): move it so the adapters matter
        for n, p in a.module.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    adapted = a.compute_log_probs(samples)
    disabled = a.compute_log_probs(samples, disable_adapter=True)
    assert max((x - y).abs().max() for x, y in zip(adapted, base)) > 1e-3
    for x, y in zip(disabled, base):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    # named_tensors: merged weights under the plain model's names reproduce the adapted log-probs
    plain = make_actor(vl.path)
    names = dict(a.named_tensors())
    assert names.keys() == plain.hf.state_dict().keys()
    plain.hf.load_state_dict(names)
    for x, y in zip(plain.compute_log_probs(samples), adapted):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Two gloo ranks (spawned processes, with a timeout): same numbers as one process, no deadlock on
# mixed text/image micro-batches with unequal micro-batch counts, checkpoint 2 ranks -> 1 process
# ----------------------------------------------------------------------------------------------

def _two_rank_job(rank, world, tmp, path, budget, samples, weights):
    """Log-probs and gradients with 3 samples on rank 0 (three micro-batches under the budget) and one text-only
    sample on rank 1 (one real micro-batch + two dummies that keep FSDP's collectives paired); then an update
    with two samples per rank, a checkpoint, and the log-probs after it."""
    a = make_actor(path, max_tokens_per_micro_batch=budget)
    mine = [0, 1, 2] if rank == 0 else [3]
    local = [samples[i] for i in mine]
    assert len(a._plan(local, "update")) == 3
    logps = a.compute_log_probs(local)
    packed_backward(a, local, [weights[i] for i in mine])
    grads = full_grads(a)
    a.optimizer.zero_grad(set_to_none=True)

    local = [dict(samples[i]) for i in ([0, 1] if rank == 0 else [2, 3])]
    for s, lp in zip(local, a.compute_log_probs(local)):
        s.update(old_logprobs=lp, advantage=1.0 if len(s["response_ids"]) % 2 else -1.0)
    metrics = a.update(local)
    a.save_checkpoint(os.path.join(tmp, "ckpt"))
    after = a.compute_log_probs(local)
    weights_out = {n: t.cpu() for n, t in a.named_tensors()}

    lora = make_actor(path, max_tokens_per_micro_batch=budget, **{"model.lora": LoraConfig(rank=4, alpha=8)})
    lora_logps = lora.compute_log_probs(local)  # B = 0 at the start: equal to the base model
    lora_off = lora.compute_log_probs(local, disable_adapter=True)
    for s, lp in zip(local, lora_logps):
        s["old_logprobs"] = lp
    lora.update(local)
    lora_out = {n: t.cpu() for n, t in lora.named_tensors()}
    torch.save({"logps": logps, "grads": grads if rank == 0 else None, "metrics": metrics, "after": after,
                "weights": weights_out if rank == 0 else None, "lora": (lora_logps, lora_off),
                "lora_weights": lora_out if rank == 0 else None}, os.path.join(tmp, f"rank{rank}.pt"))


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process_and_checkpoint_to_one(vl, tmp_path):
    samples = [vl_sample(vl, (56, 56), 5, 1), vl_sample(vl, (112, 56), 3, 2), vl_sample(vl, None, 6, 3),
               vl_sample(vl, None, 2, 4, text="What is 3 + 4?")]
    budget = max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples) + 1  # < any two together
    weights = token_weights(samples)
    run_ranks(_two_rank_job, 2, str(tmp_path), vl.path, budget, samples, weights, timeout=300)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))

    one = make_actor(vl.path, max_tokens_per_micro_batch=budget)
    logps = one.compute_log_probs(samples)
    for got, want in zip(r0["logps"] + r1["logps"], logps):
        torch.testing.assert_close(got, want, rtol=0, atol=LOGP_ATOL)
    packed_backward(one, samples, weights)
    assert_grads_close(r0["grads"], full_grads(one))
    assert r0["metrics"] == r1["metrics"] and r0["metrics"]["actor/skipped_steps"] == 0.0
    assert r0["metrics"]["actor/ppo_kl"] == 0.0 and r0["metrics"]["actor/pg_clipfrac_higher"] == 0.0

    fresh = make_actor(vl.path, max_tokens_per_micro_batch=budget)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert fresh.optimizer_steps == 1 and fresh.optimizer.state  # the optimizer state came back too
    for got, want in zip(fresh.compute_log_probs(samples), r0["after"] + r1["after"]):
        torch.testing.assert_close(got, want, rtol=0, atol=LOGP_ATOL)
    assert max((x - y).abs().max() for x, y in zip(r0["after"] + r1["after"], logps)) > 1e-3  # the step changed it
    for name, tensor in fresh.hf.state_dict().items():  # named_tensors on 2 ranks: the full weights, HF names
        torch.testing.assert_close(r0["weights"][name], tensor, rtol=0, atol=0)
    assert r0["weights"].keys() == fresh.hf.state_dict().keys()

    base = make_actor(vl.path).hf.state_dict()  # LoRA on 2 ranks: adapters on (B = 0) = off = the base
    for got, want in zip(r0["lora"][0] + r1["lora"][0] + r0["lora"][1] + r1["lora"][1], logps + logps):
        torch.testing.assert_close(got, want, rtol=0, atol=LOGP_ATOL)
    merged = r0["lora_weights"]  # after one step: adapted weights moved, the rest (vision, norms, head) did not
    assert merged.keys() == base.keys()
    moved = {n for n in base if not torch.equal(merged[n], base[n])}
    assert moved and all(n.endswith("proj.weight") and "visual" not in n for n in moved)
    assert any("lm_head" in n for n in base) and not any("lm_head" in n or "norm" in n for n in moved)
    hf_files = os.listdir(tmp_path / "ckpt" / "huggingface")
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(hf_files)


def run_ranks(fn, world, tmp, *args, timeout=120):
    """Run fn(rank, world, tmp, *args) in `world` spawned processes joined by a gloo group; fail on error or timeout."""
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, world, tmp, args)) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    errors = [open(os.path.join(tmp, f"error{r}.txt")).read() for r in range(world)
              if os.path.exists(os.path.join(tmp, f"error{r}.txt"))]
    assert not errors, "\n".join(errors)
    assert not alive, f"{len(alive)} of {world} ranks still running after {timeout} s (a collective deadlock?)"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _rank_main(fn, rank, world, tmp, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank,
                                world_size=world)
        fn(rank, world, tmp, *args)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(tmp, f"error{rank}.txt"), "w") as f:
            f.write(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    leave_rank()


@pytest.mark.parametrize("tied", [False, True])
def test_flop_count_parameters_by_hand(toy, tied):
    """perf/mfu_actor's parameter counts from the config's shapes: body = per layer q, k, v (with biases), o, the
    SwiGLU MLP and two norms, plus the final norm; the LM head vocab x hidden once, whether or not it is tied to
    the input embedding (which is a lookup and not counted)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(toy["text_model"], tie_word_embeddings=tied)
    hf = AutoModelForCausalLM.from_config(config)
    h, i, layers, heads, kv = (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                               config.num_attention_heads, config.num_key_value_heads)
    d = h // heads
    per_layer = (h * h + h) + 2 * (h * kv * d + kv * d) + h * h + 3 * h * i + 2 * h
    counts = modeling.count_flops_params(hf, config)
    assert counts == {"body": layers * per_layer + h, "head": config.vocab_size * h, "vision": 0,
                      "attention": d * heads * layers}
