"""The training objective: per-token policy losses, their aggregation, and the KL penalty.

Everything here works on flat, padding-free per-token tensors `[tokens]` holding response tokens
only, with `cu_seqlens [n_seq + 1]` (0, len_0, len_0 + len_1, ..., tokens) marking the sequences.
An empty sequence (len 0) is allowed: it has no tokens, its sequence mean counts as 0.

Differences from EasyR1 (and why):
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

import torch

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
