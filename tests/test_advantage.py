"""advantage.py: every estimator against hand-computed values or an independent loop over groups
(statistics / numpy), exact zeros for groups without spread, order independence, KL in the reward,
the KL controllers, online filtering and the metrics."""

import math
import re
import random
import statistics

import numpy as np
import pytest
import torch

import advantage
from advantage import compute_advantages

# interleaved on purpose: groups are the uid values, not runs of positions
SCORES = [1.0, 0.2, 0.0, 0.9, 0.0, 0.5, 1.0, 0.3]
UIDS = ["a", "b", "a", "b", "a", "b", "a", "b"]  # groups: a = [1, 0, 0, 1], b = [0.2, 0.9, 0.5, 0.3]


def by_group(scores, uids):
    groups = {}
    for s, u in zip(scores, uids):
        groups.setdefault(u, []).append(s)
    return groups


def reference(name, scores, uids, norm_by_std=True):
    """Independent loop implementation of each estimator (statistics module, plain Python floats)."""
    groups = by_group(scores, uids)
    out = []
    for s, u in zip(scores, uids):
        g = groups[u]
        if max(g) - min(g) <= 1e-6:
            out.append(0.0)
        elif name == "grpo":
            out.append((s - statistics.fmean(g)) / (statistics.stdev(g) + 1e-6 if norm_by_std else 1.0))
        elif name == "rloo":
            out.append(s - (sum(g) - s) / (len(g) - 1))
        elif name == "grpo_passk":
            top, rest = sorted(g)[-1], sorted(g)[-2]
            out.append((top - rest) / (statistics.stdev(g) + 1e-6) if s == top else 0.0)
    return out


def test_grpo_by_hand():
    # group a = [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    # group b = [0.2, 0.9, 0.5, 0.3]: mean 0.475, squared deviations sum 0.2875, std sqrt(0.2875 / 3)
    sb = math.sqrt(0.2875 / 3) + 1e-6
    expected = [a, (0.2 - 0.475) / sb, -a, (0.9 - 0.475) / sb, -a, (0.5 - 0.475) / sb, a, (0.3 - 0.475) / sb]
    got = advantage.grpo(torch.tensor(SCORES), UIDS)
    assert got.dtype == torch.float32
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6, rtol=0)
    assert got[0].item() == pytest.approx(0.866024, abs=1e-6)  # 0.5 / 0.57735...


@pytest.mark.parametrize("name,opts", [("grpo", {}), ("grpo", {"norm_by_std": False}), ("rloo", {}),
                                       ("grpo_passk", {})])
def test_group_estimators_match_a_loop(name, opts):
    rng = random.Random(0)
    uids = [f"p{rng.randrange(6)}" for _ in range(40)]
    scores = [rng.choice([0.0, 0.1, 0.9, 1.0, rng.random()]) for _ in uids]
    for u in set(uids):  # every group needs two members; make one group flat at 0.7
        uids += [u, u]
        scores += [0.7, 0.7] if u == "p0" else [rng.random(), 1.0]
    scores = [0.7 if u == "p0" else s for s, u in zip(scores, uids)]
    got = compute_advantages(name, torch.tensor(scores, dtype=torch.float64), uids, **opts)
    expected = torch.tensor(reference(name, scores, uids, **opts), dtype=torch.float32)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[torch.tensor([u == "p0" for u in uids])], torch.zeros(uids.count("p0")))


def test_dr_grpo_by_hand():
    got = compute_advantages("grpo", [1.0, 0.0, 0.0, 0.5], ["x"] * 4, norm_by_std=False)
    assert torch.allclose(got, torch.tensor([0.625, -0.375, -0.375, 0.125]), atol=1e-7, rtol=0)


def test_norm_by_std_is_for_grpo_only():
    """The trainer passes algorithm.norm_adv_by_std_in_grpo whatever the estimator; only grpo reads it."""
    got = compute_advantages("rloo", [1.0, 0.0], ["x", "x"], norm_by_std=False)
    assert torch.equal(got, torch.tensor([1.0, -1.0]))
    got = compute_advantages("remax", [1.0, 0.0], ["x", "x"], baselines=[0.25, 0.25], norm_by_std=True)
    assert torch.equal(got, torch.tensor([0.75, -0.25]))


@pytest.mark.parametrize("name", ["grpo", "grpo_passk", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flat_groups_are_exactly_zero(name, dtype):
    """0.7 is not dyadic: a float32 pass over 16 copies leaves residue that std + 1e-6 would blow up. The mixed group's
    float64 deviations sum to -1.7e-16, not 0: the batch whitening of REINFORCE++-baseline leaves the flat groups 4e-17
    unless it zeroes them (with [0, 1, 0, 0.5] they summed to exactly 0 and hid that)."""
    scores = torch.tensor([0.7] * 16 + [0.1] * 8 + [0.1, 1.0, 0.0, 0.3], dtype=dtype)
    uids = ["flat"] * 16 + ["low"] * 8 + ["mixed"] * 4
    got = compute_advantages(name, scores, uids)
    assert torch.equal(got[:24], torch.zeros(24))
    assert got[25].item() > 0.5

def test_spread_threshold_is_1e_minus_6():
    """max - min <= 1e-6 counts as no spread (rounding noise), 1e-5 is a real difference."""
    got = advantage.grpo([0.5, 0.5 + 1e-7, 0.5 - 1e-7, 0.5, 0.5 + 1e-5], ["n", "n", "n", "r", "r"])
    assert torch.equal(got[:3], torch.zeros(3))
    assert torch.allclose(got[3:], torch.tensor([-1e-5, 1e-5]) / 2 / (1e-5 / math.sqrt(2) + 1e-6), atol=1e-6, rtol=0)


def test_the_flat_case_is_a_real_trap():
    """Witness: the plain float32 formula on 0.7 x 16 gives advantages of about 0.056, not 0."""
    x = torch.full((16,), 0.7, dtype=torch.float32)
    naive = (x - x.mean()) / (x.std() + 1e-6)
    assert naive.abs().max().item() > 0.01
    assert torch.equal(advantage.grpo(x, ["u"] * 16), torch.zeros(16))


def test_grpo_passk_by_hand():
    # group q = [0.2, 0.8, 0.5]: best 0.8, second 0.5, mean 0.5, unbiased std sqrt(0.18 / 2) = 0.3;
    # group t = [0.9, 0.9, 0.2]: a tie at the top, so nobody gets anything
    got = advantage.grpo_passk([0.2, 0.9, 0.8, 0.9, 0.5, 0.2], ["q", "t", "q", "t", "q", "t"])
    assert torch.allclose(got, torch.tensor([0.0, 0.0, 0.3 / (0.3 + 1e-6), 0.0, 0.0, 0.0]), atol=1e-6, rtol=0)


def test_rloo_by_hand():
    # [1, 0, 0, 1]: each 1 sees a baseline of 1/3, each 0 one of 2/3
    got = advantage.rloo([1.0, 0.0, 0.0, 1.0, 3.0, 5.0], ["a", "a", "a", "a", "b", "b"])
    assert torch.allclose(got, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0]), atol=1e-7, rtol=0)


def test_reinforce_plus_plus_by_hand():
    """EasyR1's REINFORCE++: score on the last token, minus beta * KL per token, reverse returns,
    whitening over all 5 tokens. scores [1, 0], lengths [2, 3], beta 0.1:
    rewards [-0.05, 1.1] and [-0.2, 0, -0.1]; returns [1.05, 1.1] and [-0.3, -0.1, -0.1];
    mean 0.33, squared deviations sum 1.878, unbiased var 0.4695."""
    kl = [torch.tensor([0.5, -1.0]), torch.tensor([2.0, 0.0, 1.0])]
    got = compute_advantages("reinforce_plus_plus", [1.0, 0.0], ["a", "b"], token_kl=kl, kl_coef=0.1)
    std = math.sqrt(0.4695 + 1e-8)
    expected = [[0.72 / std, 0.77 / std], [-0.63 / std, -0.43 / std, -0.43 / std]]
    assert [g.dtype for g in got] == [torch.float32, torch.float32]
    for g, e in zip(got, expected):
        assert torch.allclose(g, torch.tensor(e), atol=1e-6, rtol=0)
    # without KL: returns [1, 1] and [0, 0, 0]; mean 0.4, unbiased var 0.3
    got = compute_advantages("reinforce_plus_plus", [1.0, 0.0], ["a", "b"], lengths=[2, 3])
    assert torch.allclose(torch.cat(got), (torch.tensor([1.0, 1, 0, 0, 0]) - 0.4) / math.sqrt(0.3 + 1e-8), atol=1e-6)
    assert all(torch.equal(g, torch.zeros(n)) for g, n in zip(
        compute_advantages("reinforce_plus_plus", [0.7] * 3, ["u"] * 3, lengths=[4, 1, 2]), [4, 1, 2]))
    with pytest.raises(ValueError, match="one advantage per token: pass lengths"):
        compute_advantages("reinforce_plus_plus", [1.0, 0.0], ["a", "b"])
    with pytest.raises(ValueError, match="response 1: token_kl has 2 values for 3 response tokens"):
        compute_advantages("reinforce_plus_plus", [1.0, 0.0], ["a", "b"], lengths=[2, 3], token_kl=[torch.zeros(2)] * 2)



@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_reinforce_plus_plus_non_finite_kl_is_an_error(bad):
    """A NaN or inf KL estimate (a broken forward pass) would make every token's advantage NaN through the
    batch whitening: an error naming the response instead; the other estimators name the KL sum's position."""
    kl = [torch.tensor([0.1, 0.2]), torch.tensor([0.3, bad, 0.0])]
    with pytest.raises(ValueError, match="response 1: score 0.0 - beta 0.1 \\* token_kl has NaN or inf values"):
        compute_advantages("reinforce_plus_plus", [1.0, 0.0], ["a", "b"], token_kl=kl, kl_coef=0.1)
    with pytest.raises(ValueError, match=f"kl_sums: {bad} at position 1 is not finite"):
        compute_advantages("grpo", [1.0, 0.0], ["a", "a"], token_kl=kl, kl_coef=0.1)


def easyr1_reinforce_plus_plus(scores, lengths, token_kl, beta):
    """EasyR1/veRL's computation on a padded [N, L_max] batch with a response mask (the loop of
    compute_reinforce_plus_plus_outcome_advantage, then masked_whiten), in numpy."""
    n, width = len(scores), max(lengths)
    mask = np.zeros((n, width))
    rewards = np.zeros((n, width))
    for i, (s, m, k) in enumerate(zip(scores, lengths, token_kl)):
        mask[i, :m] = 1
        rewards[i, m - 1] = s
        rewards[i, :m] -= beta * np.asarray(k)
    returns, running = np.zeros_like(rewards), np.zeros(n)
    for t in reversed(range(width)):
        running = rewards[:, t] + running
        returns[:, t] = running
        running = running * mask[:, t]
    mean = (returns * mask).sum() / mask.sum()
    var = ((returns - mean) ** 2 * mask).sum() / mask.sum() * mask.sum() / (mask.sum() - 1)
    adv = (returns - mean) / np.sqrt(var + 1e-8)
    return [adv[i, :m] for i, m in enumerate(lengths)]


def test_reinforce_plus_plus_matches_easyr1_padded():
    rng = np.random.default_rng(0)
    lengths = [int(m) for m in rng.integers(1, 9, size=12)]
    scores = rng.choice([0.0, 0.1, 1.0], size=12)
    kl = [rng.normal(0, 0.3, size=m) for m in lengths]
    got = compute_advantages("reinforce_plus_plus", scores, list(range(12)), token_kl=[torch.tensor(k) for k in kl],
                             kl_coef=0.05)
    for g, e in zip(got, easyr1_reinforce_plus_plus(scores, lengths, kl, 0.05)):
        assert np.allclose(g.numpy(), e, atol=1e-5, rtol=0)


def test_reinforce_plus_plus_baseline_against_numpy():
    scores = np.array([0.3, 1.0, 0.0, 0.25, 0.9, 0.9, 0.5, 0.0])
    uids = ["a", "a", "b", "b", "c", "c", "a", "b"]
    means = {u: np.mean([s for s, v in zip(scores, uids) if v == u]) for u in set(uids)}
    centred = np.array([s - means[u] for s, u in zip(scores, uids)])
    centred[[4, 5]] = 0.0  # group c has no spread
    expected = (centred - centred.mean()) / np.sqrt(centred.var(ddof=1) + 1e-8)
    expected[[4, 5]] = 0.0
    got = advantage.reinforce_plus_plus_baseline(torch.tensor(scores), uids)
    assert np.allclose(got.numpy(), expected, atol=1e-6, rtol=0)


def test_remax_by_hand_and_baseline_checks():
    got = compute_advantages("remax", [1.0, 0.0, 0.5, 0.0], ["a", "a", "b", "b"], baselines=[0.5, 0.5, 1.0, 1.0])
    assert torch.equal(got, torch.tensor([0.5, -0.5, -0.5, -1.0]))
    with pytest.raises(ValueError, match="uid='b'"):
        advantage.remax([1.0, 0.0, 0.5, 0.0], ["a", "a", "b", "b"], [0.5, 0.5, 1.0, 0.0])
    with pytest.raises(ValueError, match="remax needs baselines"):
        compute_advantages("remax", [1.0, 0.0], ["a", "a"])


@pytest.mark.parametrize("name", sorted(set(advantage.ESTIMATORS) - advantage.TOKEN_LEVEL))
def test_permuting_the_batch_permutes_the_result(name):
    gen = torch.Generator().manual_seed(1)
    uids = [f"prompt-{i // 5}" for i in range(30)]
    scores = torch.rand(30, generator=gen, dtype=torch.float64)
    scores[10:15] = 0.7  # one flat group
    baselines = torch.tensor([float(i // 5) / 6 for i in range(30)])
    opts = {"baselines": baselines} if name == "remax" else {}
    full = compute_advantages(name, scores, uids, **opts)
    perm = torch.randperm(30, generator=gen)
    opts = {"baselines": baselines[perm]} if name == "remax" else {}
    permuted = compute_advantages(name, scores[perm], [uids[i] for i in perm], **opts)
    assert torch.allclose(permuted, full[perm], atol=1e-6, rtol=0)
    assert full.abs().sum() > 1.0  # not trivially zero


def test_singleton_groups():
    with pytest.raises(ValueError, match="uid 'lonely'.*worker.rollout.n"):
        advantage.grpo([1.0, 0.0, 0.5], ["g", "g", "lonely"])
    got = advantage.grpo([1.0, 0.0, 0.5], ["g", "g", "lonely"], allow_singletons=True)
    assert got[2].item() == 0.0 and got[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), abs=1e-6)


def test_integer_uids_and_bad_inputs():
    assert torch.equal(advantage.rloo([2.0, 0.0, 1.0, 1.0], [7, 7, 3, 3]), torch.tensor([2.0, -2.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'"):
        compute_advantages("gae", [1.0, 0.0], ["a", "a"])
    with pytest.raises(ValueError, match="at position 1 \\(uid 'a'\\) is not finite"):
        compute_advantages("grpo", [1.0, float("nan")], ["a", "a"])
    with pytest.raises(ValueError, match="there are 3 uids"):
        compute_advantages("grpo", [1.0, 0.0], ["a", "a", "a"])
    with pytest.raises(ValueError, match="only used by remax"):
        compute_advantages("grpo", [1.0, 0.0], ["a", "a"], baselines=[0.0, 0.0])


# ---------------------------------------------------------------------------------------------------
# KL in the reward and the controllers.

def test_kl_in_reward_by_hand():
    got = advantage.kl_in_reward(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([2.0, -1.0, 0.0]), beta=0.1)
    assert got.dtype == torch.float64
    assert torch.allclose(got, torch.tensor([0.8, 0.1, 0.5], dtype=torch.float64), atol=1e-7, rtol=0)
    assert advantage.kl_in_reward([0.3], [0.1], beta=2.0).item() == pytest.approx(0.1, abs=1e-15)
    with pytest.raises(ValueError, match="must both be \\[N\\]"):
        advantage.kl_in_reward(torch.zeros(3), torch.zeros(4), 0.1)


def test_kl_in_reward_sign_coefficient_and_order():
    """KL in the reward, from log-probs: kl = old - ref (k1, EasyR1's compute_kl(old, ref)), subtracted
    times beta. Old -1.0 / ref -1.5 gives kl +0.5, so the reward falls by beta * 0.5 on that token."""
    import actor
    old, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    kl = actor.kl_penalty(old, ref, "kl")                           # [0.5, -1.0]
    got = advantage.token_rewards([1.0], [2], [kl], beta=0.2)
    assert torch.allclose(got[0], torch.tensor([-0.1, 1.0 + 0.2], dtype=torch.float64), atol=1e-7, rtol=0)
    # the outcome estimators see score - beta * sum(kl): here 1 - 0.2 * (-0.5) = 1.1 against a baseline of 1
    got = compute_advantages("remax", [1.0], ["p"], baselines=[1.0], token_kl=[kl], kl_coef=0.2)
    assert got.item() == pytest.approx(0.1, abs=1e-6)


def test_remax_baselines_with_kl_by_hand():
    """ReMax: the greedy response's raw score is the baseline of every response of its prompt; the
    sampled responses carry score - beta * sum(kl): [1 - 0.05, 0 - 0.1, 0.5, 0.5 + 0.2] - [0.5, 0.5, 1, 1]."""
    kl = [torch.tensor([0.2, 0.3]), torch.tensor([1.0]), torch.zeros(3), torch.tensor([-2.0])]
    got = compute_advantages("remax", [1.0, 0.0, 0.5, 0.5], ["a", "a", "b", "b"], baselines=[0.5, 0.5, 1.0, 1.0],
                             token_kl=kl, kl_coef=0.1)
    assert torch.allclose(got, torch.tensor([0.45, -0.6, -0.5, -0.3]), atol=1e-6, rtol=0)


def test_kl_controllers_by_hand():
    fixed = advantage.FixedKLController(0.05)
    fixed.update(current_kl=3.0, n_steps=512)
    assert fixed.value == 0.05
    ctl = advantage.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=1000)
    ctl.update(current_kl=0.15, n_steps=100)          # error 0.5 clipped to 0.2: beta * (1 + 0.2 * 0.1)
    assert ctl.value == pytest.approx(0.102, abs=1e-12)
    ctl.update(current_kl=0.09, n_steps=100)          # error -0.1: beta * (1 - 0.01)
    assert ctl.value == pytest.approx(0.102 * 0.99, abs=1e-12)
    ctl.update(current_kl=torch.tensor(0.0), n_steps=500)   # error -1 clipped to -0.2: beta * (1 - 0.1)
    assert ctl.value == pytest.approx(0.102 * 0.99 * 0.9, abs=1e-12)


# ---------------------------------------------------------------------------------------------------
# Online filtering and metrics.

def test_groups_to_keep():
    # fw: all wrong but formatted (0.1 each); m: mean 2/3; m2: mean 1/2; w: all wrong; mid: flat at 0.5;
    # edge: mean exactly at the lower bound (bounds are exclusive)
    uids = ["fw", "fw", "fw", "m", "m", "m", "m2", "m2", "w", "w", "mid", "mid", "mid", "edge", "edge"]
    values = [0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.01, 0.01]
    assert advantage.groups_to_keep(values, uids, 0.01, 0.99, spread=values) == {"m", "m2"}
    assert advantage.groups_to_keep(values, uids, 0.01, 0.99) == {"fw", "m", "m2", "mid"}
    assert advantage.groups_to_keep(values, uids, 0.6, 0.7, spread=values) == {"m"}       # mean 2/3
    assert advantage.groups_to_keep([1.0, 0.0], ["solo", "solo2"], 0.0, 1.0) == set()


def test_groups_to_keep_tests_the_spread_of_the_scores_the_advantages_use():
    """filter_key (here accuracy) sets the mean test, the overall score the spread test: a group whose accuracy
    is flat at 0.5 but whose overall scores differ has non-zero GRPO advantages and is kept; one whose accuracy
    differs but whose overall scores are flat trains on nothing and goes."""
    uids = ["a", "a", "b", "b"]
    accuracy, overall = [0.5, 0.5, 0.0, 1.0], [0.4, 0.6, 0.5, 0.5]
    assert advantage.groups_to_keep(accuracy, uids, 0.01, 0.99, spread=overall) == {"a"}
    assert [float(x) for x in compute_advantages("grpo", overall, uids)[2:]] == [0.0, 0.0]


@pytest.mark.parametrize("name", sorted(advantage.ESTIMATORS))
def test_online_filtering_drops_flat_groups_only_where_their_advantage_is_zero(name):
    """ZERO_WHEN_FLAT is the rule online filtering uses: exactly the estimators that give a group without
    spread all-zero advantages. REINFORCE++ (batch whitening) and ReMax (greedy baseline) train on it."""
    uids = ["flat", "flat", "m", "m", "w", "w", "hi", "hi"]
    values = [0.5, 0.5, 1.0, 0.0, 0.0, 0.0, 1.0, 0.9]
    opts = {"baselines": [0.0] * 2 + [0.5] * 2 + [0.0] * 2 + [1.0] * 2} if name == "remax" else {}
    opts |= {"lengths": [3] * 8} if name in advantage.TOKEN_LEVEL else {}
    adv = compute_advantages(name, values, uids, **opts)
    flat_is_zero = all(float(torch.as_tensor(a).abs().max()) == 0.0 for a in adv[:2])
    assert flat_is_zero == (name in advantage.ZERO_WHEN_FLAT)
    spread = values if name in advantage.ZERO_WHEN_FLAT else None
    kept = advantage.groups_to_keep(values, uids, 0.01, 0.99, spread=spread)
    # means: flat 0.5, m 0.5, w 0 (out), hi 0.95
    assert kept == ({"m", "hi"} if name in advantage.ZERO_WHEN_FLAT else {"flat", "m", "hi"})


def test_online_filtering_for_pass_at_k_drops_a_group_whose_top_score_is_shared():
    """grpo_passk pushes up a group's one best response: a group of 1, 1, 0 (top shared) gets all-zero advantages
    though it has spread, and filtering kept it; 1, 0, 0 trains and stays."""
    uids, values = ["tie"] * 3 + ["one"] * 3, [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert [float(a) for a in compute_advantages("grpo_passk", values, uids)[:3]] == [0.0, 0.0, 0.0]
    assert advantage.groups_to_keep(values, uids, 0.01, 0.99, spread=values, unique_top=True) == {"one"}
    assert advantage.groups_to_keep(values, uids, 0.01, 0.99, spread=values) == {"tie", "one"}  # grpo's rule


def test_advantage_metrics_over_tokens():
    got = advantage.advantage_metrics([1.0, 0.0], [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-6.0])], ["a", "b"])
    assert (got["critic/advantages/mean"], got["critic/advantages/max"],
            got["critic/advantages/min"]) == (0.0, 3.0, -6.0)


def test_advantage_metrics_by_hand():
    scores = [1.0, 0.0, 0.7, 0.7, 0.5, 0.5]
    uids = ["a", "a", "b", "b", "c", "c"]
    adv = advantage.grpo(scores, uids)
    got = advantage.advantage_metrics(scores, adv, uids)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert got == pytest.approx({
        "critic/score/mean": 3.4 / 6, "critic/score/max": 1.0, "critic/score/min": 0.0,
        "critic/advantages/mean": 0.0, "critic/advantages/max": a, "critic/advantages/min": -a,
        "adv/zero_std_group_frac": 2 / 3,
    }, abs=1e-6)


def test_whitening_adds_eps_to_the_variance_not_the_std():
    """sqrt(var + 1e-8), not sqrt(var) + 1e-8: they differ once var is near eps. Returns [1e-5] and [0]:
    mean 5e-6, unbiased var 2 * (5e-6)^2 / 1 = 5e-11, so A = +-5e-6 / sqrt(5e-11 + 1e-8) = +-0.04988
    (sqrt(5e-11) + 1e-8 would give +-0.7061)."""
    got = compute_advantages("reinforce_plus_plus", [1e-5, 0.0], ["a", "b"], lengths=[1, 1])
    a = 5e-6 / math.sqrt(5e-11 + 1e-8)
    assert a == pytest.approx(0.04988, abs=1e-5)
    assert torch.allclose(torch.cat(got), torch.tensor([a, -a]), atol=1e-6, rtol=0)
    # the group baseline variant whitens c = [-5e-6, 5e-6, 0, 0] (group b flat): var 5e-11 / 3
    got = advantage.reinforce_plus_plus_baseline([0.0, 1e-5, 0.3, 0.3], ["a", "a", "b", "b"])
    b = 5e-6 / math.sqrt(5e-11 / 3 + 1e-8)
    assert torch.allclose(got, torch.tensor([-b, b, 0.0, 0.0]), atol=1e-6, rtol=0)


def test_spread_of_exactly_1e_minus_6_is_flat():
    """The rule is max - min <= FLAT (inclusive): [0, 1e-6] is flat; a strict < would give it +-0.29."""
    got = advantage.grpo([0.0, 1e-6, 0.0, 1.0], ["f", "f", "r", "r"])
    assert torch.equal(got[:2], torch.zeros(2))
    assert advantage.groups_to_keep([0.0, 1e-6, 0.0, 1.0], ["f", "f", "r", "r"], -1.0, 2.0,
                                    spread=[0.0, 1e-6, 0.0, 1.0]) == {"r"}


def test_advantage_metrics_weigh_responses_for_scores_and_groups_for_the_flat_fraction():
    """Unequal groups: f = 4 responses flat at 0.5, m = [1.0, 0.4]. Score mean over the 6 responses:
    (4 * 0.5 + 1.4) / 6 = 0.5667 (the mean of group means would be 0.6); flat fraction over the 2 groups:
    1/2 (over responses it would be 4/6)."""
    uids = ["f", "m", "f", "f", "m", "f"]
    scores = [0.5, 1.0, 0.5, 0.5, 0.4, 0.5]
    got = advantage.advantage_metrics(scores, [0.0, 0.7, 0.0, 0.0, -0.7, 0.0], uids)
    assert got == pytest.approx({
        "critic/score/mean": 3.4 / 6, "critic/score/max": 1.0, "critic/score/min": 0.4,
        "critic/advantages/mean": 0.0, "critic/advantages/max": 0.7, "critic/advantages/min": -0.7,
        "adv/zero_std_group_frac": 0.5,
    }, abs=1e-9)


def test_token_level_advantages_do_not_carry_the_kl_graph():
    """token_kl straight from a forward pass (requires grad) must not make the advantages differentiable:
    the policy gradient would then flow into the KL through A. Values as by hand: beta 0.5, kl [0.2, 0.4]
    and [0.6]: rewards [-0.1, 0.8], [-0.3]; returns [0.7, 0.8, -0.3], mean 0.4, unbiased var 0.37."""
    kl = [torch.tensor([0.2, 0.4], requires_grad=True), torch.tensor([0.6], requires_grad=True)]
    got = compute_advantages("reinforce_plus_plus", [1.0, 0.0], ["a", "b"], token_kl=kl, kl_coef=0.5)
    assert not any(g.requires_grad for g in got)
    std = math.sqrt(0.37 + 1e-8)
    assert torch.allclose(torch.cat(got), torch.tensor([0.3 / std, 0.4 / std, -0.7 / std]), atol=1e-6, rtol=0)


def test_uids_group_by_the_callers_own_values_and_come_back_as_given():
    """Groups are the uid values as the caller's Python objects: int 5 and str "5" are two groups (numpy's unique
    made one of them), a tensor of uids groups by value, tuples and None work, and groups_to_keep returns the
    caller's own uids (it returned numpy's str or int conversions, so `5 in keep` could be False)."""
    got = advantage.rloo([2.0, 0.0, 1.0, 3.0], [5, 5, "5", "5"])
    assert torch.equal(got, torch.tensor([2.0, -2.0, -2.0, 2.0]))
    assert torch.equal(advantage.rloo([2.0, 0.0, 1.0, 3.0], torch.tensor([7, 7, 3, 3])), got)
    assert advantage.groups_to_keep([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [5, 5, "a", "a", (1, 2), (1, 2)],
                                    low=0.01, high=0.99) == {5}
    assert advantage.groups_to_keep([1.0, 0.0, 1.0, 1.0], [None, None, "b", "b"], low=0.01, high=0.99) == {None}
    with pytest.raises(ValueError, match=r"uids must be hashable \(str or int\), got \['a'\]"):
        advantage.grpo([1.0, 0.0], [["a"], ["a"]])


def test_kl_inputs_that_would_pass_silently_are_errors():
    """A padded [N, L] token_kl (EasyR1's layout) would count its padding as response tokens in REINFORCE++, and a
    NaN KL was blamed on the scores; both now say what is wrong."""
    for name in ("reinforce_plus_plus", "grpo", "rloo"):  # grpo and rloo summed the padding into the KL penalty
        with pytest.raises(ValueError, match=r"token_kl: a list of N tensors \[L_i\]"):
            compute_advantages(name, [1.0, 0.0], ["a", "a"], token_kl=torch.ones(2, 3), kl_coef=0.1)
    with pytest.raises(ValueError, match=r"kl_sums: nan at position 0 is not finite"):
        compute_advantages("grpo", [1.0, 0.0], ["a", "a"], token_kl=[torch.tensor([float("nan")]), torch.ones(1)],
                           kl_coef=0.1)


def test_a_padded_token_kl_is_an_error_for_a_per_response_estimator_even_with_lengths():
    """lengths are read by REINFORCE++ alone: grpo given a padded [N, L] token_kl and lengths [1, 2] would sum
    the 3 values of each row, padding included (kl 3 and 3, not 1 and 2), so it refuses as without lengths."""
    with pytest.raises(ValueError, match=r"token_kl: a list of N tensors \[L_i\]"):
        compute_advantages("grpo", [1.0, 0.0], ["a", "a"], token_kl=torch.ones(2, 3), kl_coef=0.1, lengths=[1, 2])


@pytest.mark.parametrize("args, update, match", [
    ((0.1, 0.0, 1e4), None, "target_kl=0.0 and horizon=10000.0 must be > 0"),
    ((0.1, 6.0, 100), (0.0, 1000), "n_steps=1000 must be below 5 x horizon = 500"),
    ((0.1, 6.0, 100), (0.0, 500), "n_steps=500 must be below 5 x horizon = 500"),  # beta x (1 - 0.2 x 5) = 0
    ((0.1, 6.0, 1e4), (float("nan"), 256), "current_kl=nan must be finite")])
def test_adaptive_kl_controller_refuses_what_would_zero_divide_flip_or_poison_beta(args, update, match):
    """Target 0 divided by zero; n_steps > 5 x horizon turned beta negative (the KL a bonus); a NaN KL made beta NaN
    for good. config.py checks the first two for the trainer; the controller itself, for a copy of this module."""
    with pytest.raises(ValueError, match=re.escape(match)):
        advantage.AdaptiveKLController(*args).update(*update)


def test_grpo_std_is_two_pass_far_from_zero_and_scores_carry_no_graph():
    """Scores 1e8 + [0, 1, 2, 3]: mean 1e8 + 1.5, unbiased std sqrt(5/3), so A = [-1.5, -0.5, 0.5, 1.5] / sqrt(5/3)
    = +-1.161895, +-0.387298 (a one-pass sum x^2 - n mean^2 cancels to a wrong variance at that offset). Scores
    that carry a gradient (a learned reward) give advantages that carry none."""
    got = advantage.grpo(torch.tensor([1e8, 1e8 + 1, 1e8 + 2, 1e8 + 3], dtype=torch.float64), ["a"] * 4)
    assert torch.allclose(got, torch.tensor([-1.161895, -0.387298, 0.387298, 1.161895]), atol=1e-5, rtol=0)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25], requires_grad=True)
    assert not compute_advantages("grpo", scores, ["a", "a", "b", "b"]).requires_grad


# ---------------------------------------------------------------------------------------------------
# Edges found by mutation testing: near ties, malformed shapes and lengths, early errors.

def test_grpo_passk_a_near_tie_at_the_top_is_not_a_tie():
    """[1.0, 0.9995, 0.0]: only an exact tie at the top zeroes the group; here the best response gets
    (1.0 - 0.9995) / (std + 1e-6), std = sqrt(((1 - m)^2 + (0.9995 - m)^2 + m^2) / 2), m = 1.9995 / 3."""
    m = 1.9995 / 3
    std = math.sqrt(((1.0 - m) ** 2 + (0.9995 - m) ** 2 + m ** 2) / 2)
    got = advantage.grpo_passk([1.0, 0.9995, 0.0], ["q"] * 3)
    assert torch.allclose(got, torch.tensor([0.0005 / (std + 1e-6), 0.0, 0.0]), atol=1e-7, rtol=0)
    assert got[0].item() > 1e-4


def test_scores_of_shape_n_by_1_are_an_error_not_a_broadcast():
    with pytest.raises(ValueError, match=r"scores have shape \(4, 1\) but there are 4 uids"):
        compute_advantages("grpo", torch.tensor([[1.0], [0.0], [1.0], [0.5]]), ["a", "a", "b", "b"])
    with pytest.raises(ValueError, match=r"must both be \[N\]"):
        advantage.kl_in_reward(torch.zeros(2, 1), torch.zeros(2, 1), 0.1)


def test_remax_names_a_non_finite_baseline_as_a_baseline():
    with pytest.raises(ValueError, match=r"baseline nan at position 1 \(uid 'a'\) is not finite"):
        compute_advantages("remax", [1.0, 0.0], ["a", "a"], baselines=[0.5, float("nan")])


def test_token_rewards_check_every_length():
    """An empty response, a token_kl longer than its response and one token_kl too many are errors naming what is
    wrong (an IndexError, a silently truncated or ignored KL otherwise)."""
    with pytest.raises(ValueError, match="response 1 has length 0; every response needs at least one token"):
        advantage.token_rewards([1.0, 0.0], [2, 0])
    with pytest.raises(ValueError, match="response 1: token_kl has 4 values for 3 response tokens"):
        compute_advantages("reinforce_plus_plus", [1.0, 0.0], ["a", "b"], lengths=[2, 3],
                           token_kl=[torch.zeros(2), torch.zeros(4)], kl_coef=0.1)
    with pytest.raises(ValueError, match="2 scores, 2 lengths and 3 token_kl: one of each per response"):
        advantage.token_rewards([1.0, 0.0], [1, 1], [torch.zeros(1)] * 3, beta=0.1)


def test_adaptive_kl_controller_refuses_a_zero_horizon_when_built():
    with pytest.raises(ValueError, match=re.escape("target_kl=6.0 and horizon=0 must be > 0")):
        advantage.AdaptiveKLController(0.1, 6.0, 0)


def test_second_mutation_pass_edges_negative_scores_near_flat_groups_inf_and_the_limits():
    """grpo_passk with every other score negative (DAPO's -1): second best -1, mean -0.5, unbiased std
    sqrt((2.25 + 3 x 0.25) / 3) = 1, so the top gets (1 - (-1)) / (1 + 1e-6); a unique top 5e-7 above the rest is a
    flat group (spread <= 1e-6): 0. An inf score is refused like NaN. The adaptive controller takes n_steps just
    below 5 x horizon: 450 at horizon 100 with KL 0 gives beta x (1 - 0.2 x 4.5). REINFORCE++ whitening of a batch
    whose spread is exactly 1e-6 gives 0."""
    got = advantage.grpo_passk([1.0, -1.0, -1.0, -1.0], ["q"] * 4)
    assert torch.allclose(got, torch.tensor([2 / (1 + 1e-6), 0.0, 0.0, 0.0]), atol=1e-6, rtol=0)
    assert torch.equal(advantage.grpo_passk([1.0, 1.0 - 5e-7], ["q"] * 2), torch.zeros(2))
    with pytest.raises(ValueError, match=r"score inf at position 1 \(uid 'a'\) is not finite"):
        compute_advantages("grpo", [1.0, math.inf], ["a", "a"])
    ctl = advantage.AdaptiveKLController(0.1, 6.0, 100)
    ctl.update(0.0, 450)
    assert ctl.value == pytest.approx(0.01, abs=1e-15)
    flat = compute_advantages("reinforce_plus_plus", [1e-6, 0.0], ["a", "b"], lengths=[1, 1])
    assert [a.tolist() for a in flat] == [[0.0], [0.0]]
