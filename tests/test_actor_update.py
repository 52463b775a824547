"""The update step of actor.Actor on the toy Qwen2.5-VL (fp32, CPU): on-policy ratio, independence of the
gradient from micro-batching and from the number of ranks, the non-finite-gradient skip, and that every
trainable parameter learns. Samples are built by hand from the toy processor."""

import json
import math
import os
import socket
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import actor as actor_module  # noqa: E402
from config import ActorConfig  # noqa: E402
from conftest import leave_rank, run_ranks  # noqa: E402

MAX_PROMPT, MAX_RESPONSE = 64, 8
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7  # fp32 sums in another order
LR = 1e-3
# Adam's first step is lr * g / (|g| + eps): an element whose |g| is near eps turns fp32 summation noise in
# g into a visible change of the step, so weights after a step agree only to a fraction of lr.
WEIGHT_ATOL = 0.05 * LR


# ----------------------------------------------------------------------------------------------
# Samples and actors
# ----------------------------------------------------------------------------------------------

def make_cfg(model_path, **overrides):
    """ActorConfig for the toy: fp32 master and compute, no checkpointing, plain AdamW, no clipping."""
    cfg = ActorConfig()
    cfg.model.model_path = model_path
    cfg.model.enable_gradient_checkpointing = False
    cfg.fsdp.torch_dtype = cfg.fsdp.mp_param_dtype = "fp32"
    cfg.optim.lr = LR
    cfg.optim.weight_decay = 0.0  # a parameter then changes only through its gradient
    cfg.max_grad_norm = 1e9  # no clipping: a wrongly scaled gradient must show
    cfg.global_batch_size = 2  # prompts per mini-batch: 2 x n_per_prompt = the 4 samples below
    cfg.dynamic_batching = False
    cfg.micro_batch_size_per_device_for_update = 4
    for key, value in overrides.items():
        obj = cfg
        *path, leaf = key.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, leaf, value)
    return cfg


def make_actor(cfg, training_steps=4):
    return actor_module.Actor(cfg, role="actor", temperature=1.0, device="cpu", max_prompt_length=MAX_PROMPT,
                              max_response_length=MAX_RESPONSE, n_per_prompt=2, training_steps=training_steps)


def build_samples(model_path):
    """Two prompts (one with a 56x56 image -> 4 image tokens, one text-only), two responses each, with
    advantages; position ids [4, P] from the model's own get_rope_index (built weightless on meta)."""
    from PIL import Image
    from transformers import AutoConfig, AutoModel, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    tok = processor.tokenizer
    with torch.device("meta"):
        rope_model = AutoModel.from_config(AutoConfig.from_pretrained(model_path))
    prompts = []
    for image, content in ((Image.new("RGB", (56, 56), (220, 30, 30)),
                            [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]),
                           (None, "What is 3 + 4 ?")):
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        out = processor(text=[text], images=[image] if image else None, add_special_tokens=False, return_tensors="pt")
        ids = out["input_ids"][0]  # [P]
        mm = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]} if image else {}
        mrope, _ = rope_model.get_rope_index(
            input_ids=ids[None], mm_token_type_ids=(ids == processor.image_token_id).long()[None],
            image_grid_thw=mm.get("image_grid_thw"), attention_mask=torch.ones_like(ids)[None])  # [3, 1, P]
        position_ids = torch.cat([torch.arange(len(ids))[None], mrope[:, 0]])  # [4, P]
        prompts.append({"prompt_ids": ids.tolist(), "multi_modal_inputs": mm, "position_ids": position_ids})
    assert sum(t == processor.image_token_id for t in prompts[0]["prompt_ids"]) == 4
    end = tok.convert_tokens_to_ids("<|im_end|>")
    words = [["red", "green"], ["blue", "yellow", "green", "red", "square"], ["7"], ["3", "+", "4", "is"]]
    advantages = [1.0, -1.0, 0.7, -0.7]
    samples = []
    for k, (response, advantage) in enumerate(zip(words, advantages)):
        ids = tok(" ".join(response), add_special_tokens=False)["input_ids"] + [end]
        samples.append(dict(prompts[k // 2], response_ids=ids, advantage=advantage))
    return samples


@pytest.fixture(scope="module")
def samples(toy):
    """The 4 samples with old log-probs from the model, shifted by +-0.4 on alternate tokens so that the
    update's ratios leave the clip range on some tokens (the gradient then depends on the clip branches)."""
    samples = build_samples(toy["vl_model"])
    old = make_actor(make_cfg(toy["vl_model"])).compute_log_probs(samples)
    for s, logp in zip(samples, old):
        shift = torch.tensor([0.4 if t % 2 else -0.4 for t in range(len(logp))])
        s["old_logprobs"] = logp + shift
    return samples


def on_policy_copy(actor, samples):
    """Copies of the samples with old log-probs = this actor's own (every ratio 1)."""
    fresh = [dict(s) for s in samples]
    for s, logp in zip(fresh, actor.compute_log_probs(fresh)):
        s["old_logprobs"] = logp
    return fresh


class Spy:
    """Wraps actor.policy_loss (as actor.py calls it) to record max |logp - old_logp| per micro-batch, and an
    actor's optimizer.step to record the gradients it is about to apply (full tensors, by parameter name)."""

    def __init__(self, monkeypatch=None):
        self.log_ratio_max, self.grads = [], []
        if monkeypatch is not None:
            real = actor_module.policy_loss

            def policy_loss(logp, old_logp, *args, **kwargs):
                self.log_ratio_max.append((logp.detach() - old_logp).abs().max().item())
                return real(logp, old_logp, *args, **kwargs)

            monkeypatch.setattr(actor_module, "policy_loss", policy_loss)

    def watch(self, actor):
        names = {id(p): n for n, p in actor.module.named_parameters()}
        real_step = actor.optimizer.step

        def step(*args, **kwargs):
            grads = {}
            for group in actor.optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = p.grad
                        grads[names[id(p)]] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
            self.grads.append(grads)
            return real_step(*args, **kwargs)

        actor.optimizer.step = step
        return actor


def params_of(actor):
    return {n: t.detach().clone() for n, t in actor.named_tensors()}


def assert_same_tensors(a, b, what, rtol=GRAD_RTOL, atol=GRAD_ATOL):
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b))[:5])
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {name}: {m}")


# ----------------------------------------------------------------------------------------------
# (1) On-policy first update
# ----------------------------------------------------------------------------------------------

def test_first_update_is_on_policy(toy, samples, monkeypatch):
    """Old log-probs from compute_log_probs, then update with one epoch: ratio exactly 1 on every token of
    the first mini-batch, clip fractions and ppo_kl exactly 0. With two mini-batches the second one is
    off-policy (the weights moved), which the same check sees."""
    spy = Spy(monkeypatch)
    cfg = make_cfg(toy["vl_model"], dynamic_batching=True, max_tokens_per_micro_batch=60)
    actor = make_actor(cfg)
    metrics = actor.update(on_policy_copy(actor, samples))
    assert len(spy.log_ratio_max) >= 2, "expected several micro-batches under a 60-token budget"
    assert spy.log_ratio_max == [0.0] * len(spy.log_ratio_max)
    assert metrics["actor/ppo_kl"] == 0.0
    assert metrics["actor/pg_clipfrac_higher"] == 0.0 and metrics["actor/pg_clipfrac_lower"] == 0.0
    assert metrics["actor/skipped_steps"] == 0.0 and math.isfinite(metrics["actor/grad_norm"])

    spy.log_ratio_max.clear()
    actor = make_actor(make_cfg(toy["vl_model"], global_batch_size=1, micro_batch_size_per_device_for_update=1))
    metrics = actor.update(on_policy_copy(actor, samples))  # 2 mini-batches of 2 samples, 1 sample per micro-batch
    assert spy.log_ratio_max[:2] == [0.0, 0.0]
    assert min(spy.log_ratio_max[2:]) > 1e-5, spy.log_ratio_max
    assert metrics["actor/ppo_kl"] != 0.0


# ----------------------------------------------------------------------------------------------
# (2) Micro-batching and ranks do not change the update
# ----------------------------------------------------------------------------------------------

def one_step(model_path, samples, **overrides):
    """-> (gradient applied at the first optimizer step, parameters after it, metrics) for one update."""
    spy = Spy()
    actor = spy.watch(make_actor(make_cfg(model_path, **overrides)))
    metrics = actor.update([dict(s) for s in samples])
    return spy.grads[0], params_of(actor), metrics


@pytest.mark.parametrize("mode", ["token", "seq", "seq_sum_norm"])
def test_micro_batch_split_gives_same_update(toy, samples, mode, monkeypatch):
    """4 samples in 1, 2 or 4 micro-batches: the same gradient (to fp32 summation order) and the same weights
    after the step, for each loss_avg_mode. The gradients of the modes differ from each other."""
    spy = Spy(monkeypatch)
    results = {}
    for per_micro in (4, 2, 1):
        spy.log_ratio_max.clear()
        results[per_micro] = one_step(toy["vl_model"], samples, loss_avg_mode=mode,
                                      micro_batch_size_per_device_for_update=per_micro)
        assert len(spy.log_ratio_max) == 4 // per_micro  # the split really happened
    grad, params, metrics = results[4]
    assert max(g.abs().max().item() for g in grad.values()) > 1e-4
    for per_micro in (2, 1):
        assert_same_tensors(results[per_micro][0], grad, f"{mode}: gradient, {4 // per_micro} micro-batches vs 1")
        assert_same_tensors(results[per_micro][1], params, f"{mode}: weights, {4 // per_micro} micro-batches vs 1",
                            rtol=0, atol=WEIGHT_ATOL)
        assert math.isclose(results[per_micro][2]["actor/grad_norm"], metrics["actor/grad_norm"], rel_tol=1e-4)
    if mode != "token":  # the modes weigh tokens differently: a check that the mode reached the loss
        token_grad = one_step(toy["vl_model"], samples, loss_avg_mode="token")[0]
        name = "lm_head.weight" if "lm_head.weight" in grad else next(iter(grad))
        assert (token_grad[name] - grad[name]).abs().max() > 1e-3 * grad[name].abs().max()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, model_path, samples_path, out_path):
    """One gloo rank: its half of the samples, one update per loss_avg_mode; rank 0 saves the results."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        samples = torch.load(samples_path, weights_only=False)
        mine = samples[rank * 2:(rank + 1) * 2]  # rank 0: the image prompt's 2 responses, rank 1: the text prompt's
        results = {}
        for mode in ("token", "seq", "seq_sum_norm"):
            results[mode] = one_step(model_path, mine, loss_avg_mode=mode, micro_batch_size_per_device_for_update=1)
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()
    leave_rank()


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(toy, samples, tmp_path):
    """2 ranks x 2 micro-batches of 1 sample vs 1 process x 1 micro-batch of 4: the same gradient and the
    same weights after the step, for each loss_avg_mode (FSDP2 shards, world-size scaling, global counts)."""
    torch.save([dict(s) for s in samples], tmp_path / "samples.pt")
    port = _free_port()
    codes = run_ranks(_rank_main, [(r, 2, port, toy["vl_model"], str(tmp_path / "samples.pt"), str(tmp_path / "out.pt"))
                                   for r in range(2)], timeout=300)
    assert codes == [0, 0], f"rank exit codes {codes} (-15: still running after 300 s and killed; a collective hung?)"
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    for mode in ("token", "seq", "seq_sum_norm"):
        grad, params, metrics = one_step(toy["vl_model"], samples, loss_avg_mode=mode)
        assert_same_tensors(out[mode][0], grad, f"{mode}: gradient, 2 ranks vs 1 process")
        assert_same_tensors(out[mode][1], params, f"{mode}: weights, 2 ranks vs 1 process", rtol=0, atol=WEIGHT_ATOL)
        assert math.isclose(out[mode][2]["actor/grad_norm"], metrics["actor/grad_norm"], rel_tol=1e-4)


# ----------------------------------------------------------------------------------------------
# (3) A non-finite gradient skips the step
# ----------------------------------------------------------------------------------------------

def test_nan_gradient_skips_the_step(toy, samples):
    actor = make_actor(make_cfg(toy["vl_model"], global_batch_size=1))  # 2 mini-batches -> 2 optimizer steps
    before = params_of(actor)
    victim = dict(actor.module.named_parameters())["model.language_model.layers.0.mlp.up_proj.weight"]
    handle = victim.register_hook(lambda g: g * float("nan"))
    metrics = actor.update([dict(s) for s in samples])
    handle.remove()
    assert metrics["actor/skipped_steps"] == 2.0
    assert_same_tensors(params_of(actor), before, "weights after skipped steps", rtol=0, atol=0)
    assert all(p.grad is None for p in actor.module.parameters()), "gradients left behind after a skipped step"
    # The same actor then steps normally: the skip left nothing behind that blocks learning.
    metrics = actor.update([dict(s) for s in samples])
    assert metrics["actor/skipped_steps"] == 0.0 and math.isfinite(metrics["actor/grad_norm"])
    after = params_of(actor)
    assert any(not torch.equal(after[n], before[n]) for n in before)
    # Weights that a step of finite gradients makes non-finite stop the run before they are synced or saved.
    step = actor.optimizer.step
    actor.optimizer.step = lambda: (step(), victim.data.view(-1)[:3].fill_(float("nan")))
    with pytest.raises(FloatingPointError, match=r"not finite after .* \['model.language_model.layers.0.mlp.up_proj"):
        actor.update([dict(s) for s in samples])


@pytest.mark.parametrize("key", ["old_logprobs", "ref_logprobs", "advantage"])
def test_a_non_finite_input_is_an_error_naming_the_sample(toy, samples, key):
    """A NaN old or reference log-prob went through: the clamp's backward zeroed that token's gradient, the step
    was applied with the token still counted, and nothing was said (pg_loss NaN, skipped_steps 0)."""
    actor = actor_module.Actor(make_cfg(toy["vl_model"], global_batch_size=1), role="actor", temperature=1.0,
                               device="cpu", max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE,
                               n_per_prompt=2, training_steps=4, use_kl_loss=True, kl_coef=0.1)
    before = params_of(actor)
    bad = [dict(s, ref_logprobs=s["old_logprobs"] - 0.1) for s in samples]
    value = torch.as_tensor(bad[1][key], dtype=torch.float32).clone().reshape(-1)
    value[-1] = float("nan")
    bad[1][key] = value
    with pytest.raises(ValueError, match=rf"sample 1 \(uid .*\): {key} has non-finite values at tokens \["):
        actor.update(bad)
    assert_same_tensors(params_of(actor), before, "weights after the refused update", rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# (4) Every trainable parameter learns
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("freeze_vision", [False, True])
def test_two_steps_change_every_trainable_parameter(toy, samples, freeze_vision):
    """Weight decay 0, so a parameter changes only through its gradient. Two optimizer steps (2 mini-batches:
    the image prompt's, then the text prompt's) change every trainable tensor, the vision tower included;
    with freeze_vision_tower the tower is untouched and not trainable."""
    actor = make_actor(make_cfg(toy["vl_model"], global_batch_size=1, **{"model.freeze_vision_tower": freeze_vision}))
    trainable = {n for n, p in actor.module.named_parameters() if p.requires_grad}
    vision = {n for n, _ in actor.module.named_parameters() if ".visual." in f".{n}"}
    assert vision and (trainable.isdisjoint(vision) if freeze_vision else vision <= trainable)
    before = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
    metrics = actor.update([dict(s) for s in samples])
    assert metrics["actor/skipped_steps"] == 0.0 and actor.optimizer_steps == 2
    after = dict(actor.module.named_parameters())
    unchanged = sorted(n for n in trainable if torch.equal(after[n].detach(), before[n]))
    assert not unchanged, f"trainable parameters not changed by two steps: {unchanged}"
    frozen_changed = sorted(n for n in set(before) - trainable if not torch.equal(after[n].detach(), before[n]))
    assert not frozen_changed, f"frozen parameters changed: {frozen_changed}"


# ----------------------------------------------------------------------------------------------
# The KL term and TIS reach the loss (metrics against numbers worked out by hand)
# ----------------------------------------------------------------------------------------------

def test_kl_term_and_tis_reach_the_update(toy, samples):
    """On policy, with ref = old - 0.3 and rollout = old + 0.5 on every token and tis_cap 2: each token has
    d = 0.3, so actor/kl_loss = k3(0.3) = e^-0.3 + 0.3 - 1; the TIS weight is e^-0.5 on every token; the
    per-token loss is -A e^-0.5, so actor/pg_loss = -e^-0.5 sum_i A_i |o_i| / sum_i |o_i| (token mean)."""
    actor = actor_module.Actor(make_cfg(toy["vl_model"], tis_cap=2.0), role="actor", temperature=1.0, device="cpu",
                               max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE, n_per_prompt=2,
                               training_steps=4, use_kl_loss=True, kl_coef=0.1, kl_penalty="low_var_kl")
    fresh = [dict(s) for s in samples]
    for s, logp in zip(fresh, actor.compute_log_probs(fresh)):
        s.update(old_logprobs=logp, ref_logprobs=logp - 0.3, rollout_logprobs=logp + 0.5)
    metrics = actor.update(fresh)
    lengths = [len(s["response_ids"]) for s in fresh]
    advantage_tokens = sum(s["advantage"] * n for s, n in zip(fresh, lengths))
    assert math.isclose(metrics["actor/kl_loss"], math.exp(-0.3) + 0.3 - 1.0, rel_tol=1e-5)
    assert math.isclose(metrics["actor/tis_weight"], math.exp(-0.5), rel_tol=1e-5)
    assert metrics["actor/tis_capfrac"] == 0.0
    assert math.isclose(metrics["actor/rollout_logp_abs_diff"], 0.5, rel_tol=1e-5)
    assert math.isclose(metrics["actor/pg_loss"], -math.exp(-0.5) * advantage_tokens / sum(lengths), rel_tol=1e-5)
    assert metrics["actor/tokens"] == sum(lengths) and metrics["actor/entropy"] > 0.0


def test_kl_gradient_enters_with_kl_coef(toy, samples):
    """grad(pg + 0.1 KL) - grad(pg) = 0.1 grad(KL alone, advantages 0): the coefficient scales a real KL gradient."""
    def grad_with(kl_coef, advantage_scale):
        spy = Spy()
        actor = spy.watch(actor_module.Actor(
            make_cfg(toy["vl_model"]), role="actor", temperature=1.0, device="cpu", max_prompt_length=MAX_PROMPT,
            max_response_length=MAX_RESPONSE, n_per_prompt=2, training_steps=4, use_kl_loss=True, kl_coef=kl_coef,
            kl_penalty="mse"))
        fresh = [dict(s, advantage=s["advantage"] * advantage_scale,
                      ref_logprobs=s["old_logprobs"] - torch.linspace(-0.5, 0.5, len(s["response_ids"])))
                 for s in samples]
        actor.update(fresh)
        return spy.grads[0]

    both, pg_only, kl_only = grad_with(0.1, 1.0), grad_with(0.0, 1.0), grad_with(1.0, 0.0)
    assert max(g.abs().max().item() for g in kl_only.values()) > 1e-4
    assert_same_tensors({n: both[n] - pg_only[n] for n in both}, {n: 0.1 * g for n, g in kl_only.items()},
                        "KL gradient", rtol=1e-3, atol=1e-7)


def test_per_token_advantages_reach_the_loss(toy, samples):
    """REINFORCE++ hands one advantage per token. On policy (ratio 1) the default loss of token t is -A_t, so
    actor/pg_loss = -sum_t A_t / tokens; with A_t = t + 1 inside each response of length L that is
    -sum_i L_i (L_i + 1) / 2 / sum_i L_i. A float advantage still broadcasts; a wrong length is an error."""
    actor = actor_module.Actor(make_cfg(toy["vl_model"]), role="actor", temperature=1.0, device="cpu",
                               max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE, n_per_prompt=2,
                               training_steps=4)
    fresh = [dict(s) for s in samples]
    for s, logp in zip(fresh, actor.compute_log_probs(fresh)):
        s.update(old_logprobs=logp, advantage=torch.arange(1.0, len(s["response_ids"]) + 1))
    lengths = [len(s["response_ids"]) for s in fresh]
    metrics = actor.update(fresh)
    assert math.isclose(metrics["actor/pg_loss"], -sum(n * (n + 1) / 2 for n in lengths) / sum(lengths), rel_tol=1e-5)
    fresh[0]["advantage"] = torch.zeros(lengths[0] + 1)
    with pytest.raises(ValueError, match="advantage has"):
        actor.update(fresh)


def test_a_mini_batch_of_empty_responses_gives_zero_losses_not_nan(toy, samples):
    """Every response empty: no tokens, so actor/pg_loss and actor/kl_loss are 0 (not 0 / 0 = NaN), the gradient is
    zero and the step is not counted as skipped."""
    actor = actor_module.Actor(make_cfg(toy["vl_model"]), role="actor", temperature=1.0, device="cpu",
                               max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE, n_per_prompt=2,
                               training_steps=4, use_kl_loss=True, kl_coef=0.1)
    empty = [dict(s, response_ids=[], old_logprobs=torch.zeros(0), ref_logprobs=torch.zeros(0)) for s in samples]
    metrics = actor.update(empty)
    assert metrics["actor/pg_loss"] == 0.0 and metrics["actor/kl_loss"] == 0.0, metrics
    assert metrics["actor/tokens"] == 0.0 and metrics["actor/skipped_steps"] == 0.0 and metrics["actor/grad_norm"] == 0


def test_pack_samples_rejects_image_samples_it_would_pack_wrong():
    """An image sample of a VL model needs its mrope positions (3 or 4 rows): with none, or one row, its image
    tokens would silently get text positions 0..P-1; rows of another length than the prompt are refused too. A text
    model given images says so (no TypeError)."""
    from modeling import pack_samples

    image = {"pixel_values": torch.zeros(16, 8), "image_grid_thw": torch.tensor([[1, 4, 4]])}  # 4 tokens, merge 2
    sample = {"prompt_ids": [1, 9, 9, 9, 9, 2], "response_ids": [3], "multi_modal_inputs": image}
    for positions in (None, torch.arange(6)[None], torch.zeros(3, 5, dtype=torch.long)):
        with pytest.raises(ValueError, match="sample 0: .*position_ids"):
            pack_samples([dict(sample, position_ids=positions)], True, image_token_id=9, video_token_id=8, merge=2)
    mrope = torch.tensor([[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]])
    batch = pack_samples([dict(sample, position_ids=mrope)], True, image_token_id=9, video_token_id=8, merge=2)
    assert batch["position_ids"][:, 0].tolist() == [list(range(7))] + [row + [4] for row in mrope.tolist()]
    with pytest.raises(ValueError, match="sample 0: .*text model"):
        pack_samples([sample], False)


# ----------------------------------------------------------------------------------------------
# The optimizer set-up, the metrics over steps and epochs, the default budget, dtypes and RNG (by hand)
# ----------------------------------------------------------------------------------------------

def test_two_adamw_steps_by_hand_decay_only_matrices(toy, samples):
    """Two optimizer steps (2 mini-batches), weight decay 10 (lr x wd = 1%: above the tolerance), betas (0.8, 0.99):
    every trainable parameter ends where plain AdamW arithmetic on the applied gradients puts it; 1-D: no decay."""
    actor = make_actor(make_cfg(toy["vl_model"], global_batch_size=1, **{"optim.weight_decay": 10.0,
                                                                          "optim.betas": [0.8, 0.99]}))
    spy = Spy()
    spy.watch(actor)
    before = {n: p.detach().clone() for n, p in actor.module.named_parameters() if p.requires_grad}
    actor.update([dict(s) for s in samples])
    assert len(spy.grads) == 2
    (b1, b2), eps, wd = (0.8, 0.99), 1e-8, 10.0
    after = dict(actor.module.named_parameters())
    assert any(p.ndim < 2 for p in before.values()) and any(p.ndim >= 2 for p in before.values())
    for name, p in before.items():
        p, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
        for t, grads in enumerate(spy.grads, start=1):
            g = grads[name]
            p = p * (1 - LR * (wd if p.ndim >= 2 else 0.0))
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            p = p - LR * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        torch.testing.assert_close(after[name].detach(), p, rtol=0, atol=WEIGHT_ATOL, msg=lambda s: f"{name}: {s}")


def test_two_ppo_epochs_average_losses_over_steps_and_count_tokens_once(toy, samples):
    """lr 0, so the second epoch is on policy too: actor/pg_loss is the one-epoch value -sum_i A_i L_i / sum_i L_i
    (not twice it), actor/tokens is sum_i L_i per epoch, and the one mini-batch gives two optimizer steps."""
    actor = make_actor(make_cfg(toy["vl_model"], ppo_epochs=2, **{"optim.lr": 0.0}))
    fresh = on_policy_copy(actor, samples)
    metrics = actor.update(fresh)
    lengths = [len(s["response_ids"]) for s in fresh]
    expected = -sum(s["advantage"] * n for s, n in zip(fresh, lengths)) / sum(lengths)
    assert math.isclose(metrics["actor/pg_loss"], expected, rel_tol=1e-5), (metrics["actor/pg_loss"], expected)
    assert metrics["actor/tokens"] == sum(lengths) and actor.optimizer_steps == 2
    assert metrics["actor/ppo_kl"] == 0.0


def test_grad_norm_is_the_mean_of_the_finite_step_norms(toy, samples):
    """Two optimizer steps: actor/grad_norm is the mean of the two applied gradients' global 2-norms (no clipping);
    with the first step's gradient made NaN it is the second step's norm alone, and one step is skipped."""
    def norm(grads):
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()

    for poison_first in (False, True):
        spy = Spy()
        actor = spy.watch(make_actor(make_cfg(toy["vl_model"], global_batch_size=1)))
        calls = []
        victim = dict(actor.module.named_parameters())["model.language_model.layers.0.mlp.up_proj.weight"]
        victim.register_hook(lambda g: (calls.append(1), g * float("nan") if poison_first and len(calls) == 1
                                        else g)[1])
        metrics = actor.update([dict(s) for s in samples])
        norms = [norm(g) for g in spy.grads]
        assert len(calls) == 2 and len(norms) == (1 if poison_first else 2)
        assert metrics["actor/skipped_steps"] == (1.0 if poison_first else 0.0)
        assert math.isclose(metrics["actor/grad_norm"], sum(norms) / len(norms), rel_tol=1e-5), (metrics, norms)
        if not poison_first:
            assert abs(norms[0] - norms[1]) > 1e-3 * norms[0]  # the mean differs from either step's norm


def test_entropy_and_rollout_metrics_without_tis_cap(toy, samples):
    """On policy, actor/entropy is the token mean of compute_log_probs' entropies; rollout log-probs on every sample
    give actor/rollout_logp_abs_diff (here 0.5) without tis_cap, and none when one sample lacks them."""
    actor = make_actor(make_cfg(toy["vl_model"]))
    fresh = [dict(s) for s in samples]
    logps, entropies = actor.compute_log_probs(fresh, with_entropy=True)
    for s, logp in zip(fresh, logps):
        s.update(old_logprobs=logp, rollout_logprobs=logp - 0.5)
    expected = sum(e.sum().item() for e in entropies) / sum(len(e) for e in entropies)
    assert [len(e) for e in entropies] == [len(s["response_ids"]) for s in fresh] and expected > 0
    metrics = actor.update(fresh)
    assert math.isclose(metrics["actor/entropy"], expected, rel_tol=1e-5), (metrics["actor/entropy"], expected)
    assert math.isclose(metrics["actor/rollout_logp_abs_diff"], 0.5, rel_tol=1e-5)
    del fresh[1]["rollout_logprobs"]
    assert "actor/rollout_logp_abs_diff" not in actor.update(fresh)


def test_an_update_without_samples_is_an_error_and_leaves_the_schedule(toy):
    """update([]) made no optimizer step but moved the LR schedule on: now a ValueError, the schedule where it was."""
    actor = make_actor(make_cfg(toy["text_model"], **{"optim.lr_warmup_steps": 2}))
    with pytest.raises(ValueError, match="0 samples on rank 0"):
        actor.update([])
    assert actor.lr_scheduler.last_epoch == 0 and actor.optimizer.param_groups[0]["lr"] == 0.0


def test_default_token_budget_is_micro_batch_size_times_prompt_plus_response(toy):
    """No max_tokens_per_micro_batch, micro_batch_size_per_device_for_update 2: the budget is 2 x (64 + 8) = 144,
    so four text samples of 70 tokens pack two by two, balanced: [[0, 2], [1, 3]] (136 tokens would need 4)."""
    actor = make_actor(make_cfg(toy["text_model"], dynamic_batching=True, micro_batch_size_per_device_for_update=2))
    four = [{"prompt_ids": [5] * 62, "response_ids": [6] * 8} for _ in range(4)]
    assert actor._plan(four, "update") == [[0, 2], [1, 3]]


def test_master_and_compute_dtypes_of_actor_and_reference(toy):
    """torch_dtype null: the actor's master weights are fp32 and its passes compute in bf16 (log-probs off the fp32
    ones by bf16 rounding); the reference stores bf16."""
    cfg = make_cfg(toy["text_model"], **{"fsdp.torch_dtype": None, "fsdp.mp_param_dtype": "bf16"})
    policy = make_actor(cfg)
    assert {p.dtype for p in policy.module.parameters()} == {torch.float32} and policy.autocast
    text = [{"prompt_ids": [11, 12, 13, 14], "response_ids": [20, 21, 22, 23, 24, 25]}]
    fp32 = make_actor(make_cfg(toy["text_model"])).compute_log_probs(text)[0]
    assert (policy.compute_log_probs(text)[0] - fp32).abs().max() > 1e-4
    ref = actor_module.Actor(cfg, role="ref", device="cpu", max_prompt_length=MAX_PROMPT,
                             max_response_length=MAX_RESPONSE)
    assert {p.dtype for p in ref.module.parameters()} == {torch.bfloat16} and ref.optimizer is None


def _one_worker_main(port, model_path, samples_path, out_path):
    """workers.Worker.setup for one CPU worker with fp32 master weights and bf16 compute; saves whether it made a
    process group and the policy's and the reference's log-probs of the samples."""
    import torch.distributed as dist

    import workers
    from config import load_config

    torch.set_num_threads(1)
    cfg = load_config(overrides=[f"worker.actor.model.model_path={model_path}", "worker.actor.fsdp.torch_dtype=null",
                                 "worker.actor.fsdp.mp_param_dtype=bf16", "worker.ref.fsdp.mp_param_dtype=bf16",
                                 "algorithm.disable_kl=false", "worker.rollout.name=hf", "data.max_prompt_length=64",
                                 "data.max_response_length=8", "worker.actor.global_batch_size=2", "worker.rollout.n=2",
                                 "trainer.n_gpus_per_node=1", "data.rollout_batch_size=2",
                                 "worker.actor.dynamic_batching=false",
                                 "worker.actor.micro_batch_size_per_device_for_update=4",
                                 "worker.actor.micro_batch_size_per_device_for_experience=4"])  # one micro-batch each:
    # bf16 GEMMs round a row by the shape of the whole batch, so only equal packing gives equal log-probs
    worker = workers.Worker()
    worker.setup(cfg, 0, 1, ("127.0.0.1", port), "cpu", 1)
    samples = torch.load(samples_path, weights_only=False)
    torch.save({"group": dist.is_initialized(), "old": worker.log_probs(samples, "old"),
                "ref": worker.log_probs(samples, "ref")}, out_path)
    leave_rank()


def test_one_worker_with_mixed_precision_computes_as_its_reference(toy, samples, tmp_path):
    """fp32 master weights with bf16 compute on one worker: FSDP2 over a one-rank group casts the policy's weights to
    bf16 as the reference stores them, so the two agree exactly before the first update (KL 0 at step 1). Autocast
    over the fp32 weights kept an fp32 residual stream: log-probs off by ~1e-3, the KL at step 1 above 0."""
    torch.save([dict(s) for s in samples], tmp_path / "samples.pt")
    codes = run_ranks(_one_worker_main, [(_free_port(), toy["vl_model"], str(tmp_path / "samples.pt"),
                                          str(tmp_path / "out.pt"))], timeout=300)
    assert codes == [0], f"exit code {codes}"
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["group"]
    for old, ref in zip(out["old"], out["ref"]):
        assert torch.equal(old, ref), (old - ref).abs().max()


def test_bf16_master_weights_with_plain_adamw_warn(toy, caplog):
    """The warning about lost small steps comes for bf16 master weights with optim.strategy adamw only."""
    import logging

    for dtype, strategy, warned in (("bf16", "adamw", True), ("bf16", "adamw_bf16", False), ("fp32", "adamw", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="actor"):
            make_actor(make_cfg(toy["text_model"], **{"fsdp.torch_dtype": dtype, "fsdp.mp_param_dtype": dtype,
                                                      "optim.strategy": strategy}))
        assert any("loses steps" in r.getMessage() for r in caplog.records) == warned, (dtype, strategy)


def test_load_checkpoint_restores_step_count_and_rng(toy, tmp_path):
    """After load_checkpoint the optimizer step count and the python and torch CPU RNG streams are those saved."""
    import random

    actor = make_actor(make_cfg(toy["text_model"]))
    actor.optimizer_steps = 7
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    expected = (random.random(), torch.rand(4))
    actor.optimizer_steps = 99
    random.seed(123)
    torch.manual_seed(123)
    actor.load_checkpoint(str(tmp_path / "ckpt"))
    assert actor.optimizer_steps == 7
    got = (random.random(), torch.rand(4))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])


def test_a_resume_takes_this_runs_lr_betas_and_weight_decay_and_the_schedules_position(toy, samples, tmp_path):
    """Saved after one step with lr 1e-3 and a 4-step warm-up; resumed with lr 1e-2, betas (0.8, 0.9) and weight
    decay 0.1: the optimizer's loaded state must not bring back the old settings. The schedule stands at step 1,
    so the next step runs at 1e-2 x 1/4 and logs it."""
    old = make_actor(make_cfg(toy["vl_model"], **{"optim.lr": 1e-3, "optim.lr_warmup_steps": 4}))
    old.update(on_policy_copy(old, samples))
    old.save_checkpoint(str(tmp_path / "ckpt"))
    new = make_actor(make_cfg(toy["vl_model"], **{"optim.lr": 1e-2, "optim.lr_warmup_steps": 4,
                                                  "optim.betas": [0.8, 0.9], "optim.weight_decay": 0.1}))
    new.load_checkpoint(str(tmp_path / "ckpt"))
    groups = new.optimizer.param_groups
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in groups] == [(2.5e-3, (0.8, 0.9), 0.1),
                                                                         (2.5e-3, (0.8, 0.9), 0.0)]
    assert new.update(on_policy_copy(new, samples))["actor/lr"] == 2.5e-3
    assert groups[0]["lr"] == 5e-3  # step 2 of the warm-up


def test_a_resume_across_lora_and_full_fine_tuning_names_both(toy, tmp_path):
    """A full checkpoint into a LoRA run and back (DCP said 'Missing key ... lm_head.weight'), and another rank."""
    full, lora, lora8 = (make_cfg(toy["text_model"], **{"model.lora.rank": r}) for r in (0, 4, 8))
    alpha8 = make_cfg(toy["text_model"], **{"model.lora.rank": 4, "model.lora.alpha": 8})  # resumed without a word
    fewer = make_cfg(toy["text_model"], **{"model.lora.rank": 4, "model.lora.target_modules": "q_proj,v_proj"})
    make_actor(full).save_checkpoint(str(tmp_path / "full"))
    make_actor(lora).save_checkpoint(str(tmp_path / "lora"))
    for path, cfg, message in (("full", lora, "model.lora.rank=0, this run has model.lora.rank=4"),
                               ("lora", full, "model.lora.rank=4, this run has model.lora.rank=0"),
                               ("lora", lora8, "model.lora.rank=4, this run has model.lora.rank=8"),
                               ("lora", alpha8, "model.lora.alpha=64, this run has model.lora.alpha=8"),
                               ("lora", fewer, "model.lora.target_modules=all-linear, this run has "
                                               "model.lora.target_modules=q_proj,v_proj")):
        with pytest.raises(ValueError, match=f"holds the state of {message}"):
            make_actor(cfg).load_checkpoint(str(tmp_path / path))
    os.remove(tmp_path / "lora" / "huggingface" / "adapter_config.json")  # the rank is in extra_state.pt too
    with pytest.raises(ValueError, match="holds the state of model.lora.rank=4, this run has model.lora.rank=0"):
        make_actor(full).load_checkpoint(str(tmp_path / "lora"))


def test_lora_on_a_head_tied_to_the_embeddings_is_refused(toy, tmp_path):
    """The actor adapted the head; the rollout, sent the merged head and the embeddings, wrote both into the one
    tensor they share, so it sampled from another model (rollout/logp_diff 0.03 in fp32, and no error)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(toy["text_model"])
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tied")
    head = make_cfg(str(tmp_path / "tied"), **{"model.lora.rank": 4, "model.lora.target_modules": "q_proj,lm_head"})
    with pytest.raises(ValueError, match="target_modules='q_proj,lm_head' puts LoRA on the LM head .* ties"):
        make_actor(head)
    make_actor(make_cfg(str(tmp_path / "tied"), **{"model.lora.rank": 4, "model.lora.target_modules": "q_proj"}))
    # An untied embedding: peft's LoRA Embedding keeps lora_embedding_A/B, which the weight sync never merged (it
    # failed at the first sync with KeyError 'default'): refused at start-up, naming the layer.
    embed = make_cfg(toy["text_model"], **{"model.lora.rank": 4, "model.lora.target_modules": "embed_tokens,q_proj"})
    with pytest.raises(ValueError, match="puts LoRA on .*embed_tokens, not a Linear layer"):
        make_actor(embed)
    nothing = make_cfg(toy["text_model"], **{"model.lora.rank": 4, "model.lora.target_modules": "foo_proj"})
    with pytest.raises(ValueError, match=r"lora.target_modules='foo_proj', exclude_modules=.* \(a regex\): "):
        make_actor(nothing)  # peft's own words named neither key


def test_a_config_that_ties_a_head_stored_apart_is_refused(toy, tmp_path):
    """config.json ties the head to the embeddings but the weights hold two tensors: transformers keeps them apart
    (a warning), vLLM ties them and samples with the embeddings as the head, and merge.py wrote the embeddings only
    (log-probs 7.6 off the trained model's). An error at start-up names the override that loads it as stored."""
    import shutil

    shutil.copytree(toy["text_model"], tmp_path / "untied")
    config = json.loads((tmp_path / "untied" / "config.json").read_text())
    (tmp_path / "untied" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="ties the LM head to the input embeddings, .*{tie_word_embeddings: false}"):
        make_actor(make_cfg(str(tmp_path / "untied")))
    policy = make_actor(make_cfg(str(tmp_path / "untied"), **{"model.override_config": {"tie_word_embeddings": False}}))
    assert policy.hf.get_output_embeddings().weight is not policy.hf.get_input_embeddings().weight


def test_checkpoint_hf_files_carry_override_config_and_the_lora_adapter_config(toy, tmp_path):
    """huggingface/ of a LoRA actor's checkpoint: config.json with model.override_config applied, the tokenizer,
    and adapter_config.json with the LoRA rank and alpha; a plain save_hf_files writes no adapter config."""
    import json

    cfg = make_cfg(toy["text_model"], **{"model.lora.rank": 4, "model.lora.alpha": 8,
                                         "model.override_config": {"max_position_embeddings": 4096}})
    make_actor(cfg).save_checkpoint(str(tmp_path / "ckpt"), model_only=True)
    hf = tmp_path / "ckpt" / "huggingface"
    assert json.loads((hf / "config.json").read_text())["max_position_embeddings"] == 4096
    adapter = json.loads((hf / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8)
    assert (hf / "tokenizer_config.json").exists() and not (tmp_path / "ckpt" / "optim").exists()
    actor_module.save_hf_files(cfg.model, str(tmp_path / "plain"))
    assert not (tmp_path / "plain" / "adapter_config.json").exists()


def test_old_log_probs_are_packed_by_mini_batch_as_in_the_update(toy, samples, monkeypatch):
    """Dynamic batching with room for all 4 samples, mini-batches of 2: compute_log_probs packs each mini-batch as
    the update does (not all 4 at once), so the first mini-batch's ratio is exactly 1 (packing 4 moves fp32 bits on
    some machines, not all: the packed index lists are compared too)."""
    spy, packed, pack = Spy(monkeypatch), [], actor_module.Actor._pack
    monkeypatch.setattr(actor_module.Actor, "_pack", lambda self, s, i: packed.append(list(i)) or pack(self, s, i))
    actor = make_actor(make_cfg(toy["vl_model"], dynamic_batching=True, max_tokens_per_micro_batch=4096,
                                global_batch_size=1))
    actor.update(on_policy_copy(actor, samples))
    assert len(spy.log_ratio_max) == 2 and spy.log_ratio_max[0] == 0.0, spy.log_ratio_max
    assert packed == [[0, 1], [2, 3]] * 2, packed  # compute_log_probs, then the update
