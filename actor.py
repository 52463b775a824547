"""actor.py: the policy being trained and the frozen reference, and the objective they are trained on.

A training step asks three passes of it, each on a list of sample dicts:
    compute_log_probs  log pi(y_t) of every response token (and its entropy): the old policy, or the reference
    update             per packed micro-batch: policy_loss -> aggregate_loss with the mini-batch's global counts
                       (+ kl_coef x that of kl_penalty), backward; one clipped optimizer step per mini-batch and epoch
    named_tensors      the full weights, one tensor at a time, for the rollout engine
and save_checkpoint / load_checkpoint. The objective (policy_loss, aggregate_loss, kl_penalty: the section first
below) needs only torch; the Actor needs modeling.py and a worker.actor section as its cfg (config.py's ActorConfig).

A sample (built by trainer.py) holds:
    uid                 str          its prompt's group id, for errors (workers.py keeps a group on one rank if it can)
    prompt_ids          list[int]    chat-templated prompt, image placeholders expanded
    response_ids        list[int]    may be empty
    position_ids        Tensor [R, P] the PROMPT's positions (R = 4 for Qwen-VL: text row + 3 mrope rows; 1 for
                                     text models, where it is optional: 0..P-1); continued over the response
    multi_modal_inputs  dict         pixel_values [patches, dim], image_grid_thw [images, 3] (and/or
                                     pixel_values_videos, video_grid_thw); {} or absent for text-only rows
    advantage           float or Tensor [len(response_ids)]   (update) one per response, or one per token
    old_logprobs        Tensor [len(response_ids)]   (update) from compute_log_probs
    ref_logprobs        Tensor [len(response_ids)]   (update, with use_kl_loss)
    rollout_logprobs    Tensor [len(response_ids)]   (update, optional: TIS and mismatch metrics)

With a process group, every rank calls each method together (FSDP all-gathers inside); without one, nothing is sharded.
"""

import collections
import contextlib
import json
import logging
import math
import os
import random
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule

from modeling import (DTYPES, AdamWBF16, HostCopy, apply_overrides, batch_flops, build_model, count_flops_params,
                      dummy_vision_input, full_tensor, micro_batches_needed, pack_samples, partition_balanced,
                      peak_tflops, shared_image_units, to_device)

logger = logging.getLogger(__name__)
warnings.filterwarnings("ignore", "torch.distributed is disabled")  # DCP of one unsharded worker: intended


# --- The objective: per-token policy losses, their aggregation, the KL penalty -------------------------------------
# Everything here works on flat, padding-free tensors `[tokens]` of response tokens only, with `cu_seqlens [n_seq + 1]`
# (0, len_0, len_0 + len_1, ..., tokens) marking the sequences; an empty sequence (len 0) has mean 0 but counts.
# cu_seqlens may stay on the CPU while the values are on the GPU: the checks then read it without a host sync.

POLICY_LOSS_TYPES = ("default", "gspo", "gspo_token", "cispo", "sapo")
CLIP_TYPES = ("default", "gspo", "gspo_token")  # the types with a hard PPO clip and dual clip
AGGREGATION_MODES = ("token", "seq", "seq_sum_norm")
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 4.9e8: finite ratios whatever the log-probs


def policy_loss(logp, old_logp, advantages, cu_seqlens, loss_type="default", clip_ratio_low=0.2,
                clip_ratio_high=0.3, clip_ratio_dual=3.0, tau_positive=1.0, tau_negative=1.05,
                rollout_logp=None, tis_cap=None):
    """Per-token policy-gradient loss l_t (to be minimised) and per-token metrics.

    Inputs are flat `[tokens]`: logp = log pi_theta(y_t) (requires grad), old_logp = log pi_old(y_t), advantages
    A_t (the sequence's, on each of its tokens). sg() is stop-gradient; eps_l, eps_h, c = clip_ratio_low/_high/_dual.

        delta_t = logp_t - old_logp_t
        r_t     = exp(clamp(log r_t, -20, 20)), log r_t = delta_t      (clamp: zero gradient outside)
        clip(r) = clamp(r, 1 - eps_l, 1 + eps_h)

      default     l_t = max(-A r_t, -A clip(r_t));  if A < 0: l_t = min(l_t, -A c)   (dual clip, c > 1)
      gspo        log r_t = s_i = mean_{t in seq i} delta_t  (gradient flows through the mean), then as default
      gspo_token  log r_t = sg(s_i) + logp_t - sg(logp_t): the value of gspo, a per-token gradient, then as default
      cispo       l_t = -A sg(clip(r_t)) logp_t   (a clipped, detached IS weight: no zero gradient at the clip)
      sapo        l_t = -A (4 / tau) sigmoid(tau (r_t - 1)),  tau = tau_positive if A >= 0 else tau_negative
                                                  (a soft gate; clip_ratio_* unused)

    Truncated importance sampling, with `tis_cap` and `rollout_logp`, corrects for the rollout engine sampling
    from pi_rollout != pi_old (kernels, bf16):  w_t = sg(min(exp(old_logp_t - rollout_logp_t), tis_cap)), l_t <- w_t l_t

    Returns (loss [tokens] fp32, metrics: name -> detached fp32 [tokens], token-averaged by the caller):
        ppo_kl              old_logp - logp
        pg_clipfrac_higher  1 where A > 0 and r > 1 + eps_h: the upper clip binds   (CLIP_TYPES only)
        pg_clipfrac_lower   1 where A < 0 and the dual bound -A c binds              (CLIP_TYPES only)
        tis_weight, tis_capfrac (1 where exp(old - rollout) > tis_cap)               (with tis_cap)
        rollout_logp_abs_diff  |old_logp - rollout_logp|                             (with rollout_logp)
    """
    if loss_type not in POLICY_LOSS_TYPES:
        raise ValueError(f"policy_loss: unknown loss_type {loss_type!r}; choose one of {POLICY_LOSS_TYPES} "
                         "(worker.actor.loss_type)")
    if loss_type in CLIP_TYPES and not clip_ratio_dual > 1.0:
        raise ValueError(f"policy_loss: clip_ratio_dual must be > 1 for dual-clip PPO, got {clip_ratio_dual} "
                         "(worker.actor.clip_ratio_dual; EasyR1's default is 3.0)")
    if loss_type == "sapo" and not (tau_positive > 0 and tau_negative > 0):  # 0: 4 / tau = inf, NaN gradients
        raise ValueError(f"policy_loss: sapo's tau_positive={tau_positive} and tau_negative={tau_negative} must be > 0 "
                         "(worker.actor.tau_positive, tau_negative)")
    if tis_cap is not None and not tis_cap > 0:  # a negative weight flips the gradient, 0 stops it
        raise ValueError(f"policy_loss: tis_cap={tis_cap} must be > 0 (worker.actor.tis_cap; null: no TIS)")
    if tis_cap is not None and rollout_logp is None:
        raise ValueError("policy_loss: tis_cap is set but no rollout log-probs were given; the samples need "
                         "'rollout_logprobs' (or set worker.actor.tis_cap to null)")
    _check_flat(cu_seqlens, logp=logp, old_logp=old_logp, advantages=advantages, rollout_logp=rollout_logp)
    logp, old_logp, advantages = logp.float(), old_logp.float(), advantages.float()  # [tokens]
    delta = logp - old_logp  # [tokens]

    log_ratio = delta  # [tokens]
    if loss_type == "gspo":
        log_ratio = _per_sequence_mean(delta, cu_seqlens)  # [tokens], s_i on each token of sequence i
    elif loss_type == "gspo_token":  # value exactly s_i, d/dlogp_t = 1
        log_ratio = _per_sequence_mean(delta, cu_seqlens).detach() + (logp - logp.detach())
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [tokens]
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)  # [tokens]
    negative = advantages < 0  # [tokens]
    metrics = {"ppo_kl": (old_logp - logp).detach()}

    if loss_type in CLIP_TYPES:
        clip_loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)  # [tokens]
        dual_bound = -advantages * clip_ratio_dual  # [tokens]
        loss = torch.where(negative, torch.minimum(clip_loss, dual_bound), clip_loss)
        metrics["pg_clipfrac_higher"] = ((advantages > 0) & (ratio > 1.0 + clip_ratio_high)).float().detach()
        metrics["pg_clipfrac_lower"] = (negative & (clip_loss > dual_bound)).float().detach()
    elif loss_type == "cispo":
        loss = -advantages * clipped_ratio.detach() * logp
    else:  # sapo
        tau = torch.where(negative, tau_negative, tau_positive)  # [tokens]
        loss = -advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))

    if rollout_logp is not None:
        gap = old_logp - rollout_logp.float()  # [tokens]
        metrics["rollout_logp_abs_diff"] = gap.abs().detach()
        if tis_cap is not None:
            raw_weight = torch.exp(torch.clamp(gap, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
            weight = torch.clamp(raw_weight, max=tis_cap)  # [tokens]
            loss = loss * weight
            metrics.update(tis_weight=weight, tis_capfrac=(raw_weight > tis_cap).float())
    return loss, metrics


def aggregate_loss(per_token_loss, cu_seqlens, mode="token", global_tokens=None, global_seqs=None, seq_len_norm=None):
    """Reduce a per-token loss `[tokens]` to a scalar. With l_it the loss of token t of sequence i:

        token         sum_i sum_t l_it / global_tokens                      (DAPO token mean; default)
        seq           sum_i (1/|o_i|) sum_t l_it / global_seqs              (GRPO paper: mean of sequence means)
        seq_sum_norm  sum_i sum_t l_it / (global_seqs * seq_len_norm)       (Dr. GRPO; a constant seq_len_norm)

    global_tokens / global_seqs default to this call's counts. Training passes the whole mini-batch's (all
    micro-batches and ranks) and multiplies each micro-batch's result by world_size (FSDP averages gradients over
    ranks): the summed gradient is the formula's on the whole mini-batch, whatever the micro-batch and world size.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"aggregate_loss: unknown mode {mode!r}; choose one of {AGGREGATION_MODES} "
                         "(worker.actor.loss_avg_mode)")
    _check_flat(cu_seqlens, per_token_loss=per_token_loss)
    if mode == "token":  # no tokens at all (every response empty): 0, not 0 / 0
        return per_token_loss.sum() / max(per_token_loss.numel() if global_tokens is None else global_tokens, 1)
    denominator = max(cu_seqlens.numel() - 1 if global_seqs is None else global_seqs, 1)  # no sequences: 0, as above
    if mode == "seq":
        return _per_sequence_mean(per_token_loss, cu_seqlens, broadcast=False).sum() / denominator
    if seq_len_norm is None:  # seq_sum_norm
        raise ValueError("aggregate_loss: mode 'seq_sum_norm' (Dr. GRPO) divides by a constant length; "
                         "pass seq_len_norm (e.g. data.max_response_length)")
    return per_token_loss.sum() / (denominator * seq_len_norm)


def kl_penalty(logp, ref_logp, kind="low_var_kl"):
    """Per-token KL estimate `[tokens]` (fp32) between the policy and the reference, d = logp - ref_logp:

        kl          k1 = d
        abs         |d|
        mse         k2 = d^2 / 2
        low_var_kl  k3 = exp(-d) - (-d) - 1 >= 0, with -d clamped to [-20, 20] and k3 to [-10, 10]
                    (EasyR1's clamps: the upper one zeroes the gradient of tokens with k3 > 10)

    As a loss on samples from pi, the expected gradient of k2 is grad KL(pi || ref) (the reverse KL),
    that of k3 is grad KL(ref || pi) (the forward KL), and that of k1 is zero.
    """
    if logp.shape != ref_logp.shape:  # else broadcast to [tokens, tokens] without a word
        raise ValueError(f"kl_penalty: logp {list(logp.shape)} and ref_logp {list(ref_logp.shape)}: one shape")
    d = logp.float() - ref_logp.float()  # [tokens]
    if kind == "kl":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "mse":
        return 0.5 * d.square()
    if kind == "low_var_kl":
        neg_d = torch.clamp(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(neg_d) - neg_d - 1.0, -10.0, 10.0)
    raise ValueError(f"kl_penalty: unknown kind {kind!r}; choose one of ('kl', 'abs', 'mse', 'low_var_kl') "
                     "(algorithm.kl_penalty)")


def _per_sequence_mean(values, cu_seqlens, broadcast=True):
    """Mean of `values [tokens]` over each sequence: `[n_seq]`, or `[tokens]` broadcast back if asked."""
    lengths = cu_seqlens.diff().to(values.device, non_blocking=True)  # [n_seq]
    seq_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths,
                                      output_size=values.numel())  # [tokens]; output_size: no host sync
    sums = values.new_zeros(lengths.numel()).index_add(0, seq_ids, values)
    means = sums / lengths.clamp(min=1).to(values.dtype)  # [n_seq]; 0 for an empty sequence
    return means[seq_ids] if broadcast else means


def _check_flat(cu_seqlens, **tensors):
    """Flat tensors of one length, and cu_seqlens = 0, ..., tokens, non-decreasing."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"expected flat per-token tensors [tokens] of one length, got shapes {shapes}")
    tokens = next(iter(shapes.values()))[0]
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != tokens:
        raise ValueError(f"cu_seqlens must run from 0 to the token count {tokens}, got {cu_seqlens.tolist()}")
    if bad := torch.nonzero(cu_seqlens.diff() < 0).flatten().tolist():
        raise ValueError(f"cu_seqlens decreases at sequences {bad}: {cu_seqlens.tolist()}")


# --- The policy and the reference ----------------------------------------------------------------------------------

class Actor:
    """The policy (role="actor": trainable, optimizer) or the reference (role="ref": frozen, no optimizer).

    cfg is the worker.actor section (the reference's too); temperature (the rollout's) divides every pass's logits.
    max_prompt_length + max_response_length size the default micro-batch budget (_plan), max_response_length is
    Dr. GRPO's constant; a mini-batch is global_batch_size x n_per_prompt samples; the LR schedule lasts
    training_steps updates; use_kl_loss, kl_coef and kl_penalty (algorithm section) add the KL loss term.

    Weights: the actor keeps master weights in fsdp.torch_dtype and computes in fsdp.mp_param_dtype (FSDP2
    MixedPrecisionPolicy when sharded, autocast when not); the reference and LoRA's frozen base store the latter.
    """

    def __init__(self, cfg, *, role="actor", temperature=1.0, device="cpu", max_prompt_length=None,
                 max_response_length=None, n_per_prompt=1, training_steps=1, use_kl_loss=False, kl_coef=0.0,
                 kl_penalty="low_var_kl"):
        if role not in ("actor", "ref"):
            raise ValueError(f"Actor: role must be 'actor' or 'ref', got {role!r}")
        self.cfg, self.role, self.temperature, self.n_per_prompt = cfg, role, float(temperature), n_per_prompt
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.use_kl_loss, self.kl_coef, self.kl_kind = use_kl_loss, kl_coef, kl_penalty
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.sharded = dist.is_available() and dist.is_initialized()
        self.world, self.rank = (dist.get_world_size(), dist.get_rank()) if self.sharded else (1, 0)
        self.mini_batch_size, rest = divmod(cfg.global_batch_size * n_per_prompt, self.world)  # samples per rank
        if rest:
            raise ValueError(f"Actor: global_batch_size x n = {cfg.global_batch_size * n_per_prompt} samples per "
                             f"mini-batch cannot be split over {self.world} ranks")
        self.compute_dtype = DTYPES[cfg.fsdp.mp_param_dtype]
        master = DTYPES[cfg.fsdp.torch_dtype or "fp32"] if role == "actor" else self.compute_dtype
        self.lora_rank = cfg.model.lora.rank if role == "actor" else 0

        # 1. Load, freeze what is frozen, shard with FSDP2 (modeling.py).
        compile_layers = cfg.use_torch_compile and self.device.type == "cuda"
        if cfg.use_torch_compile and not compile_layers and self.rank == 0:
            logger.info("%s: use_torch_compile applies on CUDA only; the layers run eagerly on %s", role, self.device)
        longest = (max_prompt_length or 0) + (max_response_length or 0)  # a sample's most tokens
        self.hf, self.module, self.hf_config = build_model(cfg, role, self.device, master, self.compute_dtype,
                                                           self.lora_rank, compile_layers, longest)
        text = self.hf_config.get_text_config()
        self.is_vl = getattr(self.hf_config, "vision_config", None) is not None
        self.token_ids = {k: getattr(self.hf_config, k, None) for k in ("image_token_id", "video_token_id")}
        self.pad_id = getattr(text, "pad_token_id", None) or 0
        self.flops_params = count_flops_params(self.hf, text)
        self.dummy_vision = dummy_vision_input(self.hf, self.device) if self.is_vl else None
        self.autocast = not self.sharded and self.compute_dtype != master

        # 2. Offloading: offload.* parameters / optimizer state wait on the CPU between the passes that need them.
        on_device = self.device.type == "cuda" and not (self.sharded and cfg.fsdp.enable_cpu_offload)  # GPU-resident
        park = cfg.fsdp.enable_cpu_offload  # on an unsharded module (else on_device is false): as offload.*
        self.offload_params = (cfg.offload.offload_params or park) and on_device
        self.offload_optimizer = (cfg.offload.offload_optimizer or park) and on_device and role == "actor"
        self.host_params, self.host_optimizer = HostCopy(), HostCopy()
        if (cfg.offload.offload_params or cfg.offload.offload_optimizer) and not on_device and self.rank == 0:
            where = "device cpu" if self.device.type == "cpu" else "fsdp.enable_cpu_offload"
            logger.warning("%s: offload.offload_params / offload_optimizer do nothing: the parameters already live on "
                           "the CPU (%s)", role, where)

        # 3. Optimizer (AdamW, no weight decay on 1-D parameters: norms and biases) and LR schedule.
        self.optimizer, self.optimizer_steps, self.lr_scheduler = None, 0, None
        if role == "actor":
            o = cfg.optim
            params = [p for p in self.module.parameters() if p.requires_grad]
            groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                      {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
            if o.strategy != "adamw_bf16" and master != torch.float32 and self.rank == 0:
                logger.warning("actor: fsdp.torch_dtype=%s with optim.strategy=adamw loses steps below half the "
                               "weights' spacing (lr 1e-6 on weights of 0.02); use optim.strategy=adamw_bf16 "
                               "(compensated) or torch_dtype=null (fp32)", cfg.fsdp.torch_dtype)
            self.optimizer = AdamWBF16(groups, lr=o.lr, betas=tuple(o.betas)) if o.strategy == "adamw_bf16" else \
                torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), fused=on_device or None)  # fused on the GPU
            self.lr_scheduler = lr_schedule(self.optimizer, o, training_steps)
        self.offload()  # as EasyR1: the rollout engine, built next, finds the memory free

    # --- The three passes: log-probs, update, weights out ----------------------------------------------------------

    @torch.no_grad()
    def compute_log_probs(self, samples, disable_adapter=False, with_entropy=False):
        """Temperature-scaled log-probs of every sample's response tokens: fp32 CPU tensors [len(response_ids)] in
        input order; with `with_entropy`, (log-probs, entropies). `disable_adapter=True` runs a LoRA model with its
        adapters off: the reference at no extra memory. The policy (and LoRA's reference) uses the update's mini- and
        micro-batches, so old and new log-probs come from identical kernels; role="ref" uses the experience budget."""
        kind, chunk = ("update", self.mini_batch_size) if self.role == "actor" else ("experience", max(1, len(samples)))
        done = []  # (indices, response lengths, logp [N], entropy [N] or [0]) per micro-batch, still on the device
        modalities = self._modalities(samples)
        self.onload()
        with self.module.disable_adapter() if disable_adapter and self.lora_rank else contextlib.nullcontext():
            for mini in self._chunks(len(samples), chunk):
                for part in self._plan([samples[i] for i in mini], kind):
                    idx = [mini[j] for j in part]
                    batch = self._pack(samples, idx)
                    logp, ent = self._forward(batch, with_entropy, modalities)
                    if idx:  # not a dummy micro-batch
                        done.append((idx, batch["resp_lens"], logp, ent))
        self.offload()
        logps, entropies = [None] * len(samples), [None] * len(samples)
        for idx, lengths, logp, ent in done:  # to the host after the pass: no wait for the GPU between micro-batches
            logp = logp.float().cpu().split(lengths)
            ent = ent.float().cpu().split(lengths) if with_entropy else [None] * len(idx)
            for i, lp, en in zip(idx, logp, ent):
                logps[i], entropies[i] = lp, en
        return (logps, entropies) if with_entropy else logps

    def update(self, samples):
        """PPO-style update on this rank's samples, in mini-batches of global_batch_size x n_per_prompt / world.
        Returns metrics over all ranks, the same on every rank except perf/*: actor/pg_loss and actor/kl_loss (mean
        over optimizer steps); token means of actor/ppo_kl, actor/entropy, actor/pg_clipfrac_higher and _lower (clip
        types), actor/rollout_logp_abs_diff and (tis_cap) actor/tis_weight, tis_capfrac; actor/grad_norm (the finite
        norms' mean, before clipping), actor/lr (last step), actor/skipped_steps, actor/tokens (response tokens per
        epoch); on CUDA perf/mfu_actor (this rank's FLOPs / time / peak) and perf/max_memory_allocated_gb. Weights
        left non-finite (by steps of finite gradients) raise FloatingPointError before anything syncs or saves them."""
        if self.optimizer is None:
            raise RuntimeError("Actor.update: this is the reference (role='ref'); it has no optimizer")
        c = self.cfg
        start, flops = time.perf_counter(), 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if not samples or len(samples) % self.mini_batch_size:  # none: no optimizer step, nor an LR schedule step
            raise ValueError(f"Actor.update: {len(samples)} samples on rank {self.rank} is not a positive multiple of "
                             f"the mini-batch size {self.mini_batch_size} (worker.actor.global_batch_size="
                             f"{c.global_batch_size} x n={self.n_per_prompt} / {self.world} ranks)")
        minis = self._chunks(len(samples), self.mini_batch_size)
        self.onload(optimizer=True)
        modalities = self._modalities(samples)
        use_rollout = c.tis_cap is not None or bool(self._all_ranks(
            [all("rollout_logprobs" in s for s in samples)], "min")[0])
        keys = ["old_logprobs", "advantage"] + (["ref_logprobs"] if self.use_kl_loss else [])
        keys += ["rollout_logprobs"] if use_rollout else []
        objective = {k: getattr(c, k) for k in ("loss_type", "clip_ratio_low", "clip_ratio_high", "clip_ratio_dual",
                                                 "tau_positive", "tau_negative", "tis_cap")}
        sums, grad_norms, tokens = collections.defaultdict(float), [], 0

        for _ in range(c.ppo_epochs):
            for mini in minis:
                n_tokens, n_seqs = self._all_ranks([sum(len(samples[i]["response_ids"]) for i in mini), len(mini)])
                agg = dict(mode=c.loss_avg_mode, global_tokens=n_tokens, global_seqs=n_seqs,
                           seq_len_norm=self.max_response_length)
                for part in self._plan([samples[i] for i in mini], "update"):
                    idx = [mini[j] for j in part]
                    batch = self._pack(samples, idx)
                    cu = batch["resp_cu_seqlens"]
                    logp, ent = self._forward(batch, c.compute_entropy, modalities)  # [N], [N] or [0]
                    per_token = {key: self._per_token(samples, idx, key, len(logp)) for key in keys}  # [N] each
                    loss_tok, metrics = policy_loss(logp, per_token["old_logprobs"], per_token["advantage"], cu,
                                                    rollout_logp=per_token.get("rollout_logprobs"), **objective)
                    losses = {"pg_loss": aggregate_loss(loss_tok, cu, **agg)}
                    if self.use_kl_loss:
                        kl = kl_penalty(logp, per_token["ref_logprobs"], self.kl_kind)  # [N]
                        losses["kl_loss"] = aggregate_loss(kl, cu, **agg)
                    loss = losses["pg_loss"] + self.kl_coef * losses.get("kl_loss", 0.0)
                    real = 1.0 if idx else 0.0  # 0: a dummy micro-batch that only keeps the collectives in step
                    (loss * real * self.world).backward()
                    flops += batch_flops(self.flops_params, batch)
                    tokens += len(logp) * real
                    if c.compute_entropy:
                        metrics["entropy"] = ent
                    for name, value in losses.items():  # every rank accumulates the same names
                        sums[name] += value.detach().double() * real
                    for name, value in metrics.items():
                        sums[name + "@tokens"] += value.sum().double() * real
                grad_norms.append(self._optimizer_step())

        weights = torch.nn.utils.get_total_norm([p for p in self.module.parameters() if p.requires_grad])
        if not math.isfinite(float(full_tensor(weights, self.device))):  # reduced over the ranks
            bad = [n for n, p in self.module.named_parameters()
                   if p.requires_grad and not full_tensor(p, self.device).isfinite().all()]
            raise FloatingPointError(f"Actor.update: the weights are not finite after this step's update (in {bad[:3]};"
                                     f" gradient norms {grad_norms}): stopped before they are synced, validated or "
                                     "saved, so the last checkpoint is intact; lower worker.actor.optim.lr")
        self.offload()
        names = sorted(sums)
        totals = self._all_ranks([float(sums[n]) for n in names] + [tokens])
        all_tokens = max(totals[-1], 1.0)
        out = {f"actor/{n.split('@')[0]}": v / (all_tokens if n.endswith("@tokens") else len(grad_norms))
               for n, v in zip(names, totals)}
        finite = [g for g in grad_norms if math.isfinite(g)]
        out.update({"actor/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                    "actor/lr": self.optimizer.param_groups[0]["lr"],  # the step's (after a resume too)
                    "actor/skipped_steps": float(len(grad_norms) - len(finite)),
                    "actor/tokens": totals[-1] / c.ppo_epochs})
        self.lr_scheduler.step()  # once per training step, after its update (EasyR1)
        if self.device.type == "cuda":
            out["perf/mfu_actor"] = flops / (time.perf_counter() - start) / (peak_tflops(self.device) * 1e12)
            out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    @torch.no_grad()
    def named_tensors(self):
        """Stream (name, full tensor) pairs of the HF model's state_dict() one at a time on self.device, in their stored
        dtype (LoRA's frozen base: the compute dtype), for the rollout's load_weights (each rank iterates: all-gathers).
        With LoRA each adapted weight comes MERGED (W + scaling * B @ A) under its base name, no adapter tensors."""
        self.onload()
        try:
            for name, tensor in self.hf.state_dict().items():
                if ".lora_" in name:
                    continue
                full = full_tensor(tensor, self.device)
                if ".base_layer." in name:
                    owner, leaf = name.split(".base_layer.")
                    name = f"{owner}.{leaf}"
                    if leaf == "weight":  # a LoRA-adapted weight
                        m = self.hf.get_submodule(owner)
                        a = full_tensor(m.lora_A["default"].weight, self.device).float()  # [r, in]
                        b = full_tensor(m.lora_B["default"].weight, self.device).float()  # [out, r]
                        full = (full.float() + m.scaling["default"] * (b @ a)).to(full.dtype)
                yield name, full
        finally:
            self.offload()

    def save_checkpoint(self, path, model_only=False):
        """Write `path`/model and `path`/optim (DCP: the HF model's state dict, or the peft model's with LoRA, and the
        optimizer's; no optim with model_only), `path`/extra_state.pt (optimizer steps, LR scheduler, rank 0's RNG, the
        optim strategy, LoRA settings: a resume checks them) and `path`/huggingface/ (configs, tokenizer, processor)."""
        os.makedirs(path, exist_ok=True)
        dcp.save(get_model_state_dict(self.module), checkpoint_id=os.path.join(path, "model"))
        if self.optimizer is not None and not model_only:
            dcp.save(get_optimizer_state_dict(self.module, self.optimizer), checkpoint_id=os.path.join(path, "optim"))
        if self.rank == 0:
            rng = {"python": random.getstate(), "cpu": torch.get_rng_state(),
                   "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
            torch.save({"optimizer_steps": self.optimizer_steps, "rng": rng, "optim_strategy": self.cfg.optim.strategy,
                        "lora": dict(vars(self.cfg.model.lora)) if self.lora_rank else None,
                        "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None},
                       os.path.join(path, "extra_state.pt"))
            save_hf_files(self.cfg.model, os.path.join(path, "huggingface"), self.module if self.lora_rank else None)
        if self.sharded:
            dist.barrier()

    def load_checkpoint(self, path):
        """Load what save_checkpoint wrote, on any world size. A missing file (a save_model_only checkpoint has no
        optim/) raises FileNotFoundError: never a silent fresh optimizer, LR schedule or RNG."""
        needed = ["model", "extra_state.pt"] + (["optim"] if self.optimizer is not None else [])
        if missing := [name for name in needed if not os.path.exists(os.path.join(path, name))]:
            raise FileNotFoundError(f"Actor.load_checkpoint: {path} lacks {', '.join(missing)}; expected the folder "
                                    "that Actor.save_checkpoint wrote (global_step_N/actor, not save_model_only)")
        extra = torch.load(os.path.join(path, "extra_state.pt"), weights_only=True)  # tensors and plain containers
        adapter = os.path.join(path, "huggingface", "adapter_config.json")  # older LoRA checkpoints: their rank
        lora = extra.get("lora") or ({"rank": json.load(open(adapter))["r"]} if os.path.exists(adapter) else {})
        mine = {"optim.strategy": self.cfg.optim.strategy, "model.lora.rank": self.lora_rank}
        saved = {"optim.strategy": extra.get("optim_strategy", mine["optim.strategy"]),  # older checkpoints: unknown
                 "model.lora.rank": lora.get("rank", 0)}
        for key, value in lora.items() if self.lora_rank else ():  # alpha, target_modules, ...
            mine[f"model.lora.{key}"], saved[f"model.lora.{key}"] = getattr(self.cfg.model.lora, key), value
        if self.optimizer is not None and (keys := [k for k in mine if saved[k] != mine[k]]):
            raise ValueError(f"{path} holds the state of {', '.join(f'{k}={saved[k]}' for k in keys)}, this run has "
                             f"{', '.join(f'{k}={mine[k]}' for k in keys)}: resume with the same settings, or start a "
                             "new run from the merged weights (merge.py, then worker.actor.model.model_path)")
        state = get_model_state_dict(self.module)
        dcp.load(state, checkpoint_id=os.path.join(path, "model"))
        set_model_state_dict(self.module, state)
        if self.optimizer is not None:  # and the schedule's position; lr, betas and weight decay are this run's
            optim_state = get_optimizer_state_dict(self.module, self.optimizer)
            dcp.load(optim_state, checkpoint_id=os.path.join(path, "optim"))
            set_optimizer_state_dict(self.module, self.optimizer, optim_state)
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])  # (the optimizer's state brought the saved ones)
            o, t = self.cfg.optim, self.lr_scheduler.last_epoch
            for group, decay, factor in zip(self.optimizer.param_groups, (o.weight_decay, 0.0),
                                            self.lr_scheduler.lr_lambdas):
                group.update(lr=o.lr * factor(t), initial_lr=o.lr, betas=tuple(o.betas), weight_decay=decay)
            self.lr_scheduler.base_lrs = [o.lr] * len(self.optimizer.param_groups)
        self.optimizer_steps = extra["optimizer_steps"]
        random.setstate(extra["rng"]["python"])
        torch.set_rng_state(extra["rng"]["cpu"])
        if extra["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(extra["rng"]["cuda"])

    # --- The pieces of the passes ----------------------------------------------------------------------------------

    def _forward(self, batch, with_entropy, modalities):
        """One packed micro-batch -> (logp [N], entropy [N] or [0]) of its response tokens. resp_cu_seqlens, which
        stays on the host for the loss's checks, is left out: FSDP2's root would copy it to the device, blocking."""
        inputs = {k: v for k, v in batch.items() if k != "resp_cu_seqlens"}
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            return self.hf.packed_forward(inputs, self.temperature, with_entropy, modalities, self.dummy_vision)

    def _optimizer_step(self):
        """Clip the global gradient norm to max_grad_norm (clip_grad_norm_ reduces FSDP2's DTensor gradients over the
        ranks) and step, unless the norm is not finite (skipped: actor/skipped_steps); -> the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.max_grad_norm or math.inf)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # DTensor: reduced where it is
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            logger.warning("actor: gradient norm is %s at optimizer step %d; the step is skipped", norm,
                           self.optimizer_steps)
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return norm

    def onload(self, optimizer=False):
        """Offloaded parameters and, with `optimizer`, optimizer state back on the device; the passes call it."""
        self.host_params.onload()  # each a no-op unless offload() parked it (HostCopy.onload checks)
        if optimizer:
            self.host_optimizer.onload()

    def offload(self):
        """After a pass: offloaded parameters and optimizer state to pinned host memory (modeling.HostCopy), and the
        freed device memory back to the driver, where the rollout engine takes it while it generates."""
        if self.offload_params:
            for m in self.module.modules():  # FSDP2 keeps the root's parameters gathered after a no-grad forward
                if isinstance(m, FSDPModule):
                    m.reshard()
            self.host_params.offload([t for p in self.module.parameters() for t in (p, p.grad) if t is not None])
        if self.offload_optimizer:
            self.host_optimizer.offload([v for state in self.optimizer.state.values() for v in state.values()
                                         if torch.is_tensor(v)])
        if self.offload_params or self.offload_optimizer:
            torch.cuda.empty_cache()

    def _plan(self, samples, kind):
        """Micro-batches of a mini-batch for the `kind` ("update" / "experience") pass, as many on every rank (an empty
        list is a dummy): index lists balanced by tokens under the token budget, samples sharing images kept together
        where it allows (dynamic batching), else micro_batch_size_per_device_for_<kind> samples each."""
        size = getattr(self.cfg, f"micro_batch_size_per_device_for_{kind}")
        if not self.cfg.dynamic_batching:
            return self._chunks(len(samples), size) or [[]]
        budget = self.cfg.max_tokens_per_micro_batch
        if not budget:
            if self.max_prompt_length is None or self.max_response_length is None:
                raise ValueError("Actor: set worker.actor.max_tokens_per_micro_batch, or pass max_prompt_length "
                                 "and max_response_length so the budget is micro_batch_size_per_device x their sum")
            budget = size * (self.max_prompt_length + self.max_response_length)
        lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
        if max(lengths, default=0) > budget:
            logger.warning("actor: a sequence of %d tokens exceeds the micro-batch budget of %d tokens; it gets "
                           "a micro-batch of its own", max(lengths), budget)
        units = shared_image_units(samples, lengths, budget)
        unit_lengths = [sum(lengths[i] for i in unit) for unit in units]
        k = int(self._all_ranks([micro_batches_needed(unit_lengths, budget)], "max")[0])  # >= 1
        return [sorted(i for u in part for i in units[u]) for part in partition_balanced(unit_lengths, k)]

    def _pack(self, samples, idx):
        """Pack samples[idx] (a dummy two-token sample when idx is empty) and move its tensors to the device."""
        chosen = [samples[i] for i in idx] or [{"prompt_ids": [self.pad_id], "response_ids": [self.pad_id]}]
        batch = pack_samples(chosen, self.is_vl, names=[f"sample {i}" for i in idx] or ["dummy"], **self.token_ids,
                             merge=self.dummy_vision[2] if self.is_vl else None)
        # The grids stay host lists, read by modeling.vision_indices without a host sync (see packed_forward).
        batch["mm"] = {k: v.tolist() if k.endswith("grid_thw") else to_device(v, self.device)
                       for k, v in batch["mm"].items()}
        return {k: to_device(v, self.device) if torch.is_tensor(v) and k != "resp_cu_seqlens" else v
                for k, v in batch.items()}

    def _per_token(self, samples, idx, key, n_tokens):
        """samples[i][key] for i in idx as one fp32 tensor [N] on the device (zeros for a dummy micro-batch, N =
        n_tokens); an advantage given once per response is broadcast to its tokens."""
        if not idx:
            return torch.zeros(n_tokens, device=self.device)
        parts = []
        for i in idx:
            if key not in samples[i]:
                raise KeyError(f"Actor.update: sample {i} has no {key!r} (compute it before the update)")
            value = torch.as_tensor(samples[i][key], dtype=torch.float32).reshape(-1)
            n = len(samples[i]["response_ids"])
            value = value.expand(n) if key == "advantage" and value.numel() == 1 else value  # one per response
            if value.numel() != n:
                raise ValueError(f"Actor.update: sample {i}: {key} has {value.numel()} values for {n} response tokens")
            if not torch.isfinite(value).all():  # a NaN old log-prob zeroed its token's gradient: a silent update
                raise ValueError(f"Actor.update: sample {i} (uid {samples[i].get('uid')}): {key} has non-finite values "
                                 f"at tokens {(~torch.isfinite(value)).nonzero()[:, 0].tolist()[:5]}")
            parts.append(value)
        return to_device(torch.cat(parts), self.device)

    def _modalities(self, samples):
        """Vision calls every micro-batch makes: ("image",) or ("image", "video") if any rank has videos."""
        if not self.is_vl:
            return ()
        has_video = any("pixel_values_videos" in (s.get("multi_modal_inputs") or {}) for s in samples)
        return ("image", "video") if self._all_ranks([has_video], "max")[0] else ("image",)

    def _chunks(self, n, size):
        """[0..n) cut into consecutive chunks of `size`; every rank gets as many chunks (padded with [])."""
        chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        count = int(self._all_ranks([len(chunks)], "max")[0])
        return chunks + [[] for _ in range(count - len(chunks))]

    def _all_ranks(self, values, op="sum"):
        """All-reduce a list of numbers over the ranks (sum, max or min); the numbers themselves without a group."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if self.sharded:
            t = t.to(self.device if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t.tolist()


# --- The LR schedule and the Hugging Face files of a checkpoint ----------------------------------------------------

def lr_schedule(optimizer, optim_cfg, training_steps):
    """EasyR1's learning-rate schedule over TRAINING steps, stepped once after each update: at step t (0-based)
    lr x t / W during the warm-up of W = lr_warmup_steps (else int(lr_warmup_ratio x training_steps)) steps,
    so the first step runs at 0 when W > 0; then constant, or cosine down to m = min_lr_ratio (default 0):
    lr x (m + (1 - m) (1 + cos(pi (t - W) / (training_steps - W))) / 2). transformers' schedulers."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    warmup = optim_cfg.lr_warmup_steps
    if warmup is None:
        warmup = int(optim_cfg.lr_warmup_ratio * training_steps)
    if optim_cfg.lr_scheduler_type == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, training_steps,
                                                           min_lr_rate=optim_cfg.min_lr_ratio or 0.0)
    return get_constant_schedule_with_warmup(optimizer, warmup)


def save_hf_files(model_cfg, path, peft_model=None):
    """config.json (with override_config), generation_config.json, tokenizer / processor, adapter_config.json."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer, GenerationConfig

    source = model_cfg.tokenizer_path or model_cfg.model_path
    config = AutoConfig.from_pretrained(model_cfg.model_path, trust_remote_code=model_cfg.trust_remote_code)
    apply_overrides(config, model_cfg.override_config)
    config.save_pretrained(path)
    try:
        GenerationConfig.from_pretrained(model_cfg.model_path).save_pretrained(path)
    except OSError:
        logger.info("%s has no generation_config.json; none copied", model_cfg.model_path)
    try:
        AutoProcessor.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code).save_pretrained(path)
    except (OSError, ValueError, TypeError):
        AutoTokenizer.from_pretrained(source, trust_remote_code=model_cfg.trust_remote_code).save_pretrained(path)
    if peft_model is not None:
        peft_model.peft_config["default"].save_pretrained(path)
