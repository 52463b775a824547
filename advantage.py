"""advantage.py: advantages from scalar rewards, group ids (the prompt's uid) and, for REINFORCE++, tokens.

    adv = compute_advantages("grpo", scores, uids)
    adv = compute_advantages("remax", scores, uids, baselines=greedy_scores)
    adv = compute_advantages("reinforce_plus_plus", scores, uids, lengths=lengths, token_kl=kl, kl_coef=beta)

scores [N]: the reward function's "overall"; uids [N]: group ids (str, int: hashable values, or a tensor) in any
order, a group being every response with the same uid. KL in the reward (algorithm.use_kl_loss = false): token_kl,
N tensors [L_i] of the per-token KL estimate, times kl_coef (beta); REINFORCE++ subtracts beta * kl_{i,t} token by
token, every other estimator sees r_i = score_i - beta * sum_t kl_{i,t}.
Outputs: float32 [N], one advantage per response (broadcast over its tokens by the actor); for TOKEN_LEVEL
estimators N float32 tensors [L_i]. A group without spread (max - min <= FLAT) gets exactly 0 from every estimator
that compares a group's responses (not remax); a group of one is an error naming its uid unless allow_singletons=True
(advantage 0).
"""

import math
import types

import torch

FLAT = 1e-6  # max - min <= FLAT: a group without spread


def grpo(scores, uids, norm_by_std=True, eps=1e-6, allow_singletons=False):
    """GRPO (DeepSeekMath): A_i = (r_i - mean_g) / (std_g + eps), g the group of response i, std_g unbiased
    (n - 1 in the denominator, as torch.std and EasyR1). norm_by_std=False is Dr. GRPO (arXiv 2503.20783):
    A_i = r_i - mean_g."""
    s = group_stats(scores, uids, allow_singletons)
    adv = s.x - s.mean[s.g]                                                # [N]
    if norm_by_std:
        adv = adv / (s.std[s.g] + eps)
    return torch.where(s.flat[s.g], 0.0, adv).float()


def grpo_passk(scores, uids, eps=1e-6, allow_singletons=False):
    """Pass@k GRPO (arXiv 2503.19595): only the best response of a group is pushed up.

    A_i = (max_g - second_g) / (std_g + eps)  if r_i = max_g,   else 0
    second_g is the largest reward left after taking one maximum out, so a tie at the top gives 0; std_g unbiased.
    """
    s = group_stats(scores, uids, allow_singletons)
    is_top = s.x == s.max[s.g]                                             # [N]
    second = group_reduce(torch.where(is_top, -torch.inf, s.x), s.g, len(s.n), "amax")  # [G] best below the max
    adv = torch.where(is_top & (s.n_top == 1)[s.g], ((s.max - second) / (s.std + eps))[s.g], 0.0)  # [N]
    return torch.where(s.flat[s.g], 0.0, adv).float()


def rloo(scores, uids, allow_singletons=False):
    """RLOO (Ahmadian et al. 2024), a leave-one-out baseline:
    A_i = r_i - (sum_{j in g} r_j - r_i) / (n_g - 1)   ( = n_g / (n_g - 1) * (r_i - mean_g) )."""
    s = group_stats(scores, uids, allow_singletons)
    adv = s.x - (group_reduce(s.x, s.g, len(s.n))[s.g] - s.x) / (s.n[s.g] - 1).clamp(min=1)  # [N]
    return torch.where(s.flat[s.g], 0.0, adv).float()


def reinforce_plus_plus(scores, lengths, token_kl=None, kl_coef=0.0, eps=1e-8):
    """REINFORCE++ (arXiv 2501.03262) as EasyR1 and veRL compute it: token rewards, returns, whitening
    over every response token of the batch.

        r_{i,t} = [t = L_i - 1] * score_i - kl_coef * kl_{i,t}     the score sits on the last token
        G_{i,t} = sum_{s >= t} r_{i,s}                              returns (gamma = 1)
        A_{i,t} = (G_{i,t} - mean(G)) / sqrt(var(G) + eps)          mean, unbiased var over all sum_i L_i tokens

    scores [N]: raw, no KL folded in; token_kl: N tensors [L_i] or None. Long responses weigh more in mean(G), var(G).
    """
    rewards = token_rewards(scores, lengths, token_kl, kl_coef)            # N x [L_i] f64
    returns = torch.cat([r.flip(0).cumsum(0).flip(0) for r in rewards])   # [T]
    return list(whiten(returns, eps).split([len(r) for r in rewards]))


def reinforce_plus_plus_baseline(scores, uids, eps=1e-8, allow_singletons=False):
    """REINFORCE++ with a group baseline (after veRL's reinforce_plus_plus_baseline):

    c_i = r_i - mean_g                              exactly 0 for a group without spread, and so is its A_i
    A_i = (c_i - mean(c)) / sqrt(var(c) + eps)      mean and unbiased var over the N responses; mean(c) = 0 up to
                                                    rounding, as every group's c sums to 0
    """
    s = group_stats(scores, uids, allow_singletons)
    c = torch.where(s.flat[s.g], 0.0, s.x - s.mean[s.g])                  # [N]
    return torch.where(s.flat[s.g], 0.0, whiten(c, eps))


def remax(scores, uids, baselines):
    """ReMax (arXiv 2310.10505): A_i = r_i - b_i, b_i the reward of the greedy response to i's prompt.
    baselines [N]: b_i for every response (the same value within a group; checked)."""
    if baselines is None:
        raise ValueError("remax needs baselines: the reward of a greedy (temperature 0) response per prompt")
    b = group_stats(baselines, uids, allow_singletons=True, what="baseline")
    if not b.flat.all():
        uid = b.names[torch.nonzero(~b.flat)[0].item()]
        raise ValueError(f"remax: the baselines of group uid={uid!r} differ; a prompt has one greedy-response reward")
    return (as_scores(scores, uids) - b.x).float()


TOKEN_LEVEL = {"reinforce_plus_plus"}  # estimators that return one advantage per token
# estimators whose advantages are all 0 for a group without spread: online filtering drops such groups
ZERO_WHEN_FLAT = {"grpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline"}

ESTIMATORS = {"grpo": grpo, "grpo_passk": grpo_passk, "rloo": rloo, "remax": remax,
              "reinforce_plus_plus": reinforce_plus_plus, "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline}


def compute_advantages(name, scores, uids, baselines=None, norm_by_std=True, lengths=None, token_kl=None,
                       kl_coef=0.0, **opts):
    """Advantages from the estimator `name` (a key of ESTIMATORS); inputs and outputs as in the module docstring.
    lengths [N]: for TOKEN_LEVEL (from token_kl when not given); baselines: remax only; norm_by_std
    (algorithm.norm_adv_by_std_in_grpo): grpo only; opts: the estimator's own keywords (eps, allow_singletons)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ESTIMATORS)}")
    if baselines is not None and name != "remax":
        raise ValueError(f"baselines are only used by remax, not by {name}")
    if torch.is_tensor(token_kl) and token_kl.dim() > 1 and (lengths is None or name not in TOKEN_LEVEL):  # padded
        raise ValueError("token_kl: a list of N tensors [L_i], one per response (padding would count as tokens)")
    if name in TOKEN_LEVEL:
        if lengths is None and token_kl is None:
            raise ValueError(f"{name} computes one advantage per token: pass lengths (in tokens) or token_kl")
        lengths = [len(k) for k in token_kl] if lengths is None else [int(n) for n in lengths]
        return ESTIMATORS[name](as_scores(scores, uids), lengths, token_kl, kl_coef, **opts)
    if token_kl is not None:
        scores = kl_in_reward(as_scores(scores, uids), [float(torch.as_tensor(k).sum()) for k in token_kl], kl_coef)
    own_options = {"grpo": {"norm_by_std": norm_by_std}, "remax": {"baselines": baselines}}.get(name, {})
    return ESTIMATORS[name](scores, uids, **own_options, **opts)


# -- KL in the reward (algorithm.use_kl_loss = false): r_i <- r_i - beta * sum_t kl_t ----------------

def kl_in_reward(scores, kl_sums, beta):
    """scores [N] - beta * kl_sums [N] (float64); kl_sums[i] = sum over response i's tokens of the KL
    estimate (the one chosen by algorithm.kl_penalty, between the old policy and the reference)."""
    scores, kl_sums = torch.as_tensor(scores, dtype=torch.float64), torch.as_tensor(kl_sums, dtype=torch.float64)
    if scores.shape != kl_sums.shape or scores.dim() != 1:
        raise ValueError(f"kl_in_reward: scores {list(scores.shape)}, kl_sums {list(kl_sums.shape)}: must both be [N]")
    if bad := torch.nonzero(~torch.isfinite(kl_sums)).flatten().tolist():  # else blamed on the scores
        raise ValueError(f"kl_sums: {kl_sums[bad[0]].item()} at position {bad[0]} is not finite (the KL estimate)")
    return scores - beta * kl_sums


def token_rewards(scores, lengths, token_kl=None, beta=0.0):
    """EasyR1's token-level rewards, N float64 tensors [L_i]: score_i on the last response token, minus
    beta * kl_{i,t} on every token t when token_kl (N tensors [L_i]) is given."""
    x = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)                         # [N]
    if len(x) != len(lengths) or (token_kl is not None and len(token_kl) != len(x)):
        raise ValueError(f"token_rewards: {len(x)} scores, {len(lengths)} lengths and "
                         f"{'no' if token_kl is None else len(token_kl)} token_kl: one of each per response")
    rewards = []
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"response {i} has length {n}; every response needs at least one token")
        kl = torch.zeros(int(n)) if token_kl is None else torch.as_tensor(token_kl[i]).detach().reshape(-1)
        if len(kl) != n:
            raise ValueError(f"response {i}: token_kl has {len(kl)} values for {n} response tokens")
        r = -beta * kl.to("cpu", torch.float64)                                         # [L_i]
        r[-1] += x[i]
        if not torch.isfinite(r).all():  # a NaN would reach every token's advantage through the whitening
            raise ValueError(f"response {i}: score {x[i].item()} - beta {beta} * token_kl has NaN or inf values")
        rewards.append(r)
    return rewards


class FixedKLController:
    """beta stays at kl_coef."""

    def __init__(self, kl_coef):
        self.value = kl_coef

    def update(self, current_kl, n_steps):
        pass


class AdaptiveKLController:
    """Adaptive beta (Ziegler et al. 2019) that steers the measured KL towards target_kl:
    beta <- beta * (1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon)
    current_kl: the step's mean over responses of each response's token-mean KL; n_steps: responses in the step."""

    def __init__(self, init_kl_coef, target_kl, horizon):
        if not (target_kl > 0 and horizon > 0):
            raise ValueError(f"target_kl={target_kl} and horizon={horizon} must be > 0 (algorithm.kl_target, "
                             "kl_horizon)")
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        if not math.isfinite(current_kl) or n_steps >= 5 * self.horizon:  # beta NaN for good, or zero or negative
            raise ValueError(f"current_kl={float(current_kl)} must be finite and n_steps={n_steps} must be below 5 x "
                             f"horizon = {5 * self.horizon:g}")
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


# -- Online filtering and metrics --------------------------------------------------------------------

def groups_to_keep(values, uids, low, high, spread=None, unique_top=False):
    """The set of uids whose groups are worth training on: low < mean_g(values) < high (values: one per response,
    e.g. the filter_key score) and, given `spread` (the raw scores, before any KL in the reward), max_g - min_g of
    spread > FLAT: a ZERO_WHEN_FLAT estimator gives a flat group all-zero advantages; unique_top: and one response at
    the top of spread (grpo_passk gives a shared top 0 too). spread=None tests only the mean, as EasyR1."""
    s = group_stats(values, uids, allow_singletons=True)
    keep = (s.mean > low) & (s.mean < high)  # [G]
    if spread is not None:  # the same groups in the same order: by first appearance
        t = group_stats(spread, uids, allow_singletons=True)
        keep &= ~t.flat & ((t.n_top == 1) if unique_top else True)  # grpo_passk: a shared top is 0 too
    return {s.names[i] for i in torch.nonzero(keep).flatten().tolist()}


def advantage_metrics(scores, advantages, uids):
    """critic/score/{mean,max,min}, critic/advantages/{mean,max,min} (over responses; over tokens for a
    TOKEN_LEVEL estimator's list of [L_i] tensors) and adv/zero_std_group_frac."""
    s = group_stats(scores, uids, allow_singletons=True)
    per_token = isinstance(advantages, list) and advantages and torch.is_tensor(advantages[0]) and advantages[0].dim()
    adv = torch.cat(advantages).double() if per_token else as_scores(advantages, uids, "advantage")  # [T] or [N]
    return {"critic/score/mean": s.x.mean().item(), "critic/score/max": s.x.max().item(),
            "critic/score/min": s.x.min().item(), "critic/advantages/mean": adv.mean().item(),
            "critic/advantages/max": adv.max().item(), "critic/advantages/min": adv.min().item(),
            "adv/zero_std_group_frac": s.flat.double().mean().item()}


# -- Helpers: groups by uid value, whitening ----------------------------------------------------------

def as_scores(scores, uids, what="score"):
    """scores as a float64 [N] tensor; an error if the shape does not match uids or a value is not finite."""
    x = torch.as_tensor(scores, dtype=torch.float64, device="cpu").detach()
    if x.dim() != 1 or len(x) != len(uids):
        raise ValueError(f"{what}s have shape {tuple(x.shape)} but there are {len(uids)} uids; both must be [N]")
    if bad := torch.nonzero(~torch.isfinite(x)).flatten().tolist():
        raise ValueError(f"{what} {x[bad[0]].item()} at position {bad[0]} (uid {uids[bad[0]]!r}) is not finite; "
                         f"{len(bad)} of {len(x)} {what}s are NaN or inf")
    return x


def group_stats(scores, uids, allow_singletons=False, what="score"):
    """The groups of `scores` by uid: x [N] f64 (checked scores), g [N] group numbers, names [G] (the uids as given,
    in order of first appearance) and per group [G] n (size), mean, std (unbiased, two-pass), max, flat (max - min
    <= FLAT), n_top (responses at the max). A group of one raises unless allow_singletons (then flat)."""
    x, uids = as_scores(scores, uids, what), uids.tolist() if hasattr(uids, "tolist") else uids  # a tensor: values
    try:
        index = {}
        g = torch.tensor([index.setdefault(u, len(index)) for u in uids], dtype=torch.long)
    except TypeError:  # unhashable
        raise ValueError(f"uids must be hashable (str or int), got {uids[0]!r}") from None
    names = list(index)
    n = group_reduce(torch.ones_like(x), g, len(names))
    if not allow_singletons and (lonely := [names[i] for i in torch.nonzero(n == 1).flatten().tolist()]):
        raise ValueError(f"{len(lonely)} group(s) have a single response (uid {lonely[0]!r}"
                         f"{', ...' if len(lonely) > 1 else ''}): a group baseline needs n >= 2 responses "
                         f"per prompt (worker.rollout.n), or pass allow_singletons=True to give them advantage 0")
    mean = group_reduce(x, g, len(n)) / n
    std = torch.sqrt(group_reduce((x - mean[g]) ** 2, g, len(n)) / (n - 1).clamp(min=1))
    high = group_reduce(x, g, len(n), "amax")
    flat = high - group_reduce(x, g, len(n), "amin") <= FLAT
    n_top = group_reduce((x == high[g]).double(), g, len(n))  # responses at the group's max
    return types.SimpleNamespace(x=x, g=g, names=names, n=n, mean=mean, std=std, max=high, n_top=n_top, flat=flat)


def group_reduce(x, g, n_groups, reduce="sum"):
    """Per-group sum, max ("amax") or min ("amin") of x [N] -> [G]; g [N] holds group numbers 0..G-1."""
    return torch.zeros(n_groups, dtype=x.dtype).scatter_reduce_(0, g, x, reduce, include_self=False)


def whiten(v, eps):
    """(v - mean(v)) / sqrt(var(v) + eps) (unbiased var), computed in float64, as float32; exactly 0 without spread."""
    if len(v) < 2 or v.max() - v.min() <= FLAT:
        return torch.zeros(len(v))
    return ((v - v.mean()) / torch.sqrt(v.var() + eps)).float()
