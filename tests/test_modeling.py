"""modeling.py's plumbing checked against hand-worked values and plain reference implementations: the edge cases of
micro-batch balancing, grouping of samples that share images or videos, the image / video order of a packed row,
the response head in bf16 and on no tokens, the packed attention's boundaries, causality and scale, the vision
output helpers, a hand-worked AdamWBF16 step, the FLOP counts and override_config on the toy models. CPU only."""

import math
from types import SimpleNamespace

import pytest
import torch

import modeling


# ----------------------------------------------------------------------------------------------
# Balancing and grouping
# ----------------------------------------------------------------------------------------------

def test_partition_balanced_fills_the_lightest_group_by_tokens_not_by_count():
    """partition_balanced picks the group with the fewest tokens, not the fewest items: [10, 1, 1, 1] into 2 groups
    is 10 | 1 + 1 + 1 (each 1 goes to the group of 1 or 2 tokens, not to the 10 that has fewer items)."""
    assert modeling.partition_balanced([10, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert modeling.partition_balanced([10, 1, 1, 1], 2, equal_size=True) == [[0, 3], [1, 2]]
    # equal tokens go to the group of fewer items: [1, 1, 1, 3, 3, 4] longest first is 4 | 3, 3 | 1, 1 (6 and 6),
    # then the last 1 joins the 3 + 3 of two items, not the 4 + 1 + 1 of three
    assert modeling.partition_balanced([1, 1, 1, 3, 3, 4], 2) == [[0, 1, 5], [2, 3, 4]]
    with pytest.raises(ValueError, match="sample 1 has an empty prompt"):  # its first response token has no context
        modeling.pack_samples([{"prompt_ids": [1, 2], "response_ids": [3]}, {"prompt_ids": [], "response_ids": [4]}],
                              is_vl=False)


def test_micro_batches_needed_edge_cases_by_hand():
    """micro_batches_needed per its docstring, worked by hand: a single sequence over the budget may sit alone
    ([300 | 10 + 10] fits in 2), the count never exceeds the number of sequences ([1000] -> 1, not 5), and it
    starts at ceil(total / budget) even where fewer groups would fit ([500, 10, 10, 10] at 200: 530 / 200 -> 3,
    although 500 | 10 + 10 + 10 would be 2)."""
    assert modeling.micro_batches_needed([300, 10, 10], 200) == 2
    assert modeling.micro_batches_needed([1000], 200) == 1
    assert modeling.micro_batches_needed([1000, 10], 200) == 2
    assert modeling.micro_batches_needed([500, 10, 10, 10], 200) == 3


def _sample(inputs, n=1):
    return {"prompt_ids": [1] * n, "response_ids": [], "multi_modal_inputs": inputs}


def test_shared_image_units_group_shared_images_and_videos_within_the_budget():
    """Samples whose image (or video) tensors are the same objects, each in a dict of its own, form one unit while
    the unit stays within the budget: 4 + 4 = 8 tokens at budget 8 is allowed (the bound is inclusive), a third
    sample of that image (12 > 8) opens a new unit; two samples sharing only a video are grouped as well; a sample
    without images stays alone. Worked by hand."""
    img = {"pixel_values": torch.zeros(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    vid = {"pixel_values_videos": torch.zeros(8, 3), "video_grid_thw": torch.tensor([[2, 2, 2]])}
    samples = [_sample(dict(img)), _sample({}), _sample(dict(vid)), _sample(dict(img)), _sample(dict(vid)),
               _sample(dict(img))]
    assert modeling.shared_image_units(samples, [4, 3, 3, 4, 3, 4], 8) == [[0, 3], [1], [2, 4], [5]]


def test_pixels_key_tells_apart_equal_shapes_and_views():
    """pixels_key: the same tensor in two dicts is the same key; a different tensor of the same shape (another
    image of the same size) is not; a prefix view of the same memory with another shape is not either."""
    pixels = torch.randn(8, 3)
    key = modeling.pixels_key({"pixel_values": pixels}, "pixel_values")
    assert key == modeling.pixels_key(dict({"pixel_values": pixels}), "pixel_values")
    assert key != modeling.pixels_key({"pixel_values": pixels.clone()}, "pixel_values")
    assert key != modeling.pixels_key({"pixel_values": pixels[:4]}, "pixel_values")


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------

def _vl_sample(prompt, response, inputs):
    return {"prompt_ids": prompt, "response_ids": response, "multi_modal_inputs": inputs,
            "position_ids": torch.arange(len(prompt)).expand(4, -1)}  # stand-in mrope rows


def test_pack_samples_image_order_with_several_images_per_prompt():
    """mm_order indexes images, not prompts: prompt A has two images (1 token each at merge 2), prompt B one, a
    third sample shares A's tensors. `mm` holds A's two images then B's (each once) and the row's five image slots
    are images [0, 1, 2, 0, 1]; two distinct videos get [0, 1]. Worked by hand."""
    a = {"pixel_values": torch.randn(8, 3), "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}
    b = {"pixel_values": torch.randn(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    v1 = {"pixel_values_videos": torch.randn(8, 3), "video_grid_thw": torch.tensor([[2, 2, 2]])}  # 2 tokens
    v2 = {"pixel_values_videos": torch.randn(8, 3), "video_grid_thw": torch.tensor([[2, 2, 2]])}
    samples = [_vl_sample([1, 99, 99, 2], [3], dict(a)), _vl_sample([1, 99, 2], [4], dict(b)),
               _vl_sample([1, 99, 99, 2], [5, 6], dict(a)), _vl_sample([1, 98, 98], [7], v1),
               _vl_sample([98, 98, 2], [8], v2)]
    batch = modeling.pack_samples(samples, True, image_token_id=99, video_token_id=98, merge=2)
    assert batch["mm_order"] == {"image": [0, 1, 2, 0, 1], "video": [0, 1]}
    assert torch.equal(batch["mm"]["pixel_values"], torch.cat([a["pixel_values"], b["pixel_values"]]))
    assert batch["mm"]["image_grid_thw"].tolist() == [[1, 2, 2]] * 3
    assert batch["mm"]["video_grid_thw"].tolist() == [[2, 2, 2]] * 2


def test_pack_samples_rejects_an_image_token_in_the_response():
    """A response that contains the image placeholder token would take image features at a text position: the
    sample is refused, also when its prompt has the right number of placeholders."""
    image = {"pixel_values": torch.zeros(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    assert modeling.pack_samples([_vl_sample([1, 99, 2], [3], image)], True, image_token_id=99, video_token_id=98,
                                 merge=2)["labels"].tolist() == [3]
    with pytest.raises(ValueError, match="and 1 in its response"):
        modeling.pack_samples([_vl_sample([1, 99, 2], [3, 99], image)], True, image_token_id=99, video_token_id=98,
                              merge=2)


# ----------------------------------------------------------------------------------------------
# Response head
# ----------------------------------------------------------------------------------------------

def test_response_log_probs_divide_by_temperature_in_fp32():
    """With a bf16 LM head the logits are taken to fp32 before the division by the temperature (0.7, not a power of
    two, so dividing in bf16 would round): log-probs equal log_softmax(float(head(h)) / T) to 1e-5."""
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 64, bias=False).bfloat16()
    with torch.no_grad():
        head.weight.mul_(8.0)  # logits of a few units: bf16 rounding of z / T is then ~1e-2
    hidden = torch.randn(5, 32).bfloat16()
    labels = torch.randint(0, 64, (5,))
    with torch.no_grad():
        logp, _ = modeling.response_log_probs(hidden, head, labels, 0.7)
        ref = torch.log_softmax(head(hidden).float() / 0.7, -1).gather(-1, labels[:, None])[:, 0]
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)


def test_response_log_probs_of_no_tokens_stay_in_the_graph():
    """No response tokens: empty log-probs and entropies that still depend on the model, so a backward through
    them works and gives the body and the head zero gradients: a rank with only empty responses joins FSDP's
    reductions with every gradient, the head's included (without it, 2 ranks aborted on a collective mismatch)."""
    body = torch.nn.Linear(4, 6)
    head = torch.nn.Linear(6, 10, bias=False)
    hidden = body(torch.randn(3, 4))[:0]
    logp, ent = modeling.response_log_probs(hidden, head, torch.zeros(0, dtype=torch.long), 1.0, with_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,) and logp.dtype == torch.float32
    logp.sum().backward()
    assert body.weight.grad is not None and not body.weight.grad.any()
    assert head.weight.grad is not None and not head.weight.grad.any()


# ----------------------------------------------------------------------------------------------
# Packed attention (the per-sequence sdpa fallback on the CPU)
# ----------------------------------------------------------------------------------------------

def _reference_attention(q, k, v, bounds, causal, scale):
    """q [T, Hq, D], k / v [T, Hkv, D] -> [T, Hq, D]: each [a, b) on its own, softmax written out."""
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = q[a:b].transpose(0, 1), k[a:b].repeat_interleave(rep, 1).transpose(0, 1), \
            v[a:b].repeat_interleave(rep, 1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale  # [H, L, L]
        if causal:
            scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out[a:b] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


@pytest.fixture
def qkv():
    torch.manual_seed(0)
    return torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)  # [1, H, T, D], GQA 4 / 2


def _attend(qkv, module, **kwargs):
    out, weights = modeling.packed_attention(module, *qkv, **kwargs)
    assert weights is None and out.shape == (1, 9, 4, 8)
    return out[0]


def test_packed_attention_boundaries_causality_and_scale(qkv):
    """packed_attention against a written-out per-sequence softmax attention: the vision tower's cu_seq_lens_q
    wins over packed_cu_seqlens; an explicit is_causal=False beats the module's is_causal=True; `scaling` is
    applied (not the default 1/sqrt(D)); with no boundaries at all the row is one causal sequence."""
    q, k, v = (x[0].transpose(0, 1) for x in qkv)
    module = SimpleNamespace(is_causal=True)
    default = 8 ** -0.5
    packed = dict(packed_cu_seqlens=torch.tensor([0, 3, 9]), packed_max_seqlen=6)
    torch.testing.assert_close(_attend(qkv, module, **packed),
                               _reference_attention(q, k, v, [0, 3, 9], True, default), rtol=1e-5, atol=1e-6)
    both = dict(packed, cu_seq_lens_q=torch.tensor([0, 5, 9], dtype=torch.int32), max_length_q=5)
    torch.testing.assert_close(_attend(qkv, module, **both),
                               _reference_attention(q, k, v, [0, 5, 9], True, default), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_attend(qkv, module, is_causal=False, **packed),
                               _reference_attention(q, k, v, [0, 3, 9], False, default), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_attend(qkv, module, scaling=0.9, **packed),
                               _reference_attention(q, k, v, [0, 3, 9], True, 0.9), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_attend(qkv, module), _reference_attention(q, k, v, [0, 9], True, default),
                               rtol=1e-5, atol=1e-6)
    non_causal = SimpleNamespace(is_causal=False)
    torch.testing.assert_close(_attend(qkv, non_causal, **packed),
                               _reference_attention(q, k, v, [0, 3, 9], False, default), rtol=1e-5, atol=1e-6)


def test_a_nan_in_one_sequence_stays_in_it(qkv):
    """The fallback attends each sequence alone: a NaN in the first sequence's values (a broken image, an overflow)
    leaves the second's outputs finite and exact (a block-diagonal mask gave them 0 x NaN = NaN), and an empty
    sequence between them adds nothing."""
    q, k, v = (x[0].transpose(0, 1).clone() for x in qkv)
    v[1, 0, 0] = float("nan")
    out = modeling.varlen_attention(q, k, v, torch.tensor([0, 3, 3, 9]), 6, True)
    assert out.shape == q.shape and out[:3].isnan().any() and out[3:].isfinite().all()
    torch.testing.assert_close(out[3:], _reference_attention(q, k, v, [0, 3, 9], True, 8 ** -0.5)[3:],
                               rtol=1e-5, atol=1e-6)


def test_a_sliding_window_is_refused_only_for_a_longer_sequence(qkv):
    """A layer with a sliding window (transformers passes sliding_window) attends as a full layer while every sequence
    fits in the window; a longer one (6 tokens over a window of 5) is an error, not full attention without a word."""
    q, k, v = (x[0].transpose(0, 1) for x in qkv)
    packed, module = dict(packed_cu_seqlens=torch.tensor([0, 3, 9]), packed_max_seqlen=6), SimpleNamespace()
    torch.testing.assert_close(_attend(qkv, module, sliding_window=6, **packed),
                               _reference_attention(q, k, v, [0, 3, 9], True, 8 ** -0.5), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"a sequence of 6 tokens is longer than this layer's sliding window \(5"):
        _attend(qkv, module, sliding_window=5, **packed)


# ----------------------------------------------------------------------------------------------
# Vision output helpers
# ----------------------------------------------------------------------------------------------

def test_repeat_images_reindexes_per_image_tuples_only():
    """_repeat_images with 2 distinct images behind 3 slots [0, 1, 0]: the per-image tuple (pooler_output) and each
    layer's tuple of a nested list (Qwen3-VL deepstack) become (img0, img1, img0); a plain tensor and a tuple whose
    length is not the image count (e.g. per-layer hidden states) are left as they are."""
    a, b, c, d = (torch.full((1, 2), float(i)) for i in range(4))
    layers = (torch.zeros(1), torch.ones(1), torch.full((1,), 2.0))
    flat = torch.randn(5, 2)
    out = modeling._repeat_images({"last_hidden_state": flat, "pooler_output": (a, b), "deepstack": [(c, d)],
                                   "hidden_states": layers}, [0, 1, 0], 2)
    assert out["last_hidden_state"] is flat
    assert [t is x for t, x in zip(out["pooler_output"], (a, b, a))] == [True] * 3
    assert len(out["deepstack"]) == 1 and [t is x for t, x in zip(out["deepstack"][0], (c, d, c))] == [True] * 3
    assert len(out["hidden_states"]) == 3 and all(t is x for t, x in zip(out["hidden_states"], layers))


def test_as_zero_rows_empties_every_tensor_and_ties_each_to_all_floats():
    """_as_zero_rows: every tensor, integer ones included, has zero rows; each floating one depends on every
    floating tensor of the output, so whichever the model uses, the whole tower gets a (zero) gradient."""
    x, y = torch.randn(3, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
    out = modeling._as_zero_rows({"last_hidden_state": x * 2, "pooler_output": (x[:2] * 3,), "deepstack": [y * 1],
                                  "grid": torch.tensor([[1, 2, 2]])})
    assert out["last_hidden_state"].shape == (0, 4) and out["pooler_output"][0].shape == (0, 4)
    assert out["grid"].shape == (0, 3) and out["grid"].dtype == torch.long
    gx, gy = torch.autograd.grad(out["pooler_output"][0].sum(), (x, y))
    assert not gx.any() and not gy.any()


# ----------------------------------------------------------------------------------------------
# AdamWBF16: a hand-worked reference
# ----------------------------------------------------------------------------------------------

def _adamw_reference(p, grads, lr, b1, b2, eps, wd):
    """Plain float64 AdamW on a scalar (torch's definition): decoupled decay lr * wd * p, bias corrections."""
    m = v = 0.0
    for t, g in enumerate(grads, 1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1 ** t) / (math.sqrt(v / (1 - b2 ** t)) + eps) + wd * p)
    return p


def test_adamw_bf16_steps_match_a_hand_worked_adamw():
    """Three steps on fp32 weights (compensation stays 0) with betas (0.5, 0.75), so the bf16 moments hold powers
    of two exactly, and gradients of ~1e-6 where eps = 1e-8 (added after the square root) is a 1% effect: the
    weights equal a float64 scalar AdamW to 1e-6 relative. A parameter without a gradient is skipped (no state,
    unchanged)."""
    g = 2.0 ** -20
    grads = [g, -g, 4 * g]
    w0 = torch.tensor([1.0, -0.5, 0.25, 2.0])
    p = torch.nn.Parameter(w0.clone())
    idle = torch.nn.Parameter(torch.ones(3))
    opt = modeling.AdamWBF16([p, idle], lr=1e-2, betas=(0.5, 0.75), eps=1e-8, weight_decay=0.1)
    for grad in grads:
        p.grad = torch.full_like(p, grad)
        opt.step()
    expected = torch.tensor([_adamw_reference(w, grads, 1e-2, 0.5, 0.75, 1e-8, 0.1) for w in w0.tolist()])
    torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=0)
    assert not opt.state[p]["compensation"].any() and opt.state[p]["step"].item() == 3
    assert idle not in opt.state and torch.equal(idle.detach(), torch.ones(3))


def test_adamw_bf16_keeps_steps_below_half_a_bf16_spacing_and_its_state_in_bf16_after_a_load():
    """A bf16 weight of 0.02 (stored 0.02001953125; spacing 2**-13 = 1.22e-4) and 100 steps of lr 1e-6 (gradient -1:
    each step +1e-6, below half the spacing): without the compensation every step is lost; with it the weight is the
    bf16 value nearest 0.02001953125 + 1e-4 (0.0201416015625) and weight + compensation is that sum to 1e-5 (the
    moments, stored in bf16, make a step a few % off 1e-6; without it the sum is 1e-4 short). A load
    (torch casts the state to the parameters' dtype, fp32 here) leaves moments and compensation in bf16."""
    p = torch.nn.Parameter(torch.tensor([0.02], dtype=torch.bfloat16))
    opt = modeling.AdamWBF16([p], lr=1e-6)
    for _ in range(100):
        p.grad = torch.full_like(p, -1.0)
        opt.step()
    c = opt.state[p]["compensation"]
    assert p.item() == 0.0201416015625 and abs(p.item() + c.item() - (0.02001953125 + 1e-4)) < 1e-5
    q = torch.nn.Parameter(torch.ones(2))
    fresh, trained = modeling.AdamWBF16([q]), modeling.AdamWBF16([q])
    q.grad = torch.ones(2)
    trained.step()
    fresh.load_state_dict(trained.state_dict())
    assert {fresh.state[q][k].dtype for k in ("exp_avg", "exp_avg_sq", "compensation")} == {torch.bfloat16}


# ----------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------

class _TinyVL(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.visual = torch.nn.Linear(3, 5)  # 20 parameters, per patch
        self.model.embed_tokens = torch.nn.Embedding(10, 4)  # a lookup: not counted
        self.model.layer = torch.nn.Linear(4, 4)  # 20
        self.lm_head = torch.nn.Linear(4, 10, bias=False)  # 40

    def get_output_embeddings(self):
        return self.lm_head


def test_count_flops_params_vision_and_explicit_head_dim_by_hand():
    """count_flops_params on a hand-built model: the vision tower's 20 parameters go to "vision" (not the body),
    the body is the 20 of its text layer, the head 40; attention uses the config's head_dim (32) where it differs
    from hidden_size / heads (64 / 4 = 16): 32 x 4 heads x 3 layers."""
    config = SimpleNamespace(num_attention_heads=4, head_dim=32, hidden_size=64, num_hidden_layers=3)
    assert modeling.count_flops_params(_TinyVL(), config) == {"body": 20, "head": 40, "vision": 20,
                                                             "attention": 384}


def test_batch_flops_by_hand():
    """6 (P_body T + P_head R + P_vision patches) + 6 P_attention sum(L^2), worked by hand: T = 3 + 4, R = 1 + 2,
    patches = 6 image + 4 video rows (grids are not patches), sum(L^2) = 9 + 16:
    6 (2 * 7 + 3 * 3 + 5 * 10 + 7 * 25) = 1488."""
    params = {"body": 2, "head": 3, "vision": 5, "attention": 7}
    batch = {"seq_lens": [3, 4], "resp_lens": [1, 2],
             "mm": {"pixel_values": torch.zeros(6, 2), "image_grid_thw": torch.zeros(1, 3),
                    "pixel_values_videos": torch.zeros(4, 2), "video_grid_thw": torch.zeros(2, 3)}}
    assert modeling.batch_flops(params, batch) == 1488.0


# ----------------------------------------------------------------------------------------------
# model.override_config
# ----------------------------------------------------------------------------------------------

def test_override_config_sets_each_key_where_transformers_keeps_it(toy):
    """transformers 5 keeps a VL model's language keys in its text_config, where AutoConfig's kwargs never put them
    (they vanished without a word). apply_overrides sets them there and keeps top-level keys at the top. A dict for
    a sub-config or a dict value merges in. It returns the values set in that nesting, which is what vLLM's
    hf_overrides reads. A key that is nowhere is an error naming its path."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(toy["vl_model"])
    assert config.text_config.rope_parameters == {"mrope_section": [2, 3, 3], "rope_theta": 10000.0,
                                                  "rope_type": "default"}  # the toy's, as written
    changes = modeling.apply_overrides(config, {"rms_norm_eps": 0.25, "image_token_id": 7, "vision_config": {
        "depth": 1}, "rope_parameters": {"rope_theta": 5.0}})
    rope = {"mrope_section": [2, 3, 3], "rope_theta": 5.0, "rope_type": "default"}
    assert (config.text_config.rms_norm_eps, config.image_token_id, config.vision_config.depth) == (0.25, 7, 1)
    assert config.text_config.rope_parameters == rope
    assert changes == {"text_config": {"rms_norm_eps": 0.25, "rope_parameters": rope}, "image_token_id": 7,
                       "vision_config": {"depth": 1}}
    text = AutoConfig.from_pretrained(toy["text_model"])
    assert modeling.apply_overrides(text, {"rms_norm_eps": 0.25}) == {"rms_norm_eps": 0.25}
    assert text.rms_norm_eps == 0.25
    for path, overrides, message in (
            ("vl_model", {"rms_norm_epz": 1}, r"override_config\.rms_norm_epz: no such key in Qwen2_5_VLConfig or its "
                                              r"text_config \(the model's config.json\)"),
            ("vl_model", {"vision_config": {"dept": 1}}, r"override_config\.vision_config\.dept: no such key in "
                                                         r"Qwen2_5_VLVisionConfig \("),
            ("text_model", {"rms_norm_epz": 1}, r"override_config\.rms_norm_epz: no such key in Qwen2Config \(")):
        with pytest.raises(ValueError, match=message):
            modeling.apply_overrides(AutoConfig.from_pretrained(toy[path]), overrides)


def test_freeze_vision_tower_on_a_text_model_says_it_froze_nothing(toy, caplog):
    """A text model has no tower to freeze: the setting is said to do nothing (EasyR1 prints "No vision tower
    found."), and every parameter still trains."""
    import logging

    from test_actor_update import make_cfg

    with caplog.at_level(logging.WARNING, logger="modeling"):
        hf, _, _ = modeling.build_model(make_cfg(toy["text_model"], **{"model.freeze_vision_tower": True}), "actor",
                                        torch.device("cpu"), torch.float32, torch.float32, lora_rank=0)
    assert any("no vision tower" in r.getMessage() for r in caplog.records), caplog.text
    assert all(p.requires_grad for p in hf.parameters())


def test_override_config_reaches_the_actor_the_rollout_and_the_saved_config(toy, tmp_path, monkeypatch):
    """rms_norm_eps=0.25 in model.override_config of the VL toy: every RMSNorm of the language model runs with eps
    0.25 in the actor's model and in the transformers rollout engine's own copy (both had the toy's 1e-5: the
    key was dropped), vLLM is handed {"text_config": {"rms_norm_eps": 0.25}}, and the config.json saved with
    a checkpoint carries it."""
    import json

    import actor
    import rollout
    from config import ActorConfig, ModelConfig
    from test_rollout import config as rollout_config
    from test_rollout_vllm import fake_vllm

    model_cfg = ModelConfig(model_path=toy["vl_model"], override_config={"rms_norm_eps": 0.25})
    monkeypatch.setattr(modeling.dist, "is_initialized", lambda: False)  # unsharded, even after vLLM's engine tests
    hf, _, _ = modeling.build_model(ActorConfig(model=model_cfg), "actor", "cpu", torch.float32, torch.float32, 0)
    engine = rollout.make_rollout(rollout_config(override_config={"rms_norm_eps": 0.25}), toy["vl_model"],
                                  max_prompt_length=32, max_response_length=4, device="cpu")
    for model in (hf, engine.model):
        eps = {m.variance_epsilon for name, m in model.named_modules() if hasattr(m, "variance_epsilon")
               and "language_model" in name}
        assert eps == {0.25}
    calls = fake_vllm(monkeypatch)
    rollout.make_rollout(rollout_config(name="vllm", override_config={"rms_norm_eps": 0.25}), toy["vl_model"],
                         max_prompt_length=32, max_response_length=4, device="cuda")
    assert calls["init"]["hf_overrides"] == {"text_config": {"rms_norm_eps": 0.25}}
    actor.save_hf_files(model_cfg, str(tmp_path))
    assert json.load(open(tmp_path / "config.json"))["text_config"]["rms_norm_eps"] == 0.25


def test_peak_tflops_by_device_name_h200_before_h20(monkeypatch):
    """First substring match wins: an H200 is 989 TFLOP/s, not the H20's 148 (perf/mfu_actor would read 6.7x)."""
    for name, peak in (("NVIDIA H200", 989.0), ("NVIDIA H20", 148.0), ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, _n=name: _n)
        assert modeling.peak_tflops(0) == peak, name
