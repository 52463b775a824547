"""actor.py: the policy being trained and the frozen reference. Loading, FSDP2, LoRA, padding-free packing,
attention routing, response-only log-probs and entropy, the update step, weight streaming, checkpoints.

Knows nothing of Ray, vLLM or datasets: it receives lists of sample dicts and returns tensors and floats.

A sample (built by trainer.py) holds:
    prompt_ids          list[int]    chat-templated prompt, image placeholders expanded
    response_ids        list[int]    may be empty
    position_ids        Tensor [R, P] the PROMPT's positions (R = 4 for Qwen-VL: text row + 3 mrope rows; 1 for
                                     text models); the actor continues every row over the response at
                                     last + 1, last + 2, ...  Optional for text models (then 0..P-1).
    multi_modal_inputs  dict         pixel_values [patches, dim], image_grid_thw [images, 3] (and/or
                                     pixel_values_videos, video_grid_thw); {} or absent for text-only rows
    advantage           float or Tensor [len(response_ids)]   (update) one per response, broadcast to its tokens,
                                     or one per token (REINFORCE++)
    old_logprobs        Tensor [len(response_ids)]   (update) from compute_log_probs
    ref_logprobs        Tensor [len(response_ids)]   (update, with use_kl_loss)
    rollout_logprobs    Tensor [len(response_ids)]   (update, optional: TIS and mismatch metrics)

Config attributes read (ActorConfig in trainer.py, documented in configs/geo3k.yaml):
    global_batch_size, micro_batch_size_per_device_for_update, micro_batch_size_per_device_for_experience,
    max_tokens_per_micro_batch, dynamic_batching, max_grad_norm, clip_ratio_low/high/dual, tau_positive/negative,
    loss_avg_mode, loss_type, tis_cap, ppo_epochs, compute_entropy, use_torch_compile (warned, unused),
    model.{model_path, tokenizer_path, override_config, enable_gradient_checkpointing, trust_remote_code,
    freeze_vision_tower, lora.{rank, alpha, target_modules, exclude_modules}},
    optim.{lr, betas, weight_decay, strategy, lr_warmup_ratio, lr_warmup_steps, min_lr_ratio, lr_scheduler_type},
    fsdp.{enable_full_shard, enable_cpu_offload, enable_rank0_init, torch_dtype, fsdp_size, mp_param_dtype,
    mp_reduce_dtype}, offload.{offload_params, offload_optimizer}.

Needs transformers >= 5.18 (its Qwen-VL forwards take precomputed `mm_encoder_outputs`; 5.17 does not and
is refused with a clear error; tested with 5.22.2 and 5.24.0) and torch >= 2.6 (FSDP2).

Collectives: with a process group, every rank must call compute_log_probs, update, named_tensors,
save_checkpoint and load_checkpoint together (FSDP all-gathers inside). Without one, nothing is sharded.

Differences from EasyR1 (and why):
- FSDP2 (`fully_shard`, DTensor parameters) instead of FSDP1; one process without a process group runs
  the plain module (tests, the CPU toy); fp32 compute on the CPU with `mp_param_dtype: fp32`.
- Attention is routed by this file (a function registered with transformers' AttentionInterface) and
  told the sequence boundaries explicitly (`cu_seqlens`), instead of EasyR1's monkey patch that guessed
  them from position ids == 0. transformers' own sdpa path does not isolate packed sequences.
- Labels are built per sequence before packing (no roll across sequence boundaries, peers D5), and
  logits exist only at response positions, in checkpointed chunks: no [tokens, vocab] tensor.
- True entropy over the vocabulary (`actor/entropy`); EasyR1 logged mean(-log p) of sampled tokens.
- Old, reference and new log-probs of the policy use the same micro-batching (the update's), so the
  first update of a step sees ratio exactly 1 (peers D3). EasyR1's defaults used two layouts.
- Loss denominators are global (all micro-batches and ranks of the mini-batch) for every
  `loss_avg_mode` (peers D2), via aggregate_loss.
- A micro-batch without images runs the vision tower on a 16-patch dummy whose output is joined to
  the graph with weight 0 (EasyR1 did the same); with videos anywhere, every micro-batch makes the
  same image and video calls in the same order, so FSDP collectives always pair up.
- The LR schedule steps per optimizer step (EasyR1: once per update call), and warmup starts at
  lr / warmup_steps instead of 0.
- Checkpoints use torch.distributed.checkpoint (resumable on another world size); EasyR1 saved
  one file per rank and needed the same world size.
- `perf/mfu_actor` knows the H200 (EasyR1 matched "H20" first and used the H20's peak).
- `adamw_bf16` (Kahan-compensated, as EasyR1's AnyPrecisionAdamW) sends weight decay through the compensation
  too; EasyR1 multiplied the bf16 weights by 1 - lr wd in place, which rounds to nothing at lr 1e-6.
The objective (first section below):
- `pg_clipfrac_higher` counts the UPPER clip only (A > 0 and r > 1 + clip_ratio_high). EasyR1's
  metric of that name counted every token where the clip bound, on both sides, despite the name.
  A < 0 tokens below 1 - clip_ratio_low are not reported.
- `loss_avg_mode="seq"` is a true global mean of per-sequence token means: each sequence weighs
  1 / global_seqs. EasyR1 scaled each micro-batch's sequence mean by its share of the tokens, a
  token-weighted mix that depends on how the batch was cut into micro-batches.
- `seq_sum_norm` (Dr. GRPO: token sum over sequences x a constant length) is added.
- `clip_ratio_dual <= 1` is an error (EasyR1 accepted it; with c <= 1 the dual bound binds from ratio
  c upward, at or below 1, and silences A < 0 tokens the ordinary clip leaves alone: not dual-clip PPO).
- Optional token-level truncated importance sampling (TIS) against the rollout engine's log-probs.
- Everything is computed in fp32, whatever the input dtype.
"""

import contextlib
import inspect
import logging
import math
import os
import random
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The name contains "flash" on purpose: transformers' Qwen-VL vision attention then hands its own per-window /
# per-image cu_seqlens to the attention function in one call (`is_flash_attention_requested` is a substring test).
ATTENTION = "packed_flash_varlen"
HEAD_CHUNK = 1024  # response tokens per LM-head chunk: [1024, vocab] fp32 logits at a time
# Dense bf16 peak TFLOP/s by device-name substring, first match wins: "H200" must come before "H20".
PEAK_TFLOPS = [("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("H20", 148.0), ("B200", 2250.0),
               ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("4090", 165.0)]
VISION_CALLS = {"image": ("get_image_features", "pixel_values", "image_grid_thw"),
                "video": ("get_video_features", "pixel_values_videos", "video_grid_thw")}


# ----------------------------------------------------------------------------------------------
# The objective: per-token policy losses, their aggregation, the KL penalty
# ----------------------------------------------------------------------------------------------
# Everything here works on flat, padding-free per-token tensors `[tokens]` holding response tokens
# only, with `cu_seqlens [n_seq + 1]` (0, len_0, len_0 + len_1, ..., tokens) marking the sequences.
# An empty sequence (len 0) is allowed: it has no tokens, its sequence mean counts as 0.

POLICY_LOSS_TYPES = ("default", "gspo", "gspo_token", "cispo", "sapo")
CLIP_TYPES = ("default", "gspo", "gspo_token")  # the types with a hard PPO clip and dual clip
AGGREGATION_MODES = ("token", "seq", "seq_sum_norm")
LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 4.9e8: finite ratios whatever the log-probs


def policy_loss(logp, old_logp, advantages, cu_seqlens, loss_type="default", clip_ratio_low=0.2,
                clip_ratio_high=0.3, clip_ratio_dual=3.0, tau_positive=1.0, tau_negative=1.05,
                rollout_logp=None, tis_cap=None):
    """Per-token policy-gradient loss l_t (to be minimised) and per-token metrics.

    Inputs are flat `[tokens]`: logp = log pi_theta(y_t) (requires grad), old_logp = log pi_old(y_t)
    (the trainer's recomputation before the update), advantages A_t (the sequence's advantage
    broadcast to its tokens). sg() is stop-gradient; eps_l, eps_h, c = clip_ratio_low / _high / _dual.

        delta_t = logp_t - old_logp_t
        r_t     = exp(clamp(log r_t, -20, 20)), log r_t = delta_t      (clamp: zero gradient outside)
        clip(r) = clamp(r, 1 - eps_l, 1 + eps_h)

      default     l_t = max(-A r_t, -A clip(r_t));  if A < 0: l_t = min(l_t, -A c)   (dual clip, c > 1)
      gspo        log r_t = s_i = mean_{t in seq i} delta_t  (gradient flows through the mean), then as default
      gspo_token  log r_t = sg(s_i) + logp_t - sg(logp_t): the value of gspo, a per-token gradient, then as default
      cispo       l_t = -A sg(clip(r_t)) logp_t          (REINFORCE with a clipped, detached IS weight;
                                                          the gradient never vanishes at the clip)
      sapo        l_t = -A (4 / tau) sigmoid(tau (r_t - 1)),  tau = tau_positive if A >= 0 else tau_negative
                                                         (soft gate; clip_ratio_* unused)

    Truncated importance sampling (token level), when `tis_cap` is given with `rollout_logp`:
        w_t = min(exp(old_logp_t - rollout_logp_t), tis_cap),  detached;   l_t <- w_t l_t
    It corrects for the rollout engine sampling from pi_rollout != pi_old (kernels, bf16).

    Returns (loss [tokens] fp32, metrics): metrics maps names to detached per-token fp32 tensors
    `[tokens]` that the caller token-averages:
        ppo_kl              old_logp - logp (every type)
        pg_clipfrac_higher  1 where A > 0 and r > 1 + eps_h: the upper clip binds   (clip types only)
        pg_clipfrac_lower   1 where A < 0 and the dual bound -A c binds              (clip types only)
        tis_weight, tis_capfrac (1 where exp(old - rollout) > tis_cap)               (with tis_cap)
        rollout_logp_abs_diff  |old_logp - rollout_logp|                             (with rollout_logp)
    The clip types are default, gspo and gspo_token.
    """
    if loss_type not in POLICY_LOSS_TYPES:
        raise ValueError(f"policy_loss: unknown loss_type {loss_type!r}; choose one of {POLICY_LOSS_TYPES} "
                         "(worker.actor.loss_type)")
    if loss_type in CLIP_TYPES and not clip_ratio_dual > 1.0:
        raise ValueError(f"policy_loss: clip_ratio_dual must be > 1 for dual-clip PPO, got {clip_ratio_dual} "
                         "(worker.actor.clip_ratio_dual; EasyR1's default is 3.0)")
    if tis_cap is not None and rollout_logp is None:
        raise ValueError("policy_loss: tis_cap is set but no rollout log-probs were given; the samples need "
                         "'rollout_logprobs' (or set worker.actor.tis_cap to null)")
    _check_flat(cu_seqlens, logp=logp, old_logp=old_logp, advantages=advantages, rollout_logp=rollout_logp)
    logp, old_logp, advantages = logp.float(), old_logp.float(), advantages.float()  # [tokens]
    delta = logp - old_logp  # [tokens]

    if loss_type == "gspo":
        log_ratio = _per_sequence_mean(delta, cu_seqlens)  # [tokens], s_i on each token of sequence i
    elif loss_type == "gspo_token":
        seq_log_ratio = _per_sequence_mean(delta, cu_seqlens).detach()  # [tokens]
        log_ratio = seq_log_ratio + (logp - logp.detach())  # [tokens], value exactly s_i, d/dlogp_t = 1
    else:
        log_ratio = delta
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
        tau = torch.where(negative, torch.full_like(advantages, tau_negative), torch.full_like(advantages, tau_positive))
        loss = -advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))

    if rollout_logp is not None:
        rollout_logp = rollout_logp.float()
        metrics["rollout_logp_abs_diff"] = (old_logp - rollout_logp).abs().detach()
        if tis_cap is not None:
            raw_weight = torch.exp(torch.clamp(old_logp - rollout_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
            weight = torch.clamp(raw_weight, max=tis_cap)  # [tokens]
            loss = loss * weight
            metrics["tis_weight"] = weight
            metrics["tis_capfrac"] = (raw_weight > tis_cap).float()
    return loss, metrics


def aggregate_loss(per_token_loss, cu_seqlens, mode="token", global_tokens=None, global_seqs=None,
                   seq_len_norm=None):
    """Reduce a per-token loss `[tokens]` to a scalar. With l_it the loss of token t of sequence i:

        token         sum_i sum_t l_it / global_tokens                      (DAPO token mean; default)
        seq           sum_i (1/|o_i|) sum_t l_it / global_seqs              (GRPO paper: mean of sequence means;
                                                                             an empty o_i adds 0 but is counted)
        seq_sum_norm  sum_i sum_t l_it / (global_seqs * seq_len_norm)       (Dr. GRPO; seq_len_norm is a
                                                                             constant such as max_response_length)

    global_tokens / global_seqs default to the counts in this call. In training the caller passes
    the counts of the whole mini-batch (all micro-batches, all ranks) and multiplies each
    micro-batch's result by world_size, because FSDP averages gradients over ranks: summed over
    micro-batches and averaged over ranks, the gradient is then exactly that of the formula on the
    whole mini-batch, independent of micro-batch size and world size. (EasyR1's `seq` mode scaled
    each micro-batch's sequence mean by its token share instead, which weighs sequences by how the
    batch was cut.)
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"aggregate_loss: unknown mode {mode!r}; choose one of {AGGREGATION_MODES} "
                         "(worker.actor.loss_avg_mode)")
    _check_flat(cu_seqlens, per_token_loss=per_token_loss)
    n_seqs = cu_seqlens.numel() - 1
    if mode == "token":
        denominator = per_token_loss.numel() if global_tokens is None else global_tokens
        return per_token_loss.sum() / denominator
    denominator = n_seqs if global_seqs is None else global_seqs
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
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [n_seq]
    seq_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths.to(values.device))
    sums = torch.zeros(lengths.numel(), dtype=values.dtype, device=values.device).index_add(0, seq_ids, values)
    means = sums / lengths.clamp(min=1).to(values.device, values.dtype)  # [n_seq]; 0 for an empty sequence
    return means[seq_ids] if broadcast else means


def _check_flat(cu_seqlens, **tensors):
    """Flat tensors of one length, and cu_seqlens = 0, ..., tokens, non-decreasing."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError(f"expected flat per-token tensors [tokens] of one length, got shapes {shapes}")
    tokens = next(iter(shapes.values()))[0]
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != tokens:
        raise ValueError(f"cu_seqlens must run from 0 to the token count {tokens}, got {cu_seqlens.tolist()}")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if (lengths < 0).any():
        bad = torch.nonzero(lengths < 0).flatten().tolist()
        raise ValueError(f"cu_seqlens decreases at sequences {bad}: {cu_seqlens.tolist()}")


# ----------------------------------------------------------------------------------------------
# The policy and the reference
# ----------------------------------------------------------------------------------------------

class Actor:
    """The policy (role="actor": trainable, optimizer) or the reference (role="ref": frozen, no optimizer).

    Actor(cfg, role, temperature, device, max_prompt_length, max_response_length, n_per_prompt,
          training_steps, use_kl_loss, kl_coef, kl_penalty)
        cfg               the worker.actor section (ActorConfig); the reference gets the same section
        temperature       divides the logits of every log-prob pass (the rollout's sampling temperature)
        device            "cpu", "cuda" or "cuda:N"
        max_prompt_length, max_response_length   token budget per micro-batch when max_tokens_per_micro_batch
                          is null: micro_batch_size_per_device_for_update (experience for the reference) x sum;
                          max_response_length is also Dr. GRPO's constant length (loss_avg_mode=seq_sum_norm)
        n_per_prompt      responses per prompt: a mini-batch is global_batch_size x n_per_prompt samples
        training_steps    trainer steps: the length of the LR schedule, which steps once per update (EasyR1)
        use_kl_loss, kl_coef, kl_penalty   the KL loss term (algorithm section)

    Weights: the actor keeps fp32 master weights (fsdp.torch_dtype, default fp32) and computes in
    fsdp.mp_param_dtype (FSDP2 MixedPrecisionPolicy when sharded, autocast when not). The reference and
    LoRA's frozen base weights are stored in the compute dtype (bf16, or fp32 on the CPU toy).
    """

    def __init__(self, cfg, *, role="actor", temperature=1.0, device="cpu", max_prompt_length=None,
                 max_response_length=None, n_per_prompt=1, training_steps=1, use_kl_loss=False, kl_coef=0.0,
                 kl_penalty="low_var_kl"):
        if role not in ("actor", "ref"):
            raise ValueError(f"Actor: role must be 'actor' or 'ref', got {role!r}")
        self.cfg, self.role, self.temperature = cfg, role, float(temperature)
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.n_per_prompt, self.training_steps = n_per_prompt, training_steps
        self.use_kl_loss, self.kl_coef, self.kl_kind = use_kl_loss, kl_coef, kl_penalty
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.sharded = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if self.sharded else 1
        self.rank = dist.get_rank() if self.sharded else 0
        self.compute_dtype = DTYPES[cfg.fsdp.mp_param_dtype]
        master = DTYPES[cfg.fsdp.torch_dtype or "fp32"] if role == "actor" else self.compute_dtype
        self.lora_rank = cfg.model.lora.rank if role == "actor" else 0
        if cfg.use_torch_compile:
            logger.warning("worker.actor.use_torch_compile is ignored: the log-prob head runs eagerly")

        # 1. Load (rank 0 reads the weights, the others build on the meta device and receive them).
        self.hf, self.module, self.hf_config, full_state = load_model(
            cfg.model, master, self.compute_dtype, self.lora_rank,
            meta=self.sharded and self.world > 1 and cfg.fsdp.enable_rank0_init and self.rank != 0,
            keep_full_state=self.sharded and self.world > 1 and cfg.fsdp.enable_rank0_init and self.rank == 0)
        text = self.hf_config.get_text_config()
        self.is_vl = getattr(self.hf_config, "vision_config", None) is not None
        self.image_token_id = getattr(self.hf_config, "image_token_id", None)
        self.video_token_id = getattr(self.hf_config, "video_token_id", None)
        self.pad_id = getattr(text, "pad_token_id", None) or 0
        self.flops_params = count_flops_params(self.hf, text)
        self.dummy_vision = dummy_vision_input(self.hf) if self.is_vl else None
        if role == "ref":
            self.module.requires_grad_(False)
        elif cfg.model.freeze_vision_tower and self.is_vl:
            vision_tower(self.hf).requires_grad_(False)
        if role == "actor" and cfg.model.enable_gradient_checkpointing:
            enable = getattr(self.hf, "activation_checkpointing_enable", None)  # transformers >= 5.2x
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.hf.train(role == "actor")  # dropout is 0 in the supported models; train() enables checkpointing
        self.hf.packed_forward = types.MethodType(packed_forward, self.hf)

        # 2. Shard with FSDP2 over decoder layers and vision blocks, the root holding the rest.
        self.fsdp_group = None
        if self.sharded:
            self.fsdp_group = shard_model(self.hf, self.device, cfg.fsdp, self.compute_dtype, self.world)
            if cfg.fsdp.enable_rank0_init and self.world > 1:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
                set_model_state_dict(self.module, full_state or {}, options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=True))
                broadcast_buffers(self.hf, self.device)
            from torch.distributed.fsdp import register_fsdp_forward_method
            register_fsdp_forward_method(self.hf, "packed_forward")
        else:
            self.hf.to(self.device)
        del full_state
        offloaded = self.sharded and cfg.fsdp.enable_cpu_offload and self.device.type == "cuda"
        # offload.*: parameters / optimizer state wait on the CPU between the passes that need them (onload, offload).
        movable = self.device.type == "cuda" and not offloaded
        self.offload_params = cfg.offload.offload_params and movable
        self.offload_optimizer = cfg.offload.offload_optimizer and movable and role == "actor"
        if (cfg.offload.offload_params or cfg.offload.offload_optimizer) and not movable and self.rank == 0:
            logger.warning("%s: offload.offload_params / offload_optimizer do nothing: the parameters already live on "
                           "the CPU (%s)", role, "device cpu" if self.device.type == "cpu" else "fsdp.enable_cpu_offload")
        self.autocast = (not self.sharded and self.compute_dtype != master)

        # 3. Optimizer (AdamW, no weight decay on 1-D parameters: norms and biases).
        self.optimizer, self.optimizer_steps, self.lr_scheduler = None, 0, None
        if role == "actor":
            o = cfg.optim
            params = [p for p in self.module.parameters() if p.requires_grad]
            groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                      {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
            if o.strategy == "adamw_bf16":
                self.optimizer = AdamWBF16(groups, lr=o.lr, betas=tuple(o.betas))
            else:
                if master != torch.float32 and self.rank == 0:
                    logger.warning("actor: fsdp.torch_dtype=%s with optim.strategy=adamw rounds every step into the "
                                   "weights: steps below half their spacing (lr 1e-6 on weights of 0.02) are lost; "
                                   "use optim.strategy=adamw_bf16 (compensated) or torch_dtype=null (fp32)",
                                   cfg.fsdp.torch_dtype)
                fused = self.device.type == "cuda" and not offloaded
                self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), fused=fused or None)
            self.lr_scheduler = lr_schedule(self.optimizer, o, training_steps)
        self.offload()  # as EasyR1: the rollout engine, built next, finds the memory free

    # ------------------------------------------------------------------------------------------
    # The three passes: log-probs, update, weights out
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def compute_log_probs(self, samples, disable_adapter=False, with_entropy=False):
        """Log-probs of every sample's response tokens, temperature-scaled: list of fp32 CPU tensors
        [len(response_ids)] in input order; with `with_entropy`, (log-probs, entropies) of the same shapes.

        `disable_adapter=True` runs a LoRA model with its adapters off: the reference at no extra memory.
        The policy uses the update's micro-batching (mini-batches of global_batch_size x n / world samples,
        packed under the update budget), so old and new log-probs come from identical kernels; the reference
        (role="ref") packs the whole list under the experience budget.
        """
        kind = "update" if self.role == "actor" else "experience"
        chunk = self._mini_batch_size() if self.role == "actor" else max(1, len(samples))
        logps, entropies = [None] * len(samples), [None] * len(samples)
        adapters = self.module.disable_adapter() if disable_adapter and self.lora_rank else contextlib.nullcontext()
        modalities = self._modalities(samples)
        self.onload()
        with adapters:
            for mini in self._chunks(len(samples), chunk):
                for part in self._plan([samples[i] for i in mini], kind):
                    idx = [mini[j] for j in part]
                    batch = self._pack(samples, idx)
                    logp, ent = self._forward(batch, with_entropy, modalities)
                    logp = logp.float().cpu().split(batch["resp_lens"])
                    ent = ent.float().cpu().split(batch["resp_lens"]) if with_entropy else [None] * len(logp)
                    for i, lp, en in zip(idx, logp, ent):
                        logps[i], entropies[i] = lp, en
        self.offload()
        return (logps, entropies) if with_entropy else logps

    def update(self, samples):
        """PPO-style update on this rank's samples; returns metrics (floats, identical on every rank except perf/*).

        Per mini-batch (global_batch_size x n_per_prompt / world samples here), per epoch: for each packed
        micro-batch, logp -> policy_loss -> aggregate_loss with the mini-batch's GLOBAL token / sequence counts,
        plus kl_coef x the same aggregate of kl_penalty(logp, ref) with use_kl_loss; backward of
        loss x world_size (FSDP averages gradients over ranks, so the sum is the whole mini-batch's gradient).
        Then clip the gradient norm; a non-finite norm skips the step (counted in actor/skipped_steps).

        Metrics (global, over all ranks): actor/pg_loss and actor/kl_loss (mean over optimizer steps of the
        aggregated mini-batch loss), token means of actor/entropy (true entropy), actor/ppo_kl,
        actor/pg_clipfrac_higher / _lower and TIS metrics from policy_loss, actor/grad_norm (mean of the finite
        norms before clipping), actor/lr (last step), actor/skipped_steps, actor/tokens (response tokens per
        epoch); on CUDA perf/mfu_actor (this rank's counted FLOPs / time / peak) and perf/max_memory_allocated_gb.
        """
        if self.optimizer is None:
            raise RuntimeError("Actor.update: this is the reference (role='ref'); it has no optimizer")
        c = self.cfg
        start, flops = time.perf_counter(), 0.0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        mini_size = self._mini_batch_size()
        if len(samples) % mini_size:
            raise ValueError(f"Actor.update: {len(samples)} samples on rank {self.rank} is not a multiple of the "
                             f"mini-batch size {mini_size} (worker.actor.global_batch_size={c.global_batch_size} x "
                             f"n={self.n_per_prompt} / {self.world} ranks)")
        minis = self._chunks(len(samples), mini_size)
        self.onload(optimizer=True)
        modalities = self._modalities(samples)
        use_rollout = c.tis_cap is not None or bool(self._all_ranks(
            [all("rollout_logprobs" in s for s in samples)], "min")[0])
        sums, grad_norms, skipped, tokens = {}, [], 0, 0

        for _ in range(c.ppo_epochs):
            for mini in minis:
                plans = self._plan([samples[i] for i in mini], "update")
                n_tokens, n_seqs = self._all_ranks([sum(len(samples[i]["response_ids"]) for i in mini), len(mini)])
                for part in plans:
                    idx = [mini[j] for j in part]
                    batch = self._pack(samples, idx)
                    logp, ent = self._forward(batch, c.compute_entropy, modalities)  # [N], [N] or [0]
                    old, adv, ref, rollout = self._targets(batch, samples, idx, use_rollout)
                    loss_tok, metrics = policy_loss(
                        logp, old, adv, batch["resp_cu_seqlens"], loss_type=c.loss_type,
                        clip_ratio_low=c.clip_ratio_low, clip_ratio_high=c.clip_ratio_high,
                        clip_ratio_dual=c.clip_ratio_dual, tau_positive=c.tau_positive, tau_negative=c.tau_negative,
                        rollout_logp=rollout, tis_cap=c.tis_cap)
                    agg = dict(mode=c.loss_avg_mode, global_tokens=n_tokens, global_seqs=n_seqs,
                               seq_len_norm=self.max_response_length)
                    pg_loss = aggregate_loss(loss_tok, batch["resp_cu_seqlens"], **agg)
                    loss = pg_loss
                    if self.use_kl_loss:
                        kl_loss = aggregate_loss(kl_penalty(logp, ref, self.kl_kind), batch["resp_cu_seqlens"], **agg)
                        loss = loss + self.kl_coef * kl_loss
                    real = 1.0 if idx else 0.0  # 0: a dummy micro-batch that only keeps the collectives in step
                    (loss * real * self.world).backward()
                    flops += self._flops(batch)
                    tokens += len(logp) * real
                    _accumulate(sums, "pg_loss", pg_loss * real)  # every rank accumulates the same names
                    if self.use_kl_loss:
                        _accumulate(sums, "kl_loss", kl_loss * real)
                    for name, value in metrics.items():
                        _accumulate(sums, name + "@tokens", value.sum() * real)
                    if c.compute_entropy:
                        _accumulate(sums, "entropy@tokens", ent.sum() * real)
                norm = self._optimizer_step()
                grad_norms.append(norm)
                skipped += not math.isfinite(norm)

        self.offload()
        steps = len(minis) * c.ppo_epochs
        names = sorted(sums)
        totals = self._all_ranks([float(sums[n]) for n in names] + [tokens])
        all_tokens = max(totals[-1], 1.0)
        out = {f"actor/{n.split('@')[0]}": v / (all_tokens if n.endswith("@tokens") else steps)
               for n, v in zip(names, totals)}
        finite = [g for g in grad_norms if math.isfinite(g)]
        out.update({"actor/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                    "actor/lr": self.lr_scheduler.get_last_lr()[0], "actor/skipped_steps": float(skipped),
                    "actor/tokens": totals[-1] / c.ppo_epochs})
        self.lr_scheduler.step()  # once per training step, after its update (EasyR1)
        if self.device.type == "cuda":
            elapsed = time.perf_counter() - start
            out["perf/mfu_actor"] = flops / elapsed / (peak_tflops(self.device) * 1e12)
            out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    @torch.no_grad()
    def named_tensors(self):
        """Stream (name, full tensor) pairs, one gathered at a time, for the rollout engine's load_weights.

        Names are those of the Hugging Face model's own state_dict(). With LoRA, each adapted weight is
        yielded MERGED (W + scaling * B @ A) under the base name (".base_layer" removed) and the adapter
        tensors are not yielded: the engine sees a plain model. Tensors are on self.device in the master dtype
        (the engine casts). With a process group every rank must iterate to the end (all-gathers).
        """
        adapted = {name: m for name, m in self.hf.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
        for name, tensor in self.hf.state_dict().items():
            if ".lora_" in name:
                continue
            full = full_tensor(tensor, self.device)
            if ".base_layer." in name:
                owner, leaf = name.split(".base_layer.")
                name = f"{owner}.{leaf}"
                if leaf == "weight" and self.lora_rank:
                    m = adapted[owner]
                    a = full_tensor(m.lora_A["default"].weight, self.device).float()  # [r, in]
                    b = full_tensor(m.lora_B["default"].weight, self.device).float()  # [out, r]
                    full = (full.float() + m.scaling["default"] * (b @ a)).to(full.dtype)
            yield name, full

    def save_checkpoint(self, path, model_only=False):
        """Write `path`/model (DCP, the state dict of the HF model, or of the peft model with LoRA: base +
        adapter names), `path`/optim (DCP; not with model_only), `path`/extra_state.pt (optimizer step
        count, LR scheduler state, RNG of rank 0) and `path`/huggingface/ (config, generation config,
        tokenizer and processor from the model path; adapter_config.json with LoRA)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        os.makedirs(path, exist_ok=True)
        dcp.save(get_model_state_dict(self.module), checkpoint_id=os.path.join(path, "model"))
        if self.optimizer is not None and not model_only:
            dcp.save(get_optimizer_state_dict(self.module, self.optimizer), checkpoint_id=os.path.join(path, "optim"))
        if self.rank == 0:
            rng = {"python": random.getstate(), "cpu": torch.get_rng_state(),
                   "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
            torch.save({"optimizer_steps": self.optimizer_steps, "rng": rng,
                        "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None},
                       os.path.join(path, "extra_state.pt"))
            save_hf_files(self.cfg.model, os.path.join(path, "huggingface"), self.module if self.lora_rank else None)
        if self.sharded:
            dist.barrier()

    def load_checkpoint(self, path):
        """Load what save_checkpoint wrote, on any world size. Every file is required (a save_model_only
        checkpoint has no optim/ and cannot be resumed): a missing one raises FileNotFoundError, never a silent
        fresh optimizer, LR schedule or RNG."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        needed = ["model", "extra_state.pt"] + (["optim"] if self.optimizer is not None else [])
        missing = [name for name in needed if not os.path.exists(os.path.join(path, name))]
        if missing:
            raise FileNotFoundError(f"Actor.load_checkpoint: {path} lacks {', '.join(missing)}; expected the folder "
                                    "that Actor.save_checkpoint wrote (global_step_N/actor, not save_model_only)")
        state = get_model_state_dict(self.module)
        dcp.load(state, checkpoint_id=os.path.join(path, "model"))
        set_model_state_dict(self.module, state)
        if self.optimizer is not None:
            optim_state = get_optimizer_state_dict(self.module, self.optimizer)
            dcp.load(optim_state, checkpoint_id=os.path.join(path, "optim"))
            set_optimizer_state_dict(self.module, self.optimizer, optim_state)
        extra = torch.load(os.path.join(path, "extra_state.pt"), weights_only=True)  # tensors and plain containers
        self.optimizer_steps = extra["optimizer_steps"]
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        random.setstate(extra["rng"]["python"])
        torch.set_rng_state(extra["rng"]["cpu"])
        if extra["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(extra["rng"]["cuda"])

    # ------------------------------------------------------------------------------------------
    # The pieces of the passes
    # ------------------------------------------------------------------------------------------

    def _forward(self, batch, with_entropy, modalities):
        """One packed micro-batch -> (logp [N], entropy [N] or [0]) of its response tokens."""
        amp = torch.autocast(self.device.type, dtype=self.compute_dtype) if self.autocast else contextlib.nullcontext()
        with amp:
            return self.hf.packed_forward(batch, self.temperature, with_entropy, modalities, self.dummy_vision)

    def _optimizer_step(self):
        """Clip the global gradient norm to max_grad_norm (torch's clip_grad_norm_, which reduces the norm of
        FSDP2's sharded DTensor gradients over the ranks), step unless it is not finite; -> the norm before
        clipping. The learning rate is the schedule's for this training step (stepped once per update)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm or math.inf)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor when sharded
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            logger.warning("actor: gradient norm is %s at optimizer step %d; the step is skipped", norm,
                           self.optimizer_steps)
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return norm

    def onload(self, optimizer=False):
        """Parameters (offload.offload_params) and, with `optimizer`, optimizer state (offload.offload_optimizer) to
        the device for a pass. A no-op for what is not offloaded. compute_log_probs and update call it themselves."""
        if self.offload_params:
            self.module.to(self.device)  # FSDP2 moves its DTensor shards (FSDPModule._apply reshards, then re-pads)
        if optimizer and self.offload_optimizer:
            self._move_optimizer_state(self.device)

    def offload(self):
        """After a pass: offloaded parameters (with any gradients) and optimizer state to the CPU, and the freed
        device memory back to the driver, where the rollout engine takes it while it generates."""
        if self.offload_params:
            self.module.to("cpu")
        if self.offload_optimizer:
            self._move_optimizer_state(torch.device("cpu"))
        if self.offload_params or self.offload_optimizer:
            torch.cuda.empty_cache()

    def _move_optimizer_state(self, device):
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value):
                    state[key] = value.to(device)

    def _plan(self, samples, kind):
        """Micro-batches of a mini-batch for the `kind` ("update" / "experience") pass: lists of indices,
        balanced by tokens under the token budget (dynamic batching; else micro_batch_size_per_device_for_<kind>
        samples each), the same count on every rank (an empty list is a dummy micro-batch). Dynamic batching keeps
        the samples that share images (a prompt's responses) together where the budget allows: encoded once."""
        lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
        size = getattr(self.cfg, f"micro_batch_size_per_device_for_{kind}")
        if self.cfg.dynamic_batching:
            budget = self._budget(kind)
            units = shared_image_units(samples, lengths, budget)
            unit_lengths = [sum(lengths[i] for i in unit) for unit in units]
            k = micro_batches_needed(unit_lengths, budget)
            if max(lengths, default=0) > budget:
                logger.warning("actor: a sequence of %d tokens exceeds the micro-batch budget of %d tokens; it gets "
                               "a micro-batch of its own", max(lengths), budget)
        else:
            k = math.ceil(len(samples) / size)
        k = max(1, int(self._all_ranks([k], "max")[0]))
        if self.cfg.dynamic_batching:
            return [sorted(i for u in part for i in units[u]) for part in partition_balanced(unit_lengths, k)]
        return [list(range(i * size, min((i + 1) * size, len(samples)))) for i in range(k)]

    def _pack(self, samples, idx):
        """Pack samples[idx] (a dummy one-token sample when idx is empty) and move the tensors to the device."""
        chosen = [samples[i] for i in idx] or [{"prompt_ids": [self.pad_id], "response_ids": [self.pad_id]}]
        batch = pack_samples(chosen, self.is_vl, names=[f"sample {i}" for i in idx] or ["dummy"],
                             image_token_id=self.image_token_id, video_token_id=self.video_token_id,
                             merge=self.dummy_vision[2] if self.is_vl else None)
        return {k: _to(v, self.device) for k, v in batch.items()}

    def _targets(self, batch, samples, idx, use_rollout):
        """Per-token old log-probs, advantages, reference and rollout log-probs of a micro-batch: [N] each."""
        n = sum(batch["resp_lens"])
        if not idx:
            zeros = torch.zeros(n, device=self.device)
            return zeros, zeros, zeros, (zeros if use_rollout else None)

        def flat(key, required):
            parts = []
            for i in idx:
                if key not in samples[i]:
                    if not required:
                        return None
                    raise KeyError(f"Actor.update: sample {i} has no {key!r} (compute it before the update)")
                value = torch.as_tensor(samples[i][key], dtype=torch.float32).reshape(-1)
                if key == "advantage" and value.numel() == 1:  # one per response: broadcast to its tokens
                    value = value.expand(len(samples[i]["response_ids"]))
                if value.numel() != len(samples[i]["response_ids"]):
                    raise ValueError(f"Actor.update: sample {i}: {key} has {value.numel()} values for "
                                     f"{len(samples[i]['response_ids'])} response tokens")
                parts.append(value)
            return torch.cat(parts).to(self.device)

        adv = flat("advantage", required=True)  # [N]
        ref = flat("ref_logprobs", required=True) if self.use_kl_loss else None
        rollout = flat("rollout_logprobs", required=True) if use_rollout else None
        return flat("old_logprobs", required=True), adv, ref, rollout

    def _flops(self, batch):
        """Forward + backward FLOPs of a micro-batch (recomputation not counted), with P the parameter counts of
        count_flops_params, T the tokens, R the response tokens (the only ones the LM head runs on), L the
        sequence lengths:  6 (P_body T + P_head R + P_vision patches) + 6 d h layers sum(L^2)  (causal attention:
        QK^T and AV are 2 x 2 d h L^2 / 2 FLOPs forward per layer, backward twice that)."""
        p = self.flops_params
        squares = sum(length * length for length in batch["seq_lens"])
        patches = sum(v.shape[0] for k, v in batch["mm"].items() if k.startswith("pixel_values"))
        return 6.0 * (p["body"] * sum(batch["seq_lens"]) + p["head"] * sum(batch["resp_lens"])
                      + p["vision"] * patches + p["attention"] * squares)

    def _modalities(self, samples):
        """Vision calls every micro-batch makes: ("image",) or ("image", "video") if any rank has videos."""
        if not self.is_vl:
            return ()
        has_video = any("pixel_values_videos" in (s.get("multi_modal_inputs") or {}) for s in samples)
        return ("image", "video") if self._all_ranks([has_video], "max")[0] else ("image",)

    def _budget(self, kind):
        c = self.cfg
        if c.max_tokens_per_micro_batch:
            return c.max_tokens_per_micro_batch
        if self.max_prompt_length is None or self.max_response_length is None:
            raise ValueError("Actor: set worker.actor.max_tokens_per_micro_batch, or pass max_prompt_length and "
                             "max_response_length so the budget is micro_batch_size_per_device x their sum")
        per_device = getattr(c, f"micro_batch_size_per_device_for_{kind}")
        return per_device * (self.max_prompt_length + self.max_response_length)

    def _mini_batch_size(self):
        total = self.cfg.global_batch_size * self.n_per_prompt
        if total % self.world:
            raise ValueError(f"Actor: global_batch_size x n = {total} samples per mini-batch cannot be split over "
                             f"{self.world} ranks")
        return total // self.world

    def _chunks(self, n, size):
        """[0..n) cut into consecutive chunks of `size`; every rank gets as many chunks (padded with [])."""
        chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        count = int(self._all_ranks([len(chunks)], "max")[0])
        return chunks + [[] for _ in range(count - len(chunks))]

    def _all_ranks(self, values, op="sum"):
        """All-reduce a list of numbers over the ranks (sum, max or min); the numbers themselves without a group."""
        if not self.sharded:
            return [float(v) for v in values]
        device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t.tolist()


# ----------------------------------------------------------------------------------------------
# Packing and balancing
# ----------------------------------------------------------------------------------------------

def partition_balanced(lengths, k, equal_size=False):
    """Split indices 0..len(lengths)-1 into k groups with near-equal sums of lengths: largest first, each
    into the lightest group (that still has room, with equal_size: len(lengths) / k items per group).
    Returns k lists of indices, each ascending; groups may be empty when k > len(lengths)."""
    if k < 1:
        raise ValueError(f"partition_balanced: k must be >= 1, got {k}")
    if equal_size and len(lengths) % k:
        raise ValueError(f"partition_balanced: {len(lengths)} items cannot be split into {k} equal groups")
    capacity = len(lengths) // k if equal_size else len(lengths)
    groups, sums = [[] for _ in range(k)], [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min((g for g in range(k) if len(groups[g]) < capacity), key=lambda g: (sums[g], len(groups[g]), g))
        groups[g].append(i)
        sums[g] += lengths[i]
    return [sorted(g) for g in groups]


def shared_image_units(samples, lengths, budget):
    """Sample indices in units to place whole: the samples that share one multi_modal_inputs dict (the n responses
    of an image prompt) together, in runs of at most `budget` tokens; every other sample alone."""
    units, unit_of = [], {}
    for i, sample in enumerate(samples):
        inputs = sample.get("multi_modal_inputs")
        u = unit_of.get(id(inputs)) if inputs else None
        if u is None or sum(lengths[j] for j in units[u]) + lengths[i] > budget:
            units.append([])
            u = len(units) - 1
            if inputs:
                unit_of[id(inputs)] = u
        units[u].append(i)
    return units


def micro_batches_needed(lengths, budget):
    """The fewest groups >= ceil(total / budget) whose balanced partition keeps every group of two or more
    sequences within `budget` tokens (a longer single sequence gets a group of its own)."""
    k = max(1, math.ceil(sum(lengths) / budget))
    while k < len(lengths):
        if all(sum(lengths[i] for i in g) <= budget or len(g) == 1 for g in partition_balanced(lengths, k)):
            break
        k += 1
    return max(1, min(k, len(lengths)))


def pack_samples(samples, is_vl, names=None, image_token_id=None, video_token_id=None, merge=None):
    """Samples -> one padding-free row. Returned tensors are on the CPU:

        input_ids        [1, T]           prompt + response of every sample, back to back
        position_ids     [4, 1, T] (VL) or [1, T] (text): each sample's prompt rows, continued over the
                                          response at last + 1, last + 2, ... in every row
        cu_seqlens       [n + 1] int32    sequence boundaries in the row;  max_seqlen: int
        resp_index       [N]              row positions whose output predicts a response token (the one before it)
        labels           [N]              the response tokens: shifted labels built per sequence, never across
        resp_cu_seqlens  [n + 1] int32    each sample's response tokens in [N]
        resp_lens, seq_lens  list[int];   mm: dict of multi-modal tensors concatenated in sample order
        mm_order         {"image" / "video": [k]}   which encoded image (video) fills each one of the row, in
                                          order: samples that share one multi_modal_inputs dict (the n responses
                                          of a prompt) share its images, which are in `mm` and encoded once
    """
    names = names or [f"sample {i}" for i in range(len(samples))]
    ids, positions, resp_index, labels, seq_lens, resp_lens, mm = [], [], [], [], [], [], {}
    order, first = {"image": [], "video": []}, {}  # first: (id of a multi_modal_inputs dict, key) -> its first image
    start = 0
    for name, s in zip(names, samples):
        prompt, response = list(s["prompt_ids"]), list(s["response_ids"])
        if not prompt:
            raise ValueError(f"pack_samples: {name} has an empty prompt")
        pos = s.get("position_ids")
        pos = torch.arange(len(prompt))[None] if pos is None else torch.as_tensor(pos).long()  # [R, P]
        if pos.ndim != 2 or pos.shape[1] != len(prompt):
            raise ValueError(f"pack_samples: {name}: position_ids has shape {tuple(pos.shape)}, expected "
                             f"[rows, {len(prompt)}] (rows, prompt length)")
        if is_vl and pos.shape[0] == 1:  # text-only row of a VL model: all four rows alike
            pos = pos.expand(4, -1)
        elif is_vl and pos.shape[0] == 3:  # mrope rows only: put the text row on top
            pos = torch.cat([torch.arange(pos.shape[1])[None], pos])
        if pos.shape[0] != (4 if is_vl else 1):
            raise ValueError(f"pack_samples: {name}: position_ids has {pos.shape[0]} rows; a VL model takes 4 "
                             "(text + t/h/w; 1 or 3 are completed), a text model 1")
        steps = torch.arange(1, len(response) + 1)
        positions.append(torch.cat([pos, pos[:, -1:] + steps], dim=1))  # [R, L]
        inputs = s.get("multi_modal_inputs") or {}
        for modality, token, key, grid in (("image", image_token_id, "pixel_values", "image_grid_thw"),
                                           ("video", video_token_id, "pixel_values_videos", "video_grid_thw")):
            expected = int((torch.as_tensor(inputs[grid]).prod(-1) // merge**2).sum()) if key in inputs else 0
            if is_vl and (prompt.count(token) != expected or token in response):
                raise ValueError(f"pack_samples: {name} has {prompt.count(token)} {key} placeholder tokens in its "
                                 f"prompt (and {response.count(token)} in its response) for {expected} "
                                 f"{key} features; expand the placeholders the way the processor does")
            if key not in inputs:
                continue
            count = len(torch.as_tensor(inputs[grid]))
            if (id(inputs), key) not in first:  # a new prompt's images: encoded once for all its samples here
                first[id(inputs), key] = sum(len(g) for g in mm.get(grid, []))
                for k in (key, grid):
                    mm.setdefault(k, []).append(torch.as_tensor(inputs[k]))
            order[modality] += range(first[id(inputs), key], first[id(inputs), key] + count)
        ids += prompt + response
        resp_index.append(torch.arange(start + len(prompt) - 1, start + len(prompt) + len(response) - 1))
        labels += response
        seq_lens.append(len(prompt) + len(response))
        resp_lens.append(len(response))
        start += seq_lens[-1]
    position_ids = torch.cat(positions, dim=1)  # [R, T]
    return {
        "input_ids": torch.tensor([ids]),
        "position_ids": position_ids[:, None] if is_vl else position_ids,
        "cu_seqlens": _cumulative(seq_lens), "max_seqlen": max(seq_lens),
        "resp_index": torch.cat(resp_index), "labels": torch.tensor(labels, dtype=torch.long),
        "resp_cu_seqlens": _cumulative(resp_lens), "resp_lens": resp_lens, "seq_lens": seq_lens,
        "mm": {k: torch.cat(v) for k, v in mm.items()}, "mm_order": order,
    }


# ----------------------------------------------------------------------------------------------
# The forward: body, vision calls, response-only head
# ----------------------------------------------------------------------------------------------

def packed_forward(hf, batch, temperature, with_entropy, modalities, dummy_vision):
    """Bound to the HF model as `packed_forward` (and registered with FSDP2 as a forward method, so the
    root's parameters are gathered around it). -> (logp [N], entropy [N] or [0]) of the response tokens.

    Vision (VL models): one call per modality in `modalities`, always in the same order; a micro-batch
    without that input runs the tower on a dummy and joins it as zero rows (see _as_zero_rows).
    """
    body = getattr(hf, hf.base_model_prefix)
    kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False,
                  packed_cu_seqlens=batch["cu_seqlens"], packed_max_seqlen=batch["max_seqlen"])
    if modalities:
        encoded = {}
        for modality in modalities:
            method, pixels, grid = VISION_CALLS[modality]
            if pixels in batch["mm"]:
                out = getattr(body, method)(batch["mm"][pixels], batch["mm"][grid], return_dict=True)
                encoded[modality] = _repeat_images(out, batch["mm_order"][modality], len(batch["mm"][grid]))
            else:
                dummy_pixels, dummy_grid, _ = dummy_vision
                out = getattr(body, method)(dummy_pixels.to(batch["input_ids"].device),
                                            dummy_grid.to(batch["input_ids"].device), return_dict=True)
                encoded[modality] = _as_zero_rows(out)
        kwargs["mm_encoder_outputs"] = encoded
    hidden = body(**kwargs).last_hidden_state[0]  # [T, H]
    return response_log_probs(hidden.index_select(0, batch["resp_index"]), hf.get_output_embeddings(),
                              batch["labels"], temperature, with_entropy)


def response_log_probs(hidden, lm_head, labels, temperature, with_entropy=False, chunk=HEAD_CHUNK):
    """hidden [N, H] (the states that predict the response tokens), labels [N] ->
    (logp [N] fp32, entropy [N] fp32 or [0]), with z = lm_head(h) / temperature in fp32:

        logp_t = z_t[y_t] - logsumexp(z_t)          entropy_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v

    Chunks of `chunk` rows, each under activation checkpointing when gradients are on, so at most one
    [chunk, vocab] fp32 block exists at a time (forward and backward). Entropy carries no gradient.
    """
    def head(h, y):
        z = lm_head(h).float() / temperature  # [c, V]
        logz = torch.logsumexp(z, dim=-1)  # [c]
        logp = z.gather(-1, y[:, None])[:, 0] - logz
        with torch.no_grad():
            ent = logz - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else z.new_zeros(0)
        return logp, ent

    logps, ents = [], []
    for s in range(0, hidden.shape[0], chunk):
        h, y = hidden[s:s + chunk], labels[s:s + chunk]
        logp, ent = checkpoint(head, h, y, use_reentrant=False) if torch.is_grad_enabled() else head(h, y)
        logps.append(logp)
        ents.append(ent)
    if not logps:  # no response tokens: keep the graph connected to the model
        return hidden.sum(-1).float() * 0.0, hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(logps), torch.cat(ents)


def _repeat_images(output, order, n_images):
    """A vision output of n_images distinct images with its per-image tuples (pooler_output; Qwen3-VL's
    deepstack_features, one tuple per layer) re-indexed by `order`, so an image shared by several samples of
    the row is encoded once and still fills each sample's placeholders (its gradient sums over them)."""
    if list(order) == list(range(n_images)):
        return output

    def pick(value):
        if isinstance(value, (tuple, list)) and len(value) == n_images and all(torch.is_tensor(v) for v in value):
            return tuple(value[i] for i in order)
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, (tuple, list)) for v in value):
            return [pick(v) for v in value]
        return value

    for key in list(output.keys()):
        output[key] = pick(output[key])
    return output


def _as_zero_rows(output):
    """A vision output with every tensor replaced by zero rows that still depend on the tower (x[:0] + 0 * sum):
    merged into the text as nothing, yet the tower joins the backward like a real image would."""
    leaves = []
    for value in output.values():
        _map_tensors(value, lambda t: leaves.append(t) or t)
    zero = sum(t.float().sum() for t in leaves if t.is_floating_point()) * 0.0  # a 0-dim tensor
    for key in list(output.keys()):
        output[key] = _map_tensors(output[key], lambda t: t[:0] + zero.to(t.dtype) if t.is_floating_point() else t[:0])
    return output


def _map_tensors(x, fn):
    if torch.is_tensor(x):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn) for v in x)
    return x


# ----------------------------------------------------------------------------------------------
# Attention: sequence-isolated varlen attention, registered with transformers
# ----------------------------------------------------------------------------------------------

def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function. query [1, Hq, T, D], key / value [1, Hkv, T, D] -> ([1, T, Hq, D], None).

    Boundaries: the vision tower passes its own per-window / per-image `cu_seq_lens_q` (non-causal); the
    text model gets this file's `packed_cu_seqlens` / `packed_max_seqlen` through the forward kwargs.
    Causality: `is_causal` when given, else module.is_causal.
    """
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError("packed_attention: expects one packed row and no attention mask (it is the padding-free "
                         "path of actor.py); use attn_implementation='sdpa' for padded batches")
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None:
        cu, max_len = kwargs.get("packed_cu_seqlens"), kwargs.get("packed_max_seqlen")
    if cu is None:
        cu, max_len = torch.tensor([0, query.shape[2]], device=query.device), query.shape[2]
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    if torch.is_autocast_enabled(q.device.type):  # rotary embeddings promote q, k to the fp32 of master weights;
        low = torch.get_autocast_dtype(q.device.type)  # the varlen kernels want the compute dtype (no O(T^2) mask)
        q, k, v = q.to(low), k.to(low), v.to(low)
    out = varlen_attention(q, k, v, cu.to(device=q.device, dtype=torch.int32), int(max_len), causal, scaling)
    return out[None], None


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, causal, scale=None):
    """q [T, Hq, D], k / v [T, Hkv, D], sequences at cu_seqlens [n + 1] -> [T, Hq, D]. Backends, logged once:
    flash-attn varlen (CUDA, installed); torch varlen_attn (CUDA, bf16/fp16); else an exact block-diagonal
    (causal) mask with scaled_dot_product_attention."""
    if q.is_cuda and _flash_varlen() is not None:
        _log_backend("flash-attn flash_attn_varlen_func")
        return _flash_varlen()(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale,
                               causal=causal)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _torch_varlen() is not None:
        _log_backend("torch.nn.attention.varlen.varlen_attn")
        fn, params = _torch_varlen()
        kw = {"is_causal": causal} if "is_causal" in params else {"window_size": (-1, 0) if causal else (-1, -1)}
        if k.shape[1] != q.shape[1] and "enable_gqa" in params:
            kw["enable_gqa"] = True  # torch 2.11 took fewer KV heads without the flag
        return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **kw)
    _log_backend("block-diagonal mask + scaled_dot_product_attention")
    seq = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=q.device), cu_seqlens.diff())  # [T]
    mask = seq[:, None] == seq[None, :]  # [T, T]
    if causal:
        mask = mask.tril()
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


_BACKENDS = {}


def _flash_varlen():
    if "flash" not in _BACKENDS:
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError:
            flash_attn_varlen_func = None
        _BACKENDS["flash"] = flash_attn_varlen_func
    return _BACKENDS["flash"]


def _torch_varlen():
    if "torch" not in _BACKENDS:
        try:
            from torch.nn.attention.varlen import varlen_attn
            _BACKENDS["torch"] = (varlen_attn, set(inspect.signature(varlen_attn).parameters))
        except ImportError:
            _BACKENDS["torch"] = None
    return _BACKENDS["torch"]


def _log_backend(name):
    if ("logged", name) not in _BACKENDS:
        _BACKENDS[("logged", name)] = True
        logger.info("actor: attention backend %s", name)


# ----------------------------------------------------------------------------------------------
# Model construction: loading, LoRA, FSDP2
# ----------------------------------------------------------------------------------------------

def load_model(model_cfg, master_dtype, compute_dtype, lora_rank, meta=False, keep_full_state=False):
    """-> (hf model, state module (the peft model with LoRA, else the hf model), config, full state dict or None).

    AutoModelForImageTextToText when the config has a vision_config (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), else
    AutoModelForCausalLM. `meta`: build without weights (they arrive from rank 0). Attention is routed to
    packed_attention on every sub-config. LoRA: peft adapters in the master dtype on frozen base weights
    stored in the compute dtype.
    """
    from transformers import (AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                              PreTrainedConfig)

    AttentionInterface.register(ATTENTION, packed_attention)
    config = AutoConfig.from_pretrained(model_cfg.model_path, trust_remote_code=model_cfg.trust_remote_code,
                                        **(model_cfg.override_config or {}))
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    weights_dtype = compute_dtype if lora_rank else master_dtype
    if meta:
        with torch.device("meta"):
            hf = auto.from_config(config, dtype=weights_dtype, trust_remote_code=model_cfg.trust_remote_code)
    else:
        hf = auto.from_pretrained(model_cfg.model_path, config=config, dtype=weights_dtype,
                                  trust_remote_code=model_cfg.trust_remote_code, attn_implementation="sdpa")
    seen = set()
    for m in hf.modules():
        c = getattr(m, "config", None)
        if isinstance(c, PreTrainedConfig) and id(c) not in seen:
            seen.add(id(c))
            c._attn_implementation = ATTENTION  # the setter recurses into sub-configs
    module = hf
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = model_cfg.lora
        targets = lora.target_modules if lora.target_modules == "all-linear" else \
            [t.strip() for t in lora.target_modules.split(",") if t.strip()]
        module = get_peft_model(hf, LoraConfig(task_type="CAUSAL_LM", r=lora.rank, lora_alpha=lora.alpha,
                                               target_modules=targets, exclude_modules=lora.exclude_modules))
        for name, p in module.named_parameters():
            p.data = p.data.to(master_dtype if p.requires_grad else compute_dtype)
    full_state = {k: v for k, v in module.state_dict().items()} if keep_full_state else None
    return hf, module, config, full_state


def vision_tower(hf):
    body = getattr(hf, hf.base_model_prefix)
    tower = getattr(body, "visual", None)
    if "mm_encoder_outputs" not in inspect.signature(body.forward).parameters:
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__}: {type(body).__name__}.forward takes no "
                           "mm_encoder_outputs, which actor.py needs to run the vision tower in a fixed order "
                           "(the same on every rank); install transformers>=5.18 (tested with 5.22.2 and 5.24.0)")
    if tower is None:
        raise ValueError(f"{type(hf).__name__} has no vision tower at .{hf.base_model_prefix}.visual; actor.py knows "
                         "the Qwen2-VL, Qwen2.5-VL and Qwen3-VL layouts")
    return tower


def dummy_vision_input(hf):
    """(pixel rows [16, dim], grid_thw [[1, 4, 4]], spatial merge size): the smallest valid image for the tower."""
    tower = vision_tower(hf)
    dim = tower.patch_embed.proj.weight[0].numel()  # channels x temporal patch x patch x patch
    merge = hf.config.vision_config.spatial_merge_size
    return torch.zeros(16, dim), torch.tensor([[1, 4, 4]]), merge


def shard_model(hf, device, fsdp_cfg, compute_dtype, world):
    """fully_shard every decoder layer and vision block (the model's _no_split_modules), then the root.
    fsdp_size in (0, world): hybrid sharding (replicate x shard). -> the process group of the shard dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    size = fsdp_cfg.fsdp_size
    if 0 < size < world:
        mesh = init_device_mesh(device.type, (world // size, size), mesh_dim_names=("ddp", "fsdp"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    offload = fsdp_cfg.enable_cpu_offload and device.type == "cuda"
    precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=DTYPES[fsdp_cfg.mp_reduce_dtype],
                                     cast_forward_inputs=True)
    kwargs = dict(mesh=mesh, reshard_after_forward=fsdp_cfg.enable_full_shard, mp_policy=precision,
                  offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    units = set(getattr(hf, "_no_split_modules", None) or [])
    for m in list(hf.modules()):
        if type(m).__name__ in units:
            fully_shard(m, **kwargs)
    fully_shard(hf, **kwargs)
    return mesh["fsdp"].get_group()


def broadcast_buffers(hf, device):
    """Buffers are not in a state dict when non-persistent (rotary inv_freq): send rank 0's to the meta-built ranks."""
    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    for m in hf.modules():
        for name, buf in list(m._buffers.items()):
            if buf is None:
                continue
            local = torch.empty(buf.shape, dtype=buf.dtype, device=comm) if buf.is_meta else buf.to(comm)
            dist.broadcast(local, src=0)
            m._buffers[name] = local.to(device)


def save_hf_files(model_cfg, path, peft_model=None):
    """config.json (with override_config), generation_config.json, tokenizer / processor, adapter_config.json."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer, GenerationConfig

    source = model_cfg.tokenizer_path or model_cfg.model_path
    AutoConfig.from_pretrained(model_cfg.model_path, trust_remote_code=model_cfg.trust_remote_code,
                               **(model_cfg.override_config or {})).save_pretrained(path)
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


# ----------------------------------------------------------------------------------------------
# Optimizer pieces
# ----------------------------------------------------------------------------------------------

class AdamWBF16(torch.optim.Optimizer):
    """AdamW for bf16 weights (optim.strategy=adamw_bf16, as EasyR1's AnyPrecisionAdamW): moments m, v and a
    Kahan compensation c stored in bf16, arithmetic in fp32. Per parameter p, step t:

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        u = -lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd p) + c     the step plus what was lost before
        s = p + u (fp32);   p = bf16(s);   c = s - p                           c: what this write-back lost

    Without c, a step below half a bf16 spacing of p is lost: lr 1e-6 on weights of 0.02 (spacing 1.2e-4) moves
    nothing. Weight decay goes through c too (EasyR1 multiplies p in place, where lr wd = 1e-8 rounds away).
    Works on FSDP2 shards: the arithmetic runs on local tensors, the state stays DTensor (sharded checkpoints)."""

    def __init__(self, params, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            (b1, b2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq", "compensation"):
                        state[key] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                t = state["step"].item()
                x, g = _local(p), _local(p.grad).float()  # [shard]
                m, v, c = (_local(state[k]) for k in ("exp_avg", "exp_avg_sq", "compensation"))
                m32 = m.float().lerp_(g, 1 - b1)
                v32 = v.float().mul_(b2).addcmul_(g, g, value=1 - b2)
                m.copy_(m32)
                v.copy_(v32)
                del g
                u = m32.div_(v32.div_(1 - b2 ** t).sqrt_().add_(eps)).mul_(-lr / (1 - b1 ** t))
                del v32
                s = x.to(torch.float32, copy=True)
                u.add_(s, alpha=-lr * wd).add_(c)
                s.add_(u)
                x.copy_(s)
                c.copy_(s.sub_(x))


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


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------

def count_flops_params(hf, text_config):
    """Parameter counts for the FLOP estimate: {"body": text parameters run on every token (the input embedding
    is a lookup, not counted), "head": the LM head (vocab x hidden, also when tied to the embedding), "vision":
    vision tower parameters (per patch), "attention": head_dim x heads x layers}."""
    head = hf.get_output_embeddings().weight
    body = vision = 0
    for name, p in hf.named_parameters():
        if ".visual." in f".{name}":
            vision += p.numel()
        elif "embed_tokens" not in name and p is not head:
            body += p.numel()
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return {"body": body, "head": head.numel(), "vision": vision,
            "attention": head_dim * heads * text_config.num_hidden_layers}


def peak_tflops(device):
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS:
        if key in name:
            return value
    logger.warning("actor: unknown GPU %r for perf/mfu_actor; assuming 989 TFLOP/s", name)
    return 989.0


def full_tensor(t, device):
    """A DTensor gathered to a full tensor (moved to `device` first: NCCL cannot gather CPU-offloaded shards)."""
    from torch.distributed.tensor import DTensor

    return t.to(device).full_tensor() if isinstance(t, DTensor) else t.to(device)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _cumulative(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _to(value, device):
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _accumulate(sums, name, value):
    sums[name] = sums.get(name, 0.0) + value.detach().double()
