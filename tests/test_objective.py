"""The objective (policy losses, aggregation, KL) against formulas restated here, token by token in
plain Python floats, or against numbers worked out by hand. Values and gradients; then the actor's objective
settings (KL kind, aggregation, clipping) reaching its update on the toy."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from actor import aggregate_loss, kl_penalty, policy_loss  # noqa: E402
from test_actor_update import samples  # noqa: E402,F401  (the fixture: 4 samples of the toy VL model)

LOW, HIGH, DUAL = 0.2, 0.3, 3.0
RTOL, ATOL = 1e-5, 1e-6  # the objective computes in fp32; the references are float64


# ----------------------------------------------------------------------------------------------
# Independent references: one token at a time, by cases (no max/min of two losses as in the code).
# ----------------------------------------------------------------------------------------------

def ref_ppo_token(log_ratio, a, low=LOW, high=HIGH, dual=DUAL):
    """(loss, d loss / d log r) of dual-clip PPO for one token, written out case by case."""
    inside = -20.0 < log_ratio < 20.0
    r = math.exp(min(max(log_ratio, -20.0), 20.0))
    slope = -a * r if inside else 0.0
    if a >= 0:
        if r <= 1 + high:  # below the upper bound: no clip (pessimism keeps r < 1 - low unclipped)
            return -a * r, slope
        return -a * (1 + high), 0.0
    if r <= 1 - low:  # A < 0 and r below the lower bound: clipped to the constant -A (1 - low)
        return -a * (1 - low), 0.0
    if r < dual:
        return -a * r, slope
    return -a * dual, 0.0  # the dual clip binds


def ref_sapo_token(log_ratio, a, tau_pos=1.0, tau_neg=1.05):
    tau = tau_pos if a >= 0 else tau_neg
    r = math.exp(min(max(log_ratio, -20.0), 20.0))
    s = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
    return -a * (4.0 / tau) * s, -a * 4.0 * s * (1.0 - s) * r  # d/dlog r of (4/tau) sigma(tau (r - 1))


def run(loss_type, logp, old, adv, cu, weights=None, **kw):
    """policy_loss on float64 lists; backward of sum_t weights_t * loss_t. -> (loss, grad, metrics) as lists."""
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    if kw.get("rollout_logp") is not None and not torch.is_tensor(kw["rollout_logp"]):
        kw["rollout_logp"] = torch.tensor(kw["rollout_logp"], dtype=torch.float64)
    loss, metrics = policy_loss(lp, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
                                torch.tensor(cu, dtype=torch.int32), loss_type=loss_type, **kw)
    assert loss.shape == lp.shape and loss.dtype == torch.float32
    w = torch.ones(len(logp), dtype=torch.float64) if weights is None else torch.tensor(weights, dtype=torch.float64)
    (loss * w).sum().backward()
    for name, m in metrics.items():
        assert m.shape == lp.shape and not m.requires_grad, name
    return loss.detach().double().tolist(), lp.grad.tolist(), {k: v.double().tolist() for k, v in metrics.items()}


def close(got, want, rtol=RTOL, atol=ATOL):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g, w, rel_tol=rtol, abs_tol=atol), \
            f"token {i}: got {g}, want {w}\n got  {got}\n want {want}"


def single_token_cu(n):
    return list(range(n + 1))


# One token per regime: A > 0 below / inside / above the clip; A < 0 below / inside / between the
# clip and the dual bound / above the dual bound; A = 0.
RATIOS = [0.5, 0.9, 1.2, 1.5, 0.5, 0.9, 1.2, 2.0, 4.0, 1.1]
ADVS = [1.5, 1.5, 1.5, 1.5, -0.7, -0.7, -0.7, -0.7, -0.7, 0.0]
WEIGHTS = [0.3, 1.7, 0.9, 1.1, 0.5, 1.3, 0.8, 2.1, 0.6, 1.4]


def regime_batch():
    old = [-1.0 - 0.1 * i for i in range(len(RATIOS))]
    logp = [o + math.log(r) for o, r in zip(old, RATIOS)]
    return logp, old


# ----------------------------------------------------------------------------------------------
# default (PPO clip, clip-higher, dual clip)
# ----------------------------------------------------------------------------------------------

def test_default_values_gradients_and_metrics_per_regime():
    logp, old = regime_batch()
    loss, grad, m = run("default", logp, old, ADVS, single_token_cu(len(logp)), WEIGHTS)
    want = [ref_ppo_token(lp - o, a) for lp, o, a in zip(logp, old, ADVS)]
    close(loss, [v for v, _ in want])
    close(grad, [w * s for w, (_, s) in zip(WEIGHTS, want)])  # d log r / d logp = 1
    # By hand: A=1.5, r=1.5 -> -1.5 * 1.3; A=-0.7, r=0.5 -> 0.7 * 0.8; r=2.0 -> 0.7 * 2; r=4 -> 0.7 * 3.
    close([loss[3], loss[4], loss[7], loss[8]], [-1.95, 0.56, 1.4, 2.1])
    assert [grad[i] == 0.0 for i in range(10)] == [False, False, False, True, True, False, False, False, True, True]
    assert m["pg_clipfrac_higher"] == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]  # upper clip only, A > 0
    assert m["pg_clipfrac_lower"] == [0, 0, 0, 0, 0, 0, 0, 0, 1, 0]  # dual clip only, A < 0
    close(m["ppo_kl"], [o - lp for lp, o in zip(logp, old)])


@pytest.mark.parametrize("bound,a,metric", [(1 + HIGH, 1.0, "pg_clipfrac_higher"), (1 - LOW, -1.0, None),
                                            (DUAL, -1.0, "pg_clipfrac_lower")])
def test_clip_boundaries(bound, a, metric):
    """Just inside a bound the token has a gradient; just outside it has none (and is counted)."""
    eps = 1e-3
    inside, outside = (bound - eps, bound + eps) if bound > 1 else (bound + eps, bound - eps)
    logp = [math.log(inside), math.log(outside)]
    loss, grad, m = run("default", logp, [0.0, 0.0], [a, a], [0, 1, 2])
    close(grad, [-a * inside, 0.0])
    close(loss, [-a * inside, -a * bound])
    for name in ("pg_clipfrac_higher", "pg_clipfrac_lower"):
        assert m[name] == ([0.0, 1.0] if name == metric else [0.0, 0.0]), name


def test_clip_higher_is_asymmetric():
    """eps_low 0.2 / eps_high 0.3: r = 1.25 with A > 0 is not clipped (it would be with a symmetric 0.2)."""
    loss, grad, m = run("default", [math.log(1.25)], [0.0], [1.0], [0, 1])
    close(loss, [-1.25])
    close(grad, [-1.25])
    assert m["pg_clipfrac_higher"] == [0.0]
    loss, grad, m = run("default", [math.log(1.25)], [0.0], [1.0], [0, 1], clip_ratio_high=0.2)
    close(loss, [-1.2])
    close(grad, [0.0])
    assert m["pg_clipfrac_higher"] == [1.0]


def test_dual_clip_must_exceed_one():
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="clip_ratio_dual must be > 1"):
            run("default", [0.0], [0.0], [1.0], [0, 1], clip_ratio_dual=c)
    run("sapo", [0.0], [0.0], [1.0], [0, 1], clip_ratio_dual=1.0)  # not used by sapo: no error


def test_sapo_temperatures_must_be_positive():
    """(4 / tau) sigma(tau (r - 1)) at tau = 0 is inf (NaN where A = 0): every gradient NaN, every optimizer step
    skipped without naming the cause; a negative tau gives the gradient of |tau| under a loss shifted by 4 A / |tau|.
    Refused as tis_cap <= 0 is; the other loss types ignore the temperatures."""
    for tau in ({"tau_positive": 0.0}, {"tau_negative": 0.0}, {"tau_negative": -1.05}):
        with pytest.raises(ValueError, match=r"sapo's tau_positive=.* and tau_negative=.* must be > 0"):
            run("sapo", [0.0, -1.0], [0.0, -1.2], [1.0, -1.0], [0, 2], **tau)
    run("default", [0.0], [0.0], [1.0], [0, 1], tau_positive=0.0, tau_negative=0.0)  # not used: no error


@pytest.mark.parametrize("loss_type", ["default", "gspo", "gspo_token", "cispo", "sapo"])
def test_ratio_clamp_keeps_everything_finite(loss_type):
    """log r = +-50, +-1000 would overflow exp in fp32; the clamp at +-20 keeps loss and gradient finite."""
    deltas = [50.0, -50.0, 1000.0, -1000.0, 50.0, -50.0]
    advs = [1.0, 1.0, -1.0, -1.0, -1.0, 0.5]
    old = [-3.0] * 6
    logp = [o + d for o, d in zip(old, deltas)]
    loss, grad, _ = run(loss_type, logp, old, advs, single_token_cu(6))
    assert all(math.isfinite(x) for x in loss + grad), (loss, grad)
    if loss_type in ("default", "gspo", "gspo_token"):  # single-token sequences: s_i = delta_t
        close(loss, [ref_ppo_token(d, a)[0] for d, a in zip(deltas, advs)])
        close(loss[:3], [-1.3, -math.exp(-20.0), 3.0], atol=0.0)  # r = e^-20 exactly: the clamp bound
        close(grad, [0.0] * 6)  # every token is clipped or outside the clamp
    if loss_type == "sapo":
        close(loss, [ref_sapo_token(d, a)[0] for d, a in zip(deltas, advs)])
        close(grad, [0.0] * 6)


# ----------------------------------------------------------------------------------------------
# gspo, gspo_token, cispo, sapo: values, and gradients derived by hand
# ----------------------------------------------------------------------------------------------

# Four sequences (lengths 1, 3, 4, 2) whose sequence log-ratios fall in different regimes.
SEQ_DELTAS = [[math.log(1.5)], [0.1, -0.3, 0.05], [0.5, 0.9, 1.3, 2.0], [0.6, -0.4]]
SEQ_ADVS = [1.0, -1.0, -0.5, 2.0]
SEQ_WEIGHTS = [0.7, 0.2, 1.5, 0.9, 0.4, 1.1, 2.0, 0.3, 1.6, 0.8]


def seq_batch():
    cu = [0]
    logp, old, adv, seq_of = [], [], [], []
    for i, (deltas, a) in enumerate(zip(SEQ_DELTAS, SEQ_ADVS)):
        for j, d in enumerate(deltas):
            old.append(-0.5 - 0.3 * j - 0.1 * i)
            logp.append(old[-1] + d)
            adv.append(a)
            seq_of.append(i)
        cu.append(len(logp))
    return logp, old, adv, cu, seq_of


def test_gspo_sequence_ratio_gradient_through_the_mean():
    """s_i = mean_t delta_t; l_t = PPO(exp(s_i)). d(sum_t w_t l_t)/d logp_t = mean_{t' in i}(w_t') * PPO'(s_i)."""
    logp, old, adv, cu, seq_of = seq_batch()
    loss, grad, m = run("gspo", logp, old, adv, cu, SEQ_WEIGHTS)
    s = [sum(d) / len(d) for d in SEQ_DELTAS]
    ref = [ref_ppo_token(s[i], SEQ_ADVS[i]) for i in range(len(s))]
    close(loss, [ref[i][0] for i in seq_of])
    mean_w = [sum(SEQ_WEIGHTS[cu[i]:cu[i + 1]]) / (cu[i + 1] - cu[i]) for i in range(len(s))]
    close(grad, [mean_w[i] * ref[i][1] for i in seq_of])
    # Sequence 0 (r = 1.5, A > 0) is upper-clipped; sequence 2 (r = e^1.175 = 3.24, A < 0) hits the dual clip.
    assert m["pg_clipfrac_higher"] == [1.0 if i == 0 else 0.0 for i in seq_of]
    assert m["pg_clipfrac_lower"] == [1.0 if i == 2 else 0.0 for i in seq_of]
    assert [g != 0.0 for g in grad] == [i in (1, 3) for i in seq_of]


def test_gspo_token_value_of_gspo_gradient_per_token():
    """log r_t = sg(s_i) + logp_t - sg(logp_t): the value is gspo's, d(sum_t w_t l_t)/d logp_t = w_t PPO'(s_i)."""
    logp, old, adv, cu, seq_of = seq_batch()
    loss, grad, _ = run("gspo_token", logp, old, adv, cu, SEQ_WEIGHTS)
    s = [sum(d) / len(d) for d in SEQ_DELTAS]
    ref = [ref_ppo_token(s[i], SEQ_ADVS[i]) for i in range(len(s))]
    close(loss, [ref[i][0] for i in seq_of])
    close(grad, [SEQ_WEIGHTS[t] * ref[i][1] for t, i in enumerate(seq_of)])
    gspo_grad = run("gspo", logp, old, adv, cu, SEQ_WEIGHTS)[1]
    assert max(abs(a - b) for a, b in zip(grad, gspo_grad)) > 0.1  # the two really differ


def test_cispo_clipped_detached_weight_times_logp():
    """l_t = -A sg(clip(r_t)) logp_t: the gradient -A clip(r_t) never vanishes, even where the clip binds.
    EasyR1's example bounds (low 0, high 4) put the weight in [1, 5]."""
    logp, old = regime_batch()
    loss, grad, m = run("cispo", logp, old, ADVS, single_token_cu(len(logp)), WEIGHTS)
    weight = [min(max(r, 1 - LOW), 1 + HIGH) for r in RATIOS]
    close(loss, [-a * c * lp for a, c, lp in zip(ADVS, weight, logp)])
    close(grad, [-w * a * c for w, a, c in zip(WEIGHTS, ADVS, weight)])
    assert "pg_clipfrac_higher" not in m and "pg_clipfrac_lower" not in m
    ratios = [0.5, 7.0, 3.0]
    loss, grad, _ = run("cispo", [math.log(r) - 1.0 for r in ratios], [-1.0] * 3, [2.0, 2.0, -1.0], [0, 1, 2, 3],
                        clip_ratio_low=0.0, clip_ratio_high=4.0)
    close(grad, [-2.0 * 1.0, -2.0 * 5.0, 1.0 * 3.0])  # weights 1 (floored), 5 (capped), 3


def test_sapo_soft_gate():
    """l_t = -A (4/tau) sigmoid(tau (r - 1)), tau 1.0 for A >= 0 and 1.05 for A < 0; no hard clip."""
    logp, old = regime_batch()
    loss, grad, m = run("sapo", logp, old, ADVS, single_token_cu(len(logp)), WEIGHTS)
    want = [ref_sapo_token(lp - o, a) for lp, o, a in zip(logp, old, ADVS)]
    close(loss, [v for v, _ in want])
    close(grad, [w * s for w, (_, s) in zip(WEIGHTS, want)])
    assert all(g != 0.0 for g, a in zip(grad, ADVS) if a != 0)  # the gate is soft: every token learns
    # By hand: on policy the loss is -2A / tau and the gradient -A (plain policy gradient).
    loss, grad, _ = run("sapo", [-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0], [0, 1, 2])
    close(loss, [-2.0, 2.0 / 1.05])
    close(grad, [-1.0, 1.0])
    # tau_negative = 3: r = 2 with A = -1 gives (4/3) sigmoid(3).
    loss, _, _ = run("sapo", [math.log(2.0)], [0.0], [-1.0], [0, 1], tau_negative=3.0)
    close(loss, [(4.0 / 3.0) / (1.0 + math.exp(-3.0))])


@pytest.mark.parametrize("loss_type", ["default", "gspo", "gspo_token", "cispo", "sapo"])
def test_on_policy_ratio_exactly_one(loss_type):
    """logp == old_logp: ppo_kl exactly 0, clip fractions exactly 0, and the ratio exactly 1
    (default / gspo / gspo_token losses are exactly -A)."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(12, generator=g, dtype=torch.float64) * 5
    adv = torch.randn(12, generator=g, dtype=torch.float64)
    loss, _, m = run(loss_type, logp.tolist(), logp.tolist(), adv.tolist(), [0, 3, 4, 9, 12])
    assert m["ppo_kl"] == [0.0] * 12
    if loss_type in ("default", "gspo", "gspo_token"):
        assert m["pg_clipfrac_higher"] == [0.0] * 12 and m["pg_clipfrac_lower"] == [0.0] * 12
        assert loss == (-adv.float()).double().tolist()


# ----------------------------------------------------------------------------------------------
# Truncated importance sampling against the rollout's log-probs
# ----------------------------------------------------------------------------------------------

def test_tis_weights_capped_and_detached():
    diffs = [0.0, 0.5, -0.5, 1.5, -3.0]  # old - rollout
    old = [-1.0, -2.0, -0.5, -1.5, -2.5]
    logp = [o + math.log(r) for o, r in zip(old, [1.1, 0.9, 1.2, 1.5, 0.7])]
    adv = [1.0, -1.0, 0.5, 2.0, -0.3]
    # rollout log-probs that carry a gradient: the weight must not pass it on (nor be a metric that requires grad)
    rollout = torch.tensor([o - d for o, d in zip(old, diffs)], dtype=torch.float64, requires_grad=True)
    cu = single_token_cu(5)
    base_loss, base_grad, _ = run("default", logp, old, adv, cu)
    loss, grad, m = run("default", logp, old, adv, cu, rollout_logp=rollout, tis_cap=2.0)
    w = [1.0, math.exp(0.5), math.exp(-0.5), 2.0, math.exp(-3.0)]  # e^1.5 = 4.48 capped at 2
    close(loss, [wi * b for wi, b in zip(w, base_loss)])
    close(grad, [wi * b for wi, b in zip(w, base_grad)])
    close(m["tis_weight"], w)
    assert m["tis_capfrac"] == [0.0, 0.0, 0.0, 1.0, 0.0]
    close(m["rollout_logp_abs_diff"], [abs(d) for d in diffs])
    assert rollout.grad is None
    # rollout log-probs without a cap: diagnostics only, the loss is untouched.
    loss, _, m = run("default", logp, old, adv, cu, rollout_logp=rollout)
    assert loss == base_loss and "tis_weight" not in m and "rollout_logp_abs_diff" in m
    with pytest.raises(ValueError, match="rollout_logprobs"):
        run("default", logp, old, adv, cu, tis_cap=2.0)
    for cap in (0.0, -1.0):  # a negative weight reversed the gradient, 0 stopped it, unsaid (config.py checks too)
        with pytest.raises(ValueError, match=f"tis_cap={cap} must be > 0"):
            run("default", logp, old, adv, cu, rollout_logp=rollout, tis_cap=cap)


def test_bad_inputs_speak():
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'.*gspo_token"):
        run("ppo", [0.0], [0.0], [1.0], [0, 1])
    with pytest.raises(ValueError, match=r"cu_seqlens must run from 0 to the token count 2, got \[0, 1\]"):
        run("default", [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0, 1])
    with pytest.raises(ValueError, match="decreases"):
        run("default", [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0, 2, 1, 2])


def test_empty_sequences_are_allowed():
    """An empty response (cu_seqlens repeats a value): no tokens, sequence mean 0, still counted by `seq`."""
    loss, _, _ = run("gspo", [math.log(1.2), 0.0], [0.0, 0.0], [1.0, -1.0], [0, 1, 1, 2])
    close(loss, [-1.2, 1.0])
    x = torch.tensor([2.0, 4.0, 6.0])
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    close([aggregate_loss(x, cu, "seq").item()], [(3.0 + 0.0 + 6.0) / 3])
    close([aggregate_loss(x, cu, "token").item()], [4.0])
    with pytest.raises(ValueError, match="shapes"):
        run("default", [0.0, 0.0], [0.0], [1.0, 1.0], [0, 2])


def test_all_responses_empty_token_mean_is_zero_not_nan():
    """A mini-batch whose responses are all empty has no tokens: the token mean is 0 with a zero gradient (0 / 0
    would be a NaN actor/pg_loss, and a NaN gradient from a dummy micro-batch that multiplies it by 0)."""
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    for counts in ({}, {"global_tokens": 0}):
        assert aggregate_loss(torch.zeros(0), cu, "token", **counts).item() == 0.0
    for mode in ("seq", "seq_sum_norm"):  # a caller's count of 0 sequences (a copied objective's): 0, not NaN
        assert aggregate_loss(torch.zeros(0), cu, mode, global_seqs=0, seq_len_norm=8).item() == 0.0
    logp = torch.zeros(1, requires_grad=True)  # a dummy micro-batch's one token, scaled by 0 as actor.update does
    (aggregate_loss(logp * 2.0, torch.tensor([0, 1]), "token", global_tokens=0) * 0.0).backward()
    assert logp.grad.tolist() == [0.0]


# ----------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------

LENGTHS = [1, 5, 2, 7, 3, 3, 9, 2]  # unequal on purpose
SEQ_LEN_NORM = 16


def agg_batch(loss_type="default"):
    g = torch.Generator().manual_seed(1)
    tokens = sum(LENGTHS)
    old = -torch.rand(tokens, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.4 * torch.randn(tokens, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.repeat_interleave(torch.randn(len(LENGTHS), generator=g, dtype=torch.float64), torch.tensor(LENGTHS))
    return logp, old, adv


def cu_of(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def chunked_loss(logp, old, adv, mode, n_chunks, loss_type, local=False):
    """Sum over micro-batches (whole sequences each) of aggregate_loss with the global denominators."""
    per_chunk = len(LENGTHS) // n_chunks
    total, start = 0.0, 0
    for c in range(n_chunks):
        lengths = LENGTHS[c * per_chunk:(c + 1) * per_chunk]
        end = start + sum(lengths)
        cu = cu_of(lengths)
        loss, _ = policy_loss(logp[start:end], old[start:end], adv[start:end], cu, loss_type=loss_type)
        counts = {} if local else dict(global_tokens=sum(LENGTHS), global_seqs=len(LENGTHS))
        total = total + aggregate_loss(loss, cu, mode, seq_len_norm=SEQ_LEN_NORM, **counts)
        start = end
    return total


def test_aggregation_matches_formulas():
    values = [0.1 * ((7 * t) % 11) - 0.4 for t in range(sum(LENGTHS))]
    cu = cu_of(LENGTHS)
    x = torch.tensor(values, dtype=torch.float64)
    seqs, s = [], 0
    for n in LENGTHS:
        seqs.append(values[s:s + n])
        s += n
    close([aggregate_loss(x, cu, "token").item()], [sum(values) / len(values)])
    close([aggregate_loss(x, cu, "seq").item()], [sum(sum(q) / len(q) for q in seqs) / len(seqs)])
    close([aggregate_loss(x, cu, "seq_sum_norm", seq_len_norm=16).item()], [sum(values) / (len(seqs) * 16)])
    close([aggregate_loss(x, cu, "token", global_tokens=100).item()], [sum(values) / 100])
    close([aggregate_loss(x, cu, "seq", global_seqs=20).item()], [sum(sum(q) / len(q) for q in seqs) / 20])
    with pytest.raises(ValueError, match="seq_len_norm"):
        aggregate_loss(x, cu, "seq_sum_norm")
    with pytest.raises(ValueError, match="unknown mode 'mean'"):
        aggregate_loss(x, cu, "mean")


@pytest.mark.parametrize("loss_type", ["default", "gspo"])
@pytest.mark.parametrize("mode", ["token", "seq", "seq_sum_norm"])
def test_micro_batch_split_gives_same_value_and_gradient(mode, loss_type):
    """1, 2 or 4 micro-batches with the global denominators: same loss, same gradient (float64 inputs,
    fp32 compute). With local denominators the token mode would differ: the split matters."""
    logp, old, adv = agg_batch()
    results = []
    for n_chunks in (1, 2, 4):
        logp.grad = None
        loss = chunked_loss(logp, old, adv, mode, n_chunks, loss_type)
        loss.backward()
        results.append((loss.item(), logp.grad.clone()))
    for value, grad in results[1:]:
        close([value], [results[0][0]])
        torch.testing.assert_close(grad, results[0][1], rtol=1e-5, atol=1e-7)
    assert results[0][1].abs().max() > 1e-3  # a gradient that is really there
    if mode == "token":  # the mean of two micro-batch token means (15 and 17 tokens) weighs tokens unequally
        logp.grad = None
        (chunked_loss(logp, old, adv, mode, 2, loss_type, local=True) / 2).backward()
        assert (logp.grad - results[0][1]).abs().max() > 0.05 * results[0][1].abs().max()


def test_seq_mode_is_a_true_sequence_mean_unlike_easyr1():
    """Our `seq` equals the mean of per-sequence means, however the batch is split. EasyR1's scaling
    (each micro-batch's sequence mean times its share of the tokens) gives another number."""
    values = [float(10 * (i < 4) + t % 3) for i, n in enumerate(LENGTHS) for t in range(n)]
    x = torch.tensor(values, dtype=torch.float64)
    seq_means, s = [], 0
    for n in LENGTHS:
        seq_means.append(sum(values[s:s + n]) / n)
        s += n
    true_mean = sum(seq_means) / len(seq_means)
    ours, easyr1, start = 0.0, 0.0, 0
    for lengths in (LENGTHS[:4], LENGTHS[4:]):  # 15 and 17 tokens, 4 sequences each
        end = start + sum(lengths)
        chunk, cu = x[start:end], cu_of(lengths)
        ours += aggregate_loss(chunk, cu, "seq", global_seqs=len(LENGTHS)).item()
        easyr1 += aggregate_loss(chunk, cu, "seq").item() * sum(lengths) / sum(LENGTHS)
        start = end
    close([ours], [true_mean])
    assert abs(easyr1 - true_mean) > 0.2, (easyr1, true_mean)


# ----------------------------------------------------------------------------------------------
# KL penalty
# ----------------------------------------------------------------------------------------------

def ref_k3(d):
    neg = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(neg) - neg - 1.0, -10.0), 10.0)


# exp(100) overflows fp32: the clamp keeps grads finite
KL_D = [0.0, 0.3, -0.3, 1.0, -2.0, 2.0, 15.0, -30.0, 30.0, -100.0]


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_values_and_gradients(kind):
    ref = torch.tensor([-1.0 - 0.2 * i for i in range(len(KL_D))], dtype=torch.float64)
    logp = (ref + torch.tensor(KL_D, dtype=torch.float64)).requires_grad_(True)
    k = kl_penalty(logp, ref, kind)
    assert k.dtype == torch.float32 and k.shape == logp.shape
    k.sum().backward()
    value = {"kl": lambda d: d, "abs": abs, "mse": lambda d: 0.5 * d * d, "low_var_kl": ref_k3}[kind]
    slope = {"kl": lambda d: 1.0, "abs": lambda d: math.copysign(1.0, d) if d else 0.0, "mse": lambda d: d,
             "low_var_kl": lambda d: 1.0 - math.exp(-d) if ref_k3(d) < 10.0 else 0.0}[kind]
    close(k.double().tolist(), [value(d) for d in KL_D], rtol=2e-6, atol=1e-5)
    close(logp.grad.tolist(), [slope(d) for d in KL_D], rtol=2e-6, atol=1e-5)
    if kind == "low_var_kl":  # by hand: d = -2 -> e^2 - 3; d = 2 -> e^-2 + 1; the clamps cap at 10
        close(k.double().tolist()[4:], [math.exp(2) - 3, math.exp(-2) + 1, 10.0, 10.0, 10.0, 10.0])


def test_kl_low_precision_inputs_compute_in_fp32():
    logp = torch.tensor([-1.0, -2.5], dtype=torch.bfloat16)
    ref = torch.tensor([-1.5, -2.0], dtype=torch.bfloat16)
    k = kl_penalty(logp, ref, "low_var_kl")
    assert k.dtype == torch.float32
    close(k.double().tolist(), [ref_k3(0.5), ref_k3(-0.5)])


def test_kl_unknown_kind_lists_kinds():
    with pytest.raises(ValueError, match="'full'.*low_var_kl"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "full")


def test_kl_of_two_shapes_is_an_error_not_a_broadcast():
    """[4] against [4, 1] broadcast to a [4, 4] KL without a word."""
    with pytest.raises(ValueError, match=r"kl_penalty: logp \[4\] and ref_logp \[4, 1\]"):
        kl_penalty(torch.zeros(4), torch.zeros(4, 1))


def test_kl_gradient_directions_on_a_categorical():
    """On samples from pi (expectation taken exactly over 3 categories): grad E[k1] = 0,
    grad E[k2] = grad KL(pi || ref) (reverse), grad E[k3] = grad KL(ref || pi) (forward)."""
    theta0 = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64)
    ref = torch.log_softmax(torch.tensor([0.1, 0.4, -0.3], dtype=torch.float64), 0)

    def grad_of(fn):
        theta = theta0.clone().requires_grad_(True)
        fn(torch.log_softmax(theta, 0)).backward()
        return theta.grad

    def expected(kind):  # sum_y pi(y) k(logpi(y)), pi(y) not differentiated (the samples are given)
        return lambda lp: (lp.exp().detach() * kl_penalty(lp, ref, kind)).sum()

    reverse = grad_of(lambda lp: (lp.exp() * (lp - ref)).sum())
    forward = grad_of(lambda lp: (ref.exp() * (ref - lp)).sum())
    torch.testing.assert_close(grad_of(expected("kl")), torch.zeros(3, dtype=torch.float64), atol=1e-7, rtol=0)
    torch.testing.assert_close(grad_of(expected("mse")), reverse, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(grad_of(expected("low_var_kl")), forward, atol=1e-7, rtol=1e-5)
    assert (reverse - forward).abs().max() > 1e-3


def test_clip_and_tis_fractions_count_strictly_beyond_the_bound():
    """A ratio exactly at a bound is not clipped: r = 2 with eps_high = 1 (upper bound 2) for A > 0, r = 3 with
    dual c = 3 for A < 0; a TIS weight exactly at the cap (old == rollout, cap 1) is not capped. The ratios are
    exact in fp32 (exp(fp32(log 2)) == 2). The losses are the bound's either way: -1 * 2 and 1 * 3."""
    loss, _, m = run("default", [math.log(2.0), math.log(3.0)], [0.0, 0.0], [1.0, -1.0], [0, 1, 2],
                     clip_ratio_high=1.0)
    close(loss, [-2.0, 3.0])
    assert m["pg_clipfrac_higher"] == [0.0, 0.0] and m["pg_clipfrac_lower"] == [0.0, 0.0]
    _, _, m = run("default", [-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], [0, 1, 2], rollout_logp=[-1.0, -1.5],
                  tis_cap=1.0)
    assert m["tis_capfrac"] == [0.0, 1.0]  # exp(0) = 1 is at the cap; exp(0.5) = 1.65 is above it
    close(m["tis_weight"], [1.0, 1.0])


# ----------------------------------------------------------------------------------------------
# The actor's settings reach its update (the toy VL model, on policy: every ratio 1)
# ----------------------------------------------------------------------------------------------

def update_on_policy(toy, samples, cfg_overrides=None, plan=None, monkeypatch=None, **actor_kwargs):
    """One Actor.update of fresh copies of the samples with old = the actor's own log-probs and ref = old - 0.3
    -> (metrics, the gradients the first optimizer step applied, the samples)."""
    import actor as actor_module
    from test_actor_update import MAX_PROMPT, MAX_RESPONSE, Spy, make_cfg

    spy = Spy()
    actor = spy.watch(actor_module.Actor(make_cfg(toy["vl_model"], **(cfg_overrides or {})), role="actor",
                                         temperature=1.0, device="cpu", max_prompt_length=MAX_PROMPT,
                                         max_response_length=MAX_RESPONSE, n_per_prompt=2, training_steps=4,
                                         **actor_kwargs))
    if plan is not None:
        real_plan = actor_module.Actor._plan
        monkeypatch.setattr(actor_module.Actor, "_plan", lambda self, *a: plan(real_plan(self, *a)))
    fresh = [dict(s) for s in samples]
    for s, logp in zip(fresh, actor.compute_log_probs(fresh)):
        s.update(old_logprobs=logp, ref_logprobs=logp - 0.3)
    return actor.update(fresh), spy.grads[0], fresh


def test_kl_penalty_and_seq_sum_norm_reach_the_update(toy, samples):
    """kl_penalty="mse" with ref = old - 0.3: each token's KL is 0.5 * 0.3^2 = 0.045 (low_var_kl would give
    e^-0.3 + 0.3 - 1 = 0.0408). loss_avg_mode=seq_sum_norm over the 4 samples divides token sums by 4 x
    max_response_length (8): actor/pg_loss = -sum_i A_i |o_i| / 32, actor/kl_loss = 0.045 sum_i |o_i| / 32."""
    metrics, _, fresh = update_on_policy(toy, samples, {"loss_avg_mode": "seq_sum_norm"}, use_kl_loss=True,
                                         kl_coef=0.1, kl_penalty="mse")
    lengths = [len(s["response_ids"]) for s in fresh]
    assert math.isclose(metrics["actor/pg_loss"], -sum(s["advantage"] * n for s, n in zip(fresh, lengths)) / 32,
                        rel_tol=1e-5)
    assert math.isclose(metrics["actor/kl_loss"], 0.045 * sum(lengths) / 32, rel_tol=1e-4)


def test_the_update_applies_the_gradient_of_its_objective(toy):
    """On policy (r = 1), the defaults (PPO loss, token mean, low_var_kl) with kl_coef 0.5 and ref = old - d_t: step 1
    applies the gradient of sum_t (-A_t + 0.5 (1 - e^-d_t)) log pi(y_t) / T through a plain per-sequence forward. The
    tests above read the logged losses only: a backward of -loss, or of a KL term with a minus sign, passed them."""
    from transformers import AutoModelForCausalLM

    from actor import Actor
    from test_actor import TEMPERATURE, assert_grads_close, reference_log_probs, text_sample
    from test_actor_update import MAX_PROMPT, MAX_RESPONSE, Spy, make_cfg

    spy, samples = Spy(), [text_sample(4, 1), text_sample(7, 2, prompt_len=3), text_sample(2, 3), text_sample(5, 4)]
    policy = spy.watch(Actor(make_cfg(toy["text_model"]), temperature=TEMPERATURE, max_prompt_length=MAX_PROMPT,
                             max_response_length=MAX_RESPONSE, n_per_prompt=2, use_kl_loss=True, kl_coef=0.5))
    for s, logp, a in zip(samples, policy.compute_log_probs(samples), (1.0, -0.5, 2.0, -1.5)):
        s.update(old_logprobs=logp, advantage=a, ref_logprobs=logp - torch.linspace(-0.3, 0.4, len(logp)))
    policy.update(samples)
    model = AutoModelForCausalLM.from_pretrained(toy["text_model"], dtype=torch.float32, attn_implementation="sdpa")
    tokens = sum(len(s["response_ids"]) for s in samples)
    for s in samples:
        weight = (-s["advantage"] + 0.5 * (1 - torch.exp(s["ref_logprobs"] - s["old_logprobs"]))) / tokens
        (weight * reference_log_probs(model, s, is_vl=False)).sum().backward()
    assert_grads_close(spy.grads[0], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, 1e-7)


def test_max_grad_norm_clips_the_applied_gradient_and_logs_the_norm_before(toy, samples):
    """max_grad_norm 1e-3: the gradient the optimizer steps with has global norm 1e-3; actor/grad_norm is the
    norm before clipping, as the unclipped run's."""
    free, grads, _ = update_on_policy(toy, samples)
    clipped, clipped_grads, _ = update_on_policy(toy, samples, {"max_grad_norm": 1e-3})
    norm = lambda g: math.sqrt(sum(t.double().pow(2).sum().item() for t in g.values()))  # noqa: E731
    assert math.isclose(norm(grads), free["actor/grad_norm"], rel_tol=1e-4) and norm(grads) > 1e-2
    assert math.isclose(norm(clipped_grads), 1e-3, rel_tol=1e-3)
    assert math.isclose(clipped["actor/grad_norm"], free["actor/grad_norm"], rel_tol=1e-5)


def test_a_dummy_micro_batch_changes_no_metric(toy, samples, monkeypatch):
    """An empty micro-batch (what a rank with fewer micro-batches than its peers runs, to keep the collectives in
    step) added to every plan: its pad token enters neither the losses, the token-mean metrics nor actor/tokens."""
    kl = dict(use_kl_loss=True, kl_coef=0.1)
    plain, _, fresh = update_on_policy(toy, samples, **kl)
    padded, _, _ = update_on_policy(toy, samples, plan=lambda parts: parts + [[]], monkeypatch=monkeypatch, **kl)
    assert plain["actor/tokens"] == padded["actor/tokens"] == sum(len(s["response_ids"]) for s in fresh)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/entropy", "actor/pg_clipfrac_higher"):
        assert math.isclose(plain[key], padded[key], rel_tol=1e-5, abs_tol=1e-9), (key, plain[key], padded[key])


def test_one_log_prob_for_a_longer_response_is_an_error(toy, samples):
    """Only the advantage may come once per response: one old log-prob for a response of several tokens is an
    error naming the sample, not broadcast."""
    from test_actor_update import make_actor, make_cfg

    bad = [dict(s) for s in samples]
    bad[1]["old_logprobs"] = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="sample 1: old_logprobs has 1 values for"):
        make_actor(make_cfg(toy["vl_model"])).update(bad)


# ----------------------------------------------------------------------------------------------
# Edges found by mutation testing
# ----------------------------------------------------------------------------------------------

def test_rollout_logp_of_another_length_is_an_error_not_a_broadcast():
    """rollout_logp is checked as the other per-token tensors: one value for two tokens would broadcast into the
    TIS weights and rollout_logp_abs_diff without a word."""
    for rollout in ([-1.0], [-1.0, -1.0, -1.0]):
        with pytest.raises(ValueError, match="shapes"):
            run("default", [-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], [0, 2], rollout_logp=rollout)
        with pytest.raises(ValueError, match="shapes"):
            run("default", [-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0], [0, 2], rollout_logp=rollout, tis_cap=2.0)


def test_a_zero_advantage_token_is_never_counted_as_clipped():
    """A = 0 (every token of a flat GRPO group) has no loss to clip: r = 1.5 and r = 4 count in neither
    pg_clipfrac_higher (A > 0 only) nor pg_clipfrac_lower (A < 0 only)."""
    loss, grad, m = run("default", [math.log(1.5), math.log(4.0)], [0.0, 0.0], [0.0, 0.0], [0, 1, 2])
    assert loss == [0.0, 0.0] and grad == [0.0, 0.0]
    assert m["pg_clipfrac_higher"] == [0.0, 0.0] and m["pg_clipfrac_lower"] == [0.0, 0.0]


def test_cu_seqlens_must_start_at_zero():
    """[1, 2] ends at the token count 2 but leaves token 0 outside every sequence: an error, not a silent loss."""
    with pytest.raises(ValueError, match=r"cu_seqlens must run from 0 to the token count 2, got \[1, 2\]"):
        run("default", [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1, 2])
    with pytest.raises(ValueError, match="cu_seqlens must run from 0"):
        aggregate_loss(torch.zeros(2), torch.tensor([1, 2]), "seq")


def test_per_token_inputs_of_shape_tokens_by_1_are_not_flat():
    """[tokens, 1] tensors of one shape would pass a check of equal shapes alone and give a [tokens, 1] loss."""
    x = torch.zeros(2, 1)
    with pytest.raises(ValueError, match="expected flat per-token tensors"):
        policy_loss(x, x, x, torch.tensor([0, 2]))


def test_sapo_temperatures_reach_the_update(toy, samples):
    """loss_type sapo with tau_positive 2, tau_negative 4, on policy (r = 1, sigmoid(0) = 1/2): each token's loss is
    -A (4 / tau) / 2, i.e. -A for A > 0 and -A / 2 for A < 0, so actor/pg_loss = sum_i l_i |o_i| / sum_i |o_i|
    (the defaults 1 and 1.05 would give -2A and -1.905A)."""
    metrics, _, fresh = update_on_policy(toy, samples, {"loss_type": "sapo", "tau_positive": 2.0,
                                                        "tau_negative": 4.0})
    lengths = [len(s["response_ids"]) for s in fresh]
    per_token = [-s["advantage"] * (4.0 / (2.0 if s["advantage"] >= 0 else 4.0)) / 2 for s in fresh]
    expected = sum(l * n for l, n in zip(per_token, lengths)) / sum(lengths)
    assert math.isclose(metrics["actor/pg_loss"], expected, rel_tol=1e-5), (metrics["actor/pg_loss"], expected)


def test_a_second_epoch_at_lr_0_changes_no_metric(toy, samples):
    """lr 0: the second PPO epoch repeats the first exactly, so every actor/* metric of ppo_epochs=2 equals that of
    one epoch: losses averaged over the optimizer steps, token means (entropy, ppo_kl, ...) over one epoch's tokens,
    actor/tokens per epoch, grad_norm the mean of equal norms."""
    kl = dict(use_kl_loss=True, kl_coef=0.1)
    one, _, _ = update_on_policy(toy, samples, {"optim.lr": 0.0}, **kl)
    two, _, _ = update_on_policy(toy, samples, {"optim.lr": 0.0, "ppo_epochs": 2}, **kl)
    assert one.keys() == two.keys() and one["actor/entropy"] > 0.0
    for key in one:
        assert math.isclose(one[key], two[key], rel_tol=1e-5, abs_tol=1e-9), (key, one[key], two[key])


def test_seq_sum_norm_without_max_response_length_is_an_error(toy, samples):
    """Dr. GRPO's constant is max_response_length: an actor built without one refuses seq_sum_norm (no silent 1)."""
    import actor as actor_module
    from test_actor_update import MAX_PROMPT, make_cfg

    actor = actor_module.Actor(make_cfg(toy["vl_model"], loss_avg_mode="seq_sum_norm"), role="actor", device="cpu",
                               max_prompt_length=MAX_PROMPT, max_response_length=None, n_per_prompt=2)
    with pytest.raises(ValueError, match="seq_sum_norm.*pass seq_len_norm"):
        actor.update([dict(s) for s in samples])


def test_tis_without_the_rollouts_log_probs_is_an_error_not_an_update_without_tis(toy, samples):
    """tis_cap set but no sample carries rollout_logprobs: an error naming the key (TIS was turned off unsaid)."""
    from test_actor_update import make_actor, make_cfg

    bare = [{k: v for k, v in s.items() if k != "rollout_logprobs"} for s in samples]
    with pytest.raises(KeyError, match="sample 0 has no 'rollout_logprobs'"):
        make_actor(make_cfg(toy["vl_model"], tis_cap=2.0)).update(bare)


def test_seq_mode_divides_each_mini_batch_by_its_own_sequences(toy, samples):
    """loss_avg_mode seq, two mini-batches of 2 (global_batch_size 1 prompt x n 2), advantages 1, 0.5 | 0.7, 0.2, lr 0
    (both steps on policy): each token's loss is -A, a step's pg_loss the mean over its 2 responses (-0.75, -0.45),
    actor/pg_loss their mean -0.6 (dividing by all 4 sequences gave -0.3)."""
    shifted = [dict(s, advantage=a) for s, a in zip(samples, [1.0, 0.5, 0.7, 0.2])]
    metrics, _, _ = update_on_policy(toy, shifted, {"loss_avg_mode": "seq", "global_batch_size": 1, "optim.lr": 0.0})
    assert math.isclose(metrics["actor/pg_loss"], -0.6, rel_tol=1e-5), metrics["actor/pg_loss"]


def test_samples_that_do_not_fill_whole_mini_batches_are_an_error_not_a_short_step(toy, samples):
    """Mini-batches of 2 (global_batch_size 1 prompt x n 2) and 3 samples: an error naming the counts, not a second
    optimizer step on the lone third sample; no samples at all (no step, no LR schedule step) is one too."""
    from test_actor_update import make_actor, make_cfg

    actor = make_actor(make_cfg(toy["vl_model"], global_batch_size=1))
    for part in (samples[:3], []):
        with pytest.raises(ValueError, match=f"{len(part)} samples on rank 0 is not a positive multiple of the "
                                             "mini-batch size 2"):
            actor.update([dict(s) for s in part])
