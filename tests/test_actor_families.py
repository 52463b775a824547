"""actor.py on other families: packed log-probs and gradients equal a per-sequence transformers forward, on prompts
built by data.py (images, a video, text) for a tiny random Qwen2-VL, and for text families whose own forward changes
the logits (Granite, Cohere, Gemma2). Qwen2.5-VL (the toy's family), Qwen3-VL and Qwen2 are in tests/test_actor.py."""

import io
import os

import pytest
import torch

import modeling
from conftest import leave_rank, run_ranks
from test_actor import (assert_grads_close, assert_packed_equals_per_sequence, full_grads, make_actor, packed_backward,
                        reference_log_probs, text_sample, token_weights)
from test_data import builder, clip, config, png
from test_actor_update import _free_port
from test_data_families import tiny_family


def test_qwen2_vl_packed_equals_per_sequence(tmp_path, toy):
    """Qwen2-VL's vision blocks attend over each image whole (no windows) and its mrope has no time scaling.
    Gradients: atol 1e-5, as lm_head's entries reach ~11 here and fp32 sums in another order move one of 10,688
    by 5e-6 (test_actor.py's 1e-6 holds for the smaller gradients of its models)."""
    path = str(tmp_path / "qwen2_vl")
    model, _ = tiny_family("qwen2_vl", path, toy)
    model = model.float().eval()
    build = builder(path, config(min_pixels=4096, max_pixels=16384, max_prompt_length=1024)).build
    rows = [{"problem": "<image>What is <image> 3 + 4?", "answer": "7", "images": [png(64, 64), png(200, 90)]},
            {"problem": "What is 3 + 4?", "answer": "7"},
            {"problem": "<video>Which colour, <image>?", "answer": "red", "images": [png(64, 64)],
             "videos": [clip(8, size=(64, 64), fps=4)]}]
    samples = []
    for i, row in enumerate(rows):
        prompt = build(row, i, f"r{i}")
        ids = torch.tensor([prompt["prompt_ids"]])
        types = (ids == model.config.image_token_id).long() + 2 * (ids == model.config.video_token_id).long()
        response = torch.randint(10, 150, (4 + i,), generator=torch.Generator().manual_seed(i)).tolist()
        samples.append({**{k: prompt[k] for k in ("prompt_ids", "position_ids", "multi_modal_inputs")},
                        "response_ids": response, "mm_token_type_ids": types})
    assert "pixel_values_videos" in samples[2]["multi_modal_inputs"] and samples[1]["multi_modal_inputs"] == {}
    expected = assert_packed_equals_per_sequence(make_actor(path), model, samples, token_weights(samples),
                                                 grad_atol=1e-5)
    assert any("visual" in name for name in expected)


def tiny_text_family(model_type, path, **changes):
    """A tiny random text model of `model_type` (2 layers, hidden 64, the toy's vocabulary), saved as an HF folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=167, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=0,
                               eos_token_id=2, pad_token_id=0, **changes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("model_type, changes", [
    ("granite", {"logits_scaling": 8.0}), ("cohere", {"logit_scale": 0.0625}), ("hyperclovax", {"logits_scaling": 4.0}),
    ("gemma2", {"final_logit_softcapping": 0.2, "attn_logit_softcapping": None, "query_pre_attn_scalar": 16})])
def test_text_families_that_change_their_logits_keep_doing_so_packed(model_type, changes, tmp_path):
    """Granite divides lm_head's logits by logits_scaling (HyperCLOVAX multiplies), Cohere multiplies them by
    logit_scale, Gemma2 caps them at final_logit_softcapping (0.2 here, as this random model's logits stay below
    ~0.5): the packed log-probs and gradients equal the model's own forward (before, they differed by up to 0.61;
    HyperCLOVAX, divided as Granite, by 1.56)."""
    model = tiny_text_family(model_type, str(tmp_path), **changes)
    samples = [text_sample(4, 1), text_sample(7, 2, prompt_len=3), text_sample(1, 3, prompt_len=12)]
    a, weights = make_actor(str(tmp_path)), token_weights(samples)
    logps = a.compute_log_probs(samples)
    packed_backward(a, samples, weights)
    for s, lp, w in zip(samples, logps, weights):
        ref = reference_log_probs(model, s, is_vl=False)
        torch.testing.assert_close(lp, ref.detach(), rtol=0, atol=1e-5)
        (ref * w).sum().backward()
    assert_grads_close(full_grads(a), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, 1e-5)


def test_attention_the_packed_pass_cannot_compute_is_refused(tmp_path):
    """Gemma2's cap on attention scores is refused when the model is built, naming the key and the override that
    drops it; an attention call with sink logits (gpt-oss) or a softcap is refused rather than ignored."""
    tiny_text_family("gemma2", str(tmp_path), query_pre_attn_scalar=16)  # attn_logit_softcapping 50 by default
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50.0 .*override_config"):
        make_actor(str(tmp_path))
    q = torch.zeros(1, 2, 3, 4)
    for extra in ({"s_aux": torch.zeros(2)}, {"softcap": 50.0}):
        with pytest.raises(ValueError, match="softcap.*s_aux.*not supported"):
            modeling.packed_attention(torch.nn.Module(), q, q, q, **extra)


def test_a_sliding_window_shorter_than_the_longest_sample_is_refused_at_start(tmp_path):
    """The packed attention applies no window, so a model whose window is shorter than max_prompt_length +
    max_response_length (64 + 8 here) is refused when the actor is built: Qwen2-MoE, which applies its window
    through the attention mask alone (before, ignored without a word: 0.22 off in log-probs), and Mistral, whose
    every layer slides; a window as long as the longest sample changes nothing and is accepted."""
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    tiny_text_family("qwen2_moe", str(tmp_path / "moe"), use_sliding_window=True, sliding_window=8,
                     max_window_layers=1, **moe)
    tiny_text_family("mistral", str(tmp_path / "mistral"), sliding_window=71)
    for name in ("moe", "mistral"):
        with pytest.raises(ValueError, match=r"sliding window \((8|71) tokens\) .* \(72\).*override_config") as e:
            make_actor(str(tmp_path / name))
        assert ("layer_types: [full_attention, ...]" in str(e.value)) == (name == "moe")  # Mistral has none
    tiny_text_family("mistral", str(tmp_path / "fits"), sliding_window=72)
    make_actor(str(tmp_path / "fits"))
    from transformers import Qwen3VLConfig  # no layer_types, a window in config.json, use_sliding_window off: none
    modeling.check_packable(Qwen3VLConfig(text_config={"sliding_window": 8, "use_sliding_window": False}), 72, "x")
    for name, drop in (("moe", {"sliding_window": None, "layer_types": ["full_attention"] * 2}),  # the advice works
                       ("mistral", {"sliding_window": None})):  # (use_sliding_window: false came too late: refused)
        make_actor(str(tmp_path / name), **{"model.override_config": drop})


def test_a_router_auxiliary_loss_asked_for_is_said_to_be_left_out(tmp_path, caplog):
    """A mixture of experts with output_router_logits (transformers would add router_aux_loss_coef x its auxiliary
    loss): the actor warns that the packed pass adds none, rather than leaving it out without a word."""
    tiny_text_family("qwen3_moe", str(tmp_path), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     output_router_logits=True)
    with caplog.at_level("WARNING", logger="modeling"):
        make_actor(str(tmp_path))
    assert "output_router_logits is set, but the packed pass adds no router auxiliary loss" in caplog.text


def test_lora_on_a_text_model_keeps_the_default_exclude_quiet(tmp_path, recwarn):
    """The default exclude_modules (.*visual.*) keeps adapters off a vision tower; a text model has none, and peft
    warned at every text LoRA run that the pattern excluded nothing. A pattern the user sets is still passed on."""
    tiny_text_family("qwen3", str(tmp_path))
    a = make_actor(str(tmp_path), **{"model.lora.rank": 4})
    assert any("lora_A" in name for name, _ in a.module.named_parameters())
    assert not [w for w in recwarn if "no modules were excluded" in str(w.message)]
    make_actor(str(tmp_path), **{"model.lora.rank": 4, "model.lora.exclude_modules": ".*nothing.*"})
    assert [w for w in recwarn if "exclude_modules=.*nothing.* but no modules were excluded" in str(w.message)]


def _tied_rank(rank, port, path, out):
    """One of two gloo ranks building the actor of a tied model (rank 1 on the meta device, rank 0's weights
    broadcast); -> {rank: (head is embeddings, parameters, optimizer parameters)}, then the optimizer's state dict."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    a = make_actor(path)
    seen = (a.hf.get_output_embeddings().weight is a.hf.get_input_embeddings().weight, len(list(a.module.parameters())),
            sum(len(group["params"]) for group in a.optimizer.param_groups))
    torch.save(seen, f"{out}.{rank}")
    get_optimizer_state_dict(a.module, a.optimizer)  # what a checkpoint saves: a KeyError on rank 1 before
    dist.destroy_process_group()
    leave_rank()


def test_a_tied_head_stays_tied_on_the_ranks_that_receive_rank_0s_weights(tmp_path):
    """enable_rank0_init (the default) on two ranks with tie_word_embeddings (Qwen2.5-VL-3B, Gemma): the broadcast
    load gave rank 1's head a tensor of its own, one parameter more in its optimizer, and the first checkpoint save
    failed with a KeyError. Now both ranks hold the same tied parameters and the optimizer state dict is built."""
    port, folder = _free_port(), str(tmp_path / "tied")
    tiny_text_family("qwen3", folder, tie_word_embeddings=True)
    codes = run_ranks(_tied_rank, [(r, port, folder, str(tmp_path / "seen")) for r in (0, 1)], timeout=240)
    seen = [torch.load(f"{tmp_path / 'seen'}.{r}") for r in (0, 1)]
    assert seen[0] == seen[1] and seen[0][0] and seen[0][1] == seen[0][2], seen
    assert codes == [0, 0], f"rank exit codes {codes}"


def test_recurrent_and_hybrid_models_are_refused_at_build(tmp_path):
    """LFM2's short convolutions and Falcon-H1's Mamba layers run across the packed row, past the boundaries that
    only attention is given: a later sequence's log-probs were off by up to 0.75, silently."""
    tiny_text_family("lfm2", str(tmp_path / "lfm2"), layer_types=["conv", "full_attention"])
    tiny_text_family("falcon_h1", str(tmp_path / "falcon_h1"), mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                     mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16)
    for name, mixer in (("lfm2", "conv"), ("falcon_h1", "hybrid, mamba")):
        with pytest.raises(ValueError, match=f"its {mixer} layers carry a state along the sequence"):
            make_actor(str(tmp_path / name))


def test_the_trainer_refuses_what_the_packed_pass_cannot_compute_before_any_worker(tmp_path, monkeypatch, capsys):
    """From the model's config on the driver, in seconds and one line, not after each worker loaded the weights."""
    import trainer

    monkeypatch.setattr(trainer, "WorkerGroup", lambda *a: pytest.fail("workers started before the refusal"))
    tiny_text_family("lfm2", str(tmp_path / "lfm2"), layer_types=["conv", "full_attention"])
    tiny_text_family("mistral", str(tmp_path / "mistral"), sliding_window=100)
    capsys.readouterr()  # the saves' progress bars
    lengths = ["data.max_prompt_length=64", "data.max_response_length=64"]  # the window holds the prompt, not both
    for name, message in (("lfm2", "its conv layers carry a state"), ("mistral", "its sliding window (100 tokens)")):
        code = trainer.main([f"worker.actor.model.model_path={tmp_path / name}", "worker.rollout.name=hf", *lengths,
                             f"trainer.save_checkpoint_path={tmp_path / 'run'}"])
        assert code == 2 and capsys.readouterr().err.startswith(f"config error: {tmp_path / name}: {message}")
    class Reached(Exception):
        pass

    def load_processor(*args, **kwargs):  # the step after the checks
        raise Reached

    monkeypatch.setattr(trainer.data, "load_processor", load_processor)
    with pytest.raises(Reached):  # the refusal's own advice passes: override_config is applied before the check
        trainer.main([f"worker.actor.model.model_path={tmp_path / 'mistral'}", "worker.rollout.name=hf", *lengths,
                      "worker.actor.model.override_config={sliding_window: null}",
                      f"trainer.save_checkpoint_path={tmp_path / 'run'}"])


def test_layer_types_decide_which_layers_slide_in_the_text_config():
    """Where a config lists layer_types, they say which layers slide (Qwen2-MoE with max_window_layers 0: none;
    Ministral: every one), and a VL model's window is its text config's."""
    from transformers import AutoConfig, Qwen2VLConfig

    none = AutoConfig.for_model("qwen2_moe", num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                                max_window_layers=0)
    assert none.layer_types == ["full_attention"] * 2
    modeling.check_packable(none, 72, "x")
    for config in (AutoConfig.for_model("ministral", num_hidden_layers=2, sliding_window=8),
                   Qwen2VLConfig(text_config={"num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 8,
                                              "max_window_layers": 1})):
        with pytest.raises(ValueError, match=r"sliding window \(8 tokens\)"):
            modeling.check_packable(config, 72, "x")
    with pytest.raises(ValueError, match="its chunked_attention layers attend in a pattern"):  # not "carry a state"
        modeling.check_packable(AutoConfig.for_model("llama4_text", num_hidden_layers=4), 72, "x")
    with pytest.raises(ValueError, match="its linear_attention layers carry a state"):  # Qwen3-Next, Qwen3.5: recurrent
        modeling.check_packable(AutoConfig.for_model("qwen3_next", num_hidden_layers=4), 72, "x")


def test_lora_says_what_it_adapts_and_that_fused_experts_stay_frozen(tmp_path, toy, caplog):
    """Qwen3-VL-MoE holds its experts fused (not Linear), which all-linear LoRA leaves out: attention-only adapters
    trained without a word before. The layers adapted are logged, and the frozen experts warned of."""
    import transformers as tf

    dense = tiny_family("qwen3_vl", str(tmp_path / "dense"), toy)[0].config
    text = {**dense.text_config.to_dict(), "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    config = tf.Qwen3VLMoeConfig(text_config=text, vision_config=dense.vision_config.to_dict(),
                                 **{k: getattr(dense, k) for k in ("image_token_id", "video_token_id",
                                                                   "vision_start_token_id", "vision_end_token_id")})
    tf.Qwen3VLMoeForConditionalGeneration(config).save_pretrained(tmp_path / "moe")
    with caplog.at_level("INFO", logger="modeling"):
        make_actor(str(tmp_path / "moe"), **{"model.lora.rank": 4})
    assert "LoRA rank 4 on k_proj, o_proj, q_proj, v_proj; every other weight frozen" in caplog.text
    assert [r for r in caplog.records if r.levelname == "WARNING" and "leaves the experts (model.language_model."
            "layers.0.mlp.experts, ...) frozen" in r.getMessage()]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_bf16_compute_gives_the_same_log_probs_from_bf16_pixel_values(family, tmp_path, toy):
    """trainer.py sends pixel values as bf16 when every pass computes in bf16 (half the bytes through Ray): the
    vision tower casts them to its weights' dtype first (autocast: bf16), so the log-probs must not move at all;
    in fp32 compute they do (the check can fail)."""
    import numpy
    from PIL import Image

    path = toy["vl_model"] if family == "qwen2_5_vl" else str(tmp_path / family)
    if family != "qwen2_5_vl":
        tiny_family(family, path, toy)
    noise = io.BytesIO()
    Image.fromarray(numpy.random.default_rng(0).integers(0, 256, (90, 120, 3), dtype=numpy.uint8)).save(noise, "PNG")
    row = {"problem": "<image>Which colour, <video>?", "answer": "red", "images": [noise.getvalue()],
           "videos": [clip(4, size=(64, 64), fps=2)]}
    prompt = builder(path, config(min_pixels=4096, max_pixels=16384, max_prompt_length=1024)).build(row, 0, "r0")
    sample = {**{k: prompt[k] for k in ("prompt_ids", "position_ids", "multi_modal_inputs")}, "response_ids": [11] * 5}
    as_bf16 = {**sample, "multi_modal_inputs": {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                                                for k, v in sample["multi_modal_inputs"].items()}}
    assert {k for k, v in sample["multi_modal_inputs"].items() if v.is_floating_point()} == \
        {"pixel_values", "pixel_values_videos"}
    for weights, compute, moves in (("fp32", "bf16", False), ("bf16", "bf16", False), ("fp32", "fp32", True)):
        a = make_actor(path, **{"fsdp.torch_dtype": weights, "fsdp.mp_param_dtype": compute})  # fp32: autocast
        (fp32_pixels,), (bf16_pixels,) = a.compute_log_probs([sample]), a.compute_log_probs([as_bf16])
        assert (not torch.equal(fp32_pixels, bf16_pixels)) == moves, (weights, compute, fp32_pixels - bf16_pixels)
