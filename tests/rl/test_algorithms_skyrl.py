"""The SkyRL 0.4.0 algorithms in tx.rl.algorithms (rollout_is, dppo, cispo's anchor and metrics, maxrl, prompt_mean /
token_mean_legacy, the reduction folded into the advantages, the token mask's metric, the zero subgradient of |x|)
against independent float64 references written here from SkyRL 0.4.0's formulas (`ppo_utils.py`,
`off_policy_correction_utils.py`) as explicit Python loops over groups, rows and tokens.

Gradients: the JAX losses under `jax.grad` against central finite differences of the reference; a stop-gradient is
an explicit second argument of the reference (`lp_sg`), held fixed while `lp` moves. Data: ragged masks with a fully
masked row, a singleton group, tokens beyond safe_exp's clamp; the cases of SkyRL's own tests
(tests/train/algorithms/test_losses.py, test_off_policy_correction.py, tests/backends/skyrl_train/utils/
test_ppo_utils.py) with their inputs, the expected numbers computed by the references here.

Tolerances: TOL64 = 1e-6 for float64 (host functions, JAX under x64), TOL32 = 1e-5 for JAX in float32.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rl.test_algorithms import GROUPS, LENGTHS, B, T, ragged_mask  # noqa: F401  (the same ragged batch)
from tx.rl import algorithms as alg

TOL64 = 1e-6
TOL32 = 1e-5


def groups_of(group_ids):
    out = {}
    for b, g in enumerate(group_ids):
        out.setdefault(g, []).append(b)
    return out


def close(got, want, tol=TOL64, scale=1.0):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol * scale)


def sexp(d):
    """SkyRL's safe_exp_delta (clip 20)."""
    return math.exp(max(-20.0, min(20.0, d)))


# ---------------------------------------------------------------------------------------------------
# 1. |x| has subgradient 0 at 0 (torch): the `abs` KL estimator and kl_cov's penalty


def test_abs_kl_has_zero_subgradient_at_equality():
    ref = np.array([-1.5, -0.7, -3.0, -0.2])
    lp = ref + np.array([0.0, 0.3, 0.0, -0.4])
    for dtype in (np.float32, np.float64):
        with jax.enable_x64(dtype == np.float64):
            ref_d = jnp.asarray(ref, dtype)
            grad = jax.grad(lambda x, r=ref_d: jnp.sum(alg.kl_estimate("abs", x, r)))(jnp.asarray(lp, dtype))
            value = alg.kl_estimate("abs", jnp.asarray(lp, dtype), ref_d)
            assert grad.dtype == dtype
            np.testing.assert_array_equal(np.asarray(grad), np.array([0.0, 1.0, 0.0, -1.0], dtype))
            close(value, np.abs(lp - ref), TOL32 if dtype == np.float32 else TOL64)


def test_kl_cov_penalty_has_zero_subgradient_at_lp_equal_old():
    """At lp == old (every token's first step) a selected token's gradient is the policy-gradient term -A alone."""
    lp = np.array([-1.0, -2.0, -0.5, -1.2])
    adv = np.array([0.7, -1.3, 2.0, -0.4])
    sel = np.array([1.0, 1.0, 0.0, 1.0])
    old = lp.copy()
    old[3] = lp[3] - 0.25  # d = +0.25: the penalty's gradient is +ppo_kl_coef there
    p = {"kl_cov_frac": 0.2, "ppo_kl_coef": 0.6}
    want = [-adv[0], -adv[1], -adv[2], -adv[3] * math.exp(0.25) + 0.6]
    with jax.enable_x64(True):
        inputs = {"old_logprobs": jnp.asarray(old), "advantages": jnp.asarray(adv), "mask": jnp.ones(4),
                  "selected": jnp.asarray(sel)}
        params = {k: jnp.asarray(v) for k, v in p.items()}
        grad = jax.grad(lambda x: alg.policy_loss("kl_cov").fn(x, inputs, params).sum())(jnp.asarray(lp))
    close(grad, want, 1e-12)


# ---------------------------------------------------------------------------------------------------
# 2. policy losses: rollout_is, dppo, cispo with its anchor (references per token, loops over the batch)


def ref_dppo_keep(p, lp, mu_lp, adv):
    prob, mu = math.exp(lp), math.exp(mu_lp)
    diff = prob - mu
    if p["dppo_type"] == 0:  # binary_tv
        cut = (adv > 0 and diff > p["delta_high"]) or (adv < 0 and -diff > p["delta_low"])
    else:  # binary_kl
        kl = mu * (mu_lp - lp) + (1.0 - mu) * math.log((1.0 - mu + 1e-8) / (1.0 - prob + 1e-8))
        cut = (adv > 0 and diff > 0 and kl > p["delta_high"]) or (adv < 0 and diff < 0 and kl > p["delta_low"])
    return 0.0 if cut else 1.0


def ref_token(name, p, lp, lp_sg, old, roll, adv, sel=0.0):
    """One token's loss; `lp_sg` stands for the stop-gradient copy of `lp`."""
    if name == "cispo":
        behaviour = roll if p["cispo_anchor"] == 1 else old
        w = min(max(sexp(lp_sg - behaviour), 1.0 - p["cispo_eps_clip_low"]), 1.0 + p["cispo_eps_clip_high"])
        return -adv * w * lp
    if name == "rollout_is":
        r = sexp(lp_sg - roll)
        f = r if 1.0 - p["eps_clip_low"] < r < 1.0 + p["eps_clip_high"] else 0.0
        return -f * adv * lp
    if name == "dppo":
        return -sexp(lp - roll) * adv * ref_dppo_keep(p, lp_sg, roll, adv)
    if name == "kl_cov":
        d = lp - old
        return -adv * math.exp(d) + (p["ppo_kl_coef"] * abs(d) if sel > 0 else 0.0)
    raise KeyError(name)


def ref_losses(name, p, lp, old, roll, adv, sel=None):
    out = np.zeros_like(lp)
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            s = 0.0 if sel is None else sel[b, t]
            out[b, t] = ref_token(name, p, lp[b, t], lp[b, t], old[b, t], roll[b, t], adv[b, t], s)
    return out


def ref_grad(name, p, lp, old, roll, adv, w, sel=None, h=1e-6):
    """d sum(L * w) / d lp by central differences of the reference (the stop-gradient copy held fixed)."""
    g = np.zeros_like(lp)
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            s = 0.0 if sel is None else sel[b, t]
            args = (lp[b, t], old[b, t], roll[b, t], adv[b, t], s)
            up = ref_token(name, p, lp[b, t] + h, *args)
            down = ref_token(name, p, lp[b, t] - h, *args)
            g[b, t] = (up - down) / (2 * h) * w[b, t]
    return g


def ref_reduced(kind, loss, m, max_seq_len=None, groups=None, mbs=None):
    """SkyRL 0.4.0's loss reductions of a per-token loss, by their definitions."""
    rows = loss.shape[0]

    def token_mean(bs):
        num = den = 0.0
        for b in bs:
            for t in range(loss.shape[1]):
                num += loss[b, t] * m[b, t]
                den += m[b, t]
        return num / max(den, 1.0)

    if kind == "token_mean":
        return token_mean(range(rows))
    if kind == "sequence_mean":
        return sum(token_mean([b]) for b in range(rows)) / rows
    if kind == "seq_mean_token_sum_norm":
        return sum(loss[b, t] * m[b, t] for b in range(rows) for t in range(loss.shape[1])) / (rows * max_seq_len)
    if kind == "prompt_mean":
        prompts = groups_of(groups)
        return sum(token_mean(bs) for bs in prompts.values()) / len(prompts)
    if kind == "token_mean_legacy":
        chunks = [range(s, min(s + mbs, rows)) for s in range(0, rows, mbs)]
        return sum(token_mean(c) for c in chunks) / len(chunks)
    raise KeyError(kind)


def ref_weights(kind, m, **kw):
    """The per-token weight of each token in the reduction: the reduction of a unit loss at that token."""
    w = np.zeros_like(m)
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            unit = np.zeros_like(m)
            unit[b, t] = 1.0
            w[b, t] = ref_reduced(kind, unit, m, **kw)
    return w


CASES = {  # non-default parameters, so a loss reading the wrong key or a default fails
    "cispo_old": ("cispo", {"cispo_eps_clip_low": 0.25, "cispo_eps_clip_high": 0.4, "cispo_anchor": 0.0}),
    "cispo_rollout": ("cispo", {"cispo_eps_clip_low": 0.25, "cispo_eps_clip_high": 0.4, "cispo_anchor": 1.0}),
    "rollout_is": ("rollout_is", {"eps_clip_low": 0.2, "eps_clip_high": 0.28}),
    "dppo_tv": ("dppo", {"dppo_type": 0.0, "delta_low": 0.12, "delta_high": 0.15}),
    "dppo_kl": ("dppo", {"dppo_type": 1.0, "delta_low": 0.03, "delta_high": 0.05}),
}
SEEDS = {"cispo_old": 0, "cispo_rollout": 1, "rollout_is": 2, "dppo_tv": 3, "dppo_kl": 0}  # data of every branch


def boundary_gap(name, p, lp, old, roll, adv):
    """Per token, the distance of the decision quantities to their thresholds (float32 must not flip them)."""
    gaps = []
    if name in ("cispo", "rollout_is"):
        behaviour = roll if name == "rollout_is" or p.get("cispo_anchor") == 1 else old
        r = np.exp(lp - behaviour)
        lo, hi = ((p["cispo_eps_clip_low"], p["cispo_eps_clip_high"]) if name == "cispo"
                  else (p["eps_clip_low"], p["eps_clip_high"]))
        gaps += [np.abs(r - (1 - lo)), np.abs(r - (1 + hi))]
    if name == "dppo":
        prob, mu = np.exp(lp), np.exp(roll)
        diff = prob - mu
        kl = mu * (roll - lp) + (1 - mu) * np.log((1 - mu + 1e-8) / (1 - prob + 1e-8))
        gaps += [np.abs(diff), np.abs(diff - p["delta_high"]), np.abs(-diff - p["delta_low"]),
                 np.abs(kl - p["delta_high"]), np.abs(kl - p["delta_low"])]
    gaps.append(np.abs(np.abs(lp - roll) - 20.0))
    return np.min(gaps, axis=0)


def policy_batch(name, p, seed=0):
    rng = np.random.default_rng(seed)
    m = ragged_mask()
    old = rng.uniform(-2.5, -0.05, m.shape)
    roll = np.minimum(old + rng.normal(0.0, 0.25, m.shape), -0.02)

    def draw(shape):  # log-ratios to the sampler: a third near 0, the rest on both sides of every threshold
        return np.where(rng.uniform(size=shape) < 0.35, rng.uniform(-0.3, 0.3, shape), rng.uniform(-1.5, 1.2, shape))

    lp = np.minimum(roll + draw(m.shape), -1e-3)
    special = np.zeros(m.shape, bool)
    roll[6, 0], lp[6, 0] = -25.0, -3.5  # beyond safe_exp's clamp, both sides
    lp[6, 1] = roll[6, 1] - 21.0
    special[6, :2] = True
    adv = rng.normal(size=m.shape) * 1.5
    adv[0, 4] = adv[5, 0] = 0.0
    for _ in range(200):
        near = (boundary_gap(name, p, lp, old, roll, adv) < 1e-3) & ~special
        if not near.any():
            break
        lp[near] = np.minimum(roll[near] + draw(near.sum()), -1e-3)
    assert not near.any()
    return lp, old, roll, adv, m


def run_loss(name, p, lp, old, roll, adv, m, w, dtype, with_rollout=True, sel=None):
    spec = alg.policy_loss(name)
    params = {k: jnp.asarray(v, dtype) for k, v in spec.resolve(p).items()}
    inputs = {"old_logprobs": jnp.asarray(old, dtype), "advantages": jnp.asarray(adv, dtype),
              "mask": jnp.asarray(m, dtype), "selected": jnp.asarray(np.zeros_like(m) if sel is None else sel, dtype)}
    if with_rollout:
        inputs["rollout_logprobs"] = jnp.asarray(roll, dtype)
    per_row = jax.vmap(spec.fn, in_axes=(0, 0, None))
    x = jnp.asarray(lp, dtype)
    loss = per_row(x, inputs, params)
    grad = jax.grad(lambda y: jnp.sum(per_row(y, inputs, params) * jnp.asarray(w, dtype)))(x)
    assert loss.dtype == dtype and grad.dtype == dtype
    return np.asarray(loss, np.float64), np.asarray(grad, np.float64)


@pytest.mark.parametrize("case", list(CASES))
def test_policy_loss_value_and_gradient(case):
    name, p = CASES[case]
    lp, old, roll, adv, m = policy_batch(name, p, seed=SEEDS[case])
    w = ref_weights("prompt_mean", m, groups=GROUPS)  # ragged rows, a singleton prompt, a fully masked row
    want = ref_losses(name, p, lp, old, roll, adv)
    want_grad = ref_grad(name, p, lp, old, roll, adv, w)
    scale = np.abs(want_grad).max()
    assert scale > 0.01
    with jax.enable_x64(True):
        got, got_grad = run_loss(name, p, lp, old, roll, adv, m, w, jnp.float64)
    close(got, want, TOL64, scale=np.abs(want).max())
    close(got_grad, want_grad, TOL64, scale=scale)
    got32, grad32 = run_loss(name, p, lp, old, roll, adv, m, w, jnp.float32)
    close(got32, want, TOL32, scale=np.abs(want).max())
    close(grad32, want_grad, TOL32, scale=scale)
    # the reduced loss, as a trainer forms it (placement "loss")
    close(np.sum(got * alg.reduction_weights("prompt_mean", m, group_b=GROUPS)),
          ref_reduced("prompt_mean", want, m, groups=GROUPS), TOL32, scale=np.abs(want).max())


def test_policy_loss_data_covers_branches():
    lp, old, roll, adv, m = policy_batch("rollout_is", CASES["rollout_is"][1], seed=SEEDS["rollout_is"])
    r = np.exp(lp - roll)[m > 0]
    assert (r < 0.8).sum() >= 3 and (r > 1.28).sum() >= 3 and ((r > 0.8) & (r < 1.28)).sum() >= 3
    for case in ("dppo_tv", "dppo_kl"):
        name, p = CASES[case]
        lp, old, roll, adv, m = policy_batch(name, p, seed=SEEDS[case])
        keep = np.array([[ref_dppo_keep(p, lp[b, t], roll[b, t], adv[b, t]) for t in range(T)] for b in range(B)])
        valid = m > 0
        assert ((keep == 0) & (adv > 0) & valid).sum() >= 2 and ((keep == 0) & (adv < 0) & valid).sum() >= 2, case
        assert ((keep == 1) & valid).sum() >= 10, case
    for case in ("cispo_old", "cispo_rollout"):
        name, p = CASES[case]
        lp, old, roll, adv, m = policy_batch(name, p, seed=SEEDS[case])
        r = np.exp(lp - (roll if p["cispo_anchor"] else old))[m > 0]
        assert (r < 0.75).sum() >= 2 and (r > 1.4).sum() >= 2, case


@pytest.mark.parametrize("case", ["cispo_rollout", "rollout_is", "dppo_tv", "dppo_kl"])
def test_rollout_logprobs_absent_means_old(case):
    """A caller without separate sampler log-probs (the objective today) gets old_logprobs as the behaviour policy."""
    name, p = CASES[case]
    lp, old, roll, adv, m = policy_batch(name, p, seed=5)
    w = m
    with jax.enable_x64(True):
        got, got_grad = run_loss(name, p, lp, old, roll, adv, m, w, jnp.float64, with_rollout=False)
        same, same_grad = run_loss(name, p, lp, old, old, adv, m, w, jnp.float64)
    np.testing.assert_array_equal(got, same)
    np.testing.assert_array_equal(got_grad, same_grad)
    close(got, ref_losses(name, p, lp, old, old, adv), TOL64, scale=np.abs(got).max())


def ref_clip_ratio(name, p, lp, old, roll, adv, m):
    hit = n = 0.0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if m[b, t] == 0:
                continue
            n += m[b, t]
            if name == "cispo":
                r = sexp(lp[b, t] - (roll[b, t] if p["cispo_anchor"] == 1 else old[b, t]))
                out = r < 1 - p["cispo_eps_clip_low"] or r > 1 + p["cispo_eps_clip_high"]
            elif name == "rollout_is":
                r = sexp(lp[b, t] - roll[b, t])
                out = not (1 - p["eps_clip_low"] < r < 1 + p["eps_clip_high"])
            else:
                out = ref_dppo_keep(p, lp[b, t], roll[b, t], adv[b, t]) == 0
            hit += m[b, t] * out
    return hit / max(n, 1.0)


@pytest.mark.parametrize("case", list(CASES))
def test_clip_fraction(case):
    name, p = CASES[case]
    lp, old, roll, adv, m = policy_batch(name, p, seed=7)
    got = alg.clip_fraction(name, lp, old, adv, m, p, rollout_logprobs_bt=roll)
    want = ref_clip_ratio(name, p, lp, old, roll, adv, m)
    close(got, want, TOL64)
    assert 0.02 < got < 0.98
    # without the sampler's log-probs, old ones stand in (as the device loss)
    close(alg.clip_fraction(name, lp, old, adv, m, p), ref_clip_ratio(name, p, lp, old, old, adv, m), TOL64)


def ref_cispo_metrics(p, lp, old, roll, m):
    lo, hi = 1 - p["cispo_eps_clip_low"], 1 + p["cispo_eps_clip_high"]
    rs, cs, active, n = [], [], [], 0.0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            r = sexp(lp[b, t] - (roll[b, t] if p["cispo_anchor"] == 1 else old[b, t]))
            if m[b, t] > 0:
                n += m[b, t]
                rs.append(r * m[b, t])
                cs.append(min(max(r, lo), hi) * m[b, t])
                active.append(r)
    if not active:  # SkyRL: max / min over every position when no token is active
        active = [sexp(lp[b, t] - (roll[b, t] if p["cispo_anchor"] == 1 else old[b, t]))
                  for b in range(lp.shape[0]) for t in range(lp.shape[1])]
    return {"clip_ratio": ref_clip_ratio("cispo", p, lp, old, roll, None, m),
            "cispo/ratio_mean": sum(rs) / max(n, 1.0), "cispo/ratio_clamped_mean": sum(cs) / max(n, 1.0),
            "cispo/ratio_max": max(active), "cispo/ratio_min": min(active)}


@pytest.mark.parametrize("case", ["cispo_old", "cispo_rollout"])
def test_cispo_metrics(case):
    _, p = CASES[case]
    lp, old, roll, _, m = policy_batch("cispo", p, seed=11)
    got = alg.cispo_metrics(lp, old, m, p, rollout_logprobs_bt=roll)
    want = ref_cispo_metrics(p, lp, old, roll, m)
    assert set(got) == set(want)
    for k in want:
        close(got[k], want[k], TOL64)
    # fully masked batch: means 0, max / min over every position
    empty = np.zeros_like(m)
    got = alg.cispo_metrics(lp, old, empty, p, rollout_logprobs_bt=roll)
    want = ref_cispo_metrics(p, lp, old, roll, empty)
    for k in want:
        close(got[k], want[k], TOL64)


# ---------------------------------------------------------------------------------------------------
# SkyRL's policy-loss test cases (tests/train/algorithms/test_losses.py), expected values from the references

CISPO_LP = np.array([[-1.69315, -1.0, -0.69741]])
CISPO_OLD = np.array([[-1.0, -1.0, -3.0]])
CISPO_ADV = np.array([[1.0, -1.0, -4.0]])
CISPO_ROLL = np.array([[-1.30685, -1.5, -1.0]])


def skyrl_case_loss(name, p, lp, old, adv, roll=None, mask=None):
    """sum(L * M) in float32 (SkyRL's reduce_loss), the loss's per-token values through its registry entry."""
    m = np.ones_like(lp) if mask is None else mask
    loss, _ = run_loss(name, p, lp, old, old if roll is None else roll, adv, m, m, jnp.float32,
                       with_rollout=roll is not None)
    return float(np.sum(loss * m))


@pytest.mark.parametrize("anchor", [0.0, 1.0])
def test_skyrl_cispo_cases(anchor):
    p = {"cispo_eps_clip_low": 0.2, "cispo_eps_clip_high": 0.2, "cispo_anchor": anchor}
    got = skyrl_case_loss("cispo", p, CISPO_LP, CISPO_OLD, CISPO_ADV, CISPO_ROLL)
    want = ref_losses("cispo", p, CISPO_LP, CISPO_OLD, CISPO_ROLL, CISPO_ADV).sum()
    close(got, want, TOL32)
    metrics = alg.cispo_metrics(CISPO_LP, CISPO_OLD, np.ones((1, 3)), p, rollout_logprobs_bt=CISPO_ROLL)
    for k, v in ref_cispo_metrics(p, CISPO_LP, CISPO_OLD, CISPO_ROLL, np.ones((1, 3))).items():
        close(metrics[k], v, TOL64)
    if anchor:  # the rollout anchor genuinely differs from the old one on these inputs
        old_anchor = skyrl_case_loss("cispo", {**p, "cispo_anchor": 0.0}, CISPO_LP, CISPO_OLD, CISPO_ADV, CISPO_ROLL)
        assert abs(got - old_anchor) > 0.1


def test_skyrl_cispo_ratio_min_max_ignore_masked_tokens():
    p = {"cispo_eps_clip_low": 0.2, "cispo_eps_clip_high": 0.2, "cispo_anchor": 0.0}
    mask = np.array([[1.0, 0.0, 1.0]])
    metrics = alg.cispo_metrics(CISPO_LP, CISPO_OLD, mask, p)
    want = ref_cispo_metrics(p, CISPO_LP, CISPO_OLD, CISPO_OLD, mask)
    assert metrics["cispo/ratio_min"] > 0.0
    close(metrics["cispo/ratio_min"], want["cispo/ratio_min"], TOL64)
    close(metrics["cispo/ratio_max"], want["cispo/ratio_max"], TOL64)


def test_skyrl_cispo_anchor_config_checks():
    # the rollout anchor refuses TIS (it would double-count the off-policy gap); the old anchor accepts it
    with pytest.raises(ValueError, match="double-count"):
        alg.check_policy_loss_config("cispo", {"cispo_anchor": alg.policy_loss_param_value("cispo_anchor", "rollout")},
                                     "token")
    alg.check_policy_loss_config("cispo", {"cispo_anchor": 1.0}, None)
    alg.check_policy_loss_config("cispo", {"cispo_anchor": 0.0}, "sequence")
    # an invalid anchor is refused, naming the field
    with pytest.raises(ValueError, match="cispo_anchor"):
        alg.policy_loss_param_value("cispo_anchor", "bogus")
    with pytest.raises(ValueError, match="dppo_type"):
        alg.policy_loss_param_value("dppo_type", 2.0)
    assert alg.policy_loss_param_value("cispo_anchor", "old") == 0.0
    assert alg.policy_loss_param_value("cispo_anchor", "rollout") == 1.0
    assert alg.policy_loss_param_value("dppo_type", "binary_kl") == 1.0
    assert alg.policy_loss_param_value("delta_low", "0.05") == 0.05


DPPO_CASES = {  # name: (dppo_type, delta_low, delta_high, old, new, advantages, rollout)
    "tv_pos_adv_masked": ("binary_tv", 0.2, 0.2, [[-1.0, -1.0, -1.0]], [[-0.3, -2.0, -0.9]], [[1.0, -1.0, 1.0]], None),
    "tv_wrong_direction_not_masked": ("binary_tv", 0.2, 0.2, [[-1.0, -1.0]], [[-2.0, -0.3]], [[1.0, -1.0]], None),
    "tv_uses_rollout_logprobs": ("binary_tv", 0.2, 0.2, [[-1.0, -1.0]], [[-0.3, -0.95]], [[1.0, 1.0]],
                                 [[-0.35, -1.0]]),
    "kl_masked": ("binary_kl", 0.05, 0.05, [[-1.0, -1.0]], [[-0.1, -0.95]], [[1.0, 1.0]], None),
    "kl_no_masking_within_delta": ("binary_kl", 0.5, 0.5, [[-1.0, -1.0]], [[-1.01, -0.99]], [[1.0, -1.0]], None),
}


@pytest.mark.parametrize("case", list(DPPO_CASES))
def test_skyrl_dppo_cases(case):
    kind, lo, hi, old, new, adv, roll = DPPO_CASES[case]
    old, new, adv = np.array(old), np.array(new), np.array(adv)
    p = {"dppo_type": alg.policy_loss_param_value("dppo_type", kind), "delta_low": lo, "delta_high": hi}
    behaviour = old if roll is None else np.array(roll)  # SkyRL: rollout log-probs when given, else old
    got = skyrl_case_loss("dppo", p, new, old, adv, None if roll is None else behaviour)
    close(got, ref_losses("dppo", p, new, old, behaviour, adv).sum(), TOL32)
    clip = alg.clip_fraction("dppo", new, old, adv, np.ones_like(new), p, rollout_logprobs_bt=behaviour)
    close(clip, ref_clip_ratio("dppo", p, new, old, behaviour, adv, np.ones_like(new)), TOL64)
    if case in ("tv_pos_adv_masked", "kl_masked"):
        assert clip > 0.0
    if case in ("tv_wrong_direction_not_masked", "kl_no_masking_within_delta"):
        assert clip == 0.0
    if case == "tv_uses_rollout_logprobs":  # the sampler's log-probs change the mask and so the loss
        assert abs(got - skyrl_case_loss("dppo", p, new, old, adv)) > 1e-3


# ---------------------------------------------------------------------------------------------------
# 3. maxrl


def ref_maxrl(r, m, group_ids, eps=1e-6):
    scores = [sum(float(x) for x in row) for row in r]
    a = np.zeros_like(r)
    for rows in groups_of(group_ids).values():
        n = len(rows)
        mean = sum(scores[b] for b in rows) / n if n > 1 else 0.0
        for b in rows:
            adv = (scores[b] - mean) / (mean + eps) if n > 1 else scores[b] - mean
            for t in range(r.shape[1]):
                a[b, t] = adv * m[b, t]
    return a


def test_maxrl_ragged_with_singleton_and_empty_row():
    rng = np.random.default_rng(3)
    m = ragged_mask()
    r = np.zeros_like(m)
    for b, n in enumerate(LENGTHS):
        if n:
            r[b, n - 1] = rng.choice([0.0, 1.0, 0.5, 2.0])
            r[b, 0] += 0.25
    r[5, 0] = 0.8  # the singleton group: its advantage is its score
    r[3, 0] = 0.6  # the fully masked row still counts in its group's mean
    adv, ret = alg.compute_advantages("maxrl", r, m, GROUPS)
    want = ref_maxrl(r, m, GROUPS)
    assert adv.dtype == np.float32
    close(adv, want, TOL32)
    np.testing.assert_array_equal(adv, ret)
    assert np.all(adv[3] == 0) and adv[5, 0] != 0
    with jax.enable_x64(True):  # float64 inside
        close(alg.advantage_estimator("maxrl")(r, m, np.asarray(GROUPS), None, alg.EstimatorParams())[0], want, TOL32)
    assert "maxrl" in alg.advantage_estimator_names()


def test_skyrl_maxrl_case():
    r = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [3.0, 3.0, 3.0], [4.0, 4.0, 4.0]])
    m = np.ones_like(r)
    adv, ret = alg.compute_advantages("maxrl", r, m, np.array([0, 0, 1, 1]))
    close(adv, ref_maxrl(r, m, [0, 0, 1, 1]), TOL32)
    np.testing.assert_array_equal(adv, ret)


# ---------------------------------------------------------------------------------------------------
# 4. loss reductions prompt_mean / token_mean_legacy and 6. the reduction folded into the advantages

REDUCTION_KW = {
    "token_mean": {}, "sequence_mean": {}, "seq_mean_token_sum_norm": {"max_seq_len": 20},
    "prompt_mean": {"group_b": GROUPS}, "token_mean_legacy": {"micro_batch_size": 3},
}


def ref_kw(kw):
    return {{"group_b": "groups", "micro_batch_size": "mbs"}.get(k, k): v for k, v in kw.items()}


@pytest.mark.parametrize("kind", list(REDUCTION_KW))
def test_reduction_both_placements(kind):
    rng = np.random.default_rng(17)
    m = ragged_mask()
    m[0, 2] = 0.0  # an observation token inside a response
    loss = rng.normal(size=m.shape) + 0.3
    adv = rng.normal(size=m.shape)
    kw = REDUCTION_KW[kind]
    want = ref_reduced(kind, loss, m, **ref_kw(kw))
    w = alg.reduction_weights(kind, m, **kw)
    assert w.dtype == np.float32 and np.all(w[m == 0] == 0)
    close(np.sum(loss * w.astype(np.float64)), want, TOL32)
    close(w, ref_weights(kind, m, **ref_kw(kw)), TOL32)
    close(alg.reduction_scale(kind, m, **kw) * m, ref_weights(kind, m, **ref_kw(kw)), TOL64)
    # placement "advantages": A' = A * s, then a plain masked sum; for the linear loss L = A the same reduction
    scaled = alg.reduction_in_advantages(kind, adv, m, **kw)
    close(np.sum(scaled.astype(np.float64) * m), ref_reduced(kind, adv, m, **ref_kw(kw)), TOL32)
    for placement in alg.REDUCTION_PLACEMENTS:
        a, weights = alg.place_reduction(placement, kind, adv, m, **kw)
        close(np.sum(a.astype(np.float64) * weights), ref_reduced(kind, adv, m, **ref_kw(kw)), TOL32)


def test_prompt_mean_counts_prompts_without_tokens_and_legacy_short_last_micro_batch():
    m = ragged_mask()
    groups = ["a", "a", "a", "z", "b", "c", "d", "d"]  # prompt "z" has only the fully masked row
    loss = np.random.default_rng(2).normal(size=m.shape)
    w = alg.reduction_weights("prompt_mean", m, group_b=groups)
    close(np.sum(loss * w), ref_reduced("prompt_mean", loss, m, groups=groups), TOL32)
    # 8 rows in micro-batches of 3: 3 + 3 + 2 (tx counts the short one; SkyRL 0.4.0 would drop its rows)
    w = alg.reduction_weights("token_mean_legacy", m, micro_batch_size=3)
    close(np.sum(loss * w), ref_reduced("token_mean_legacy", loss, m, mbs=3), TOL32)
    assert np.all(w[6:][m[6:] > 0] > 0)


def test_reduction_errors():
    m = ragged_mask()
    with pytest.raises(ValueError, match="prompt_mean.*group_b"):
        alg.reduction_weights("prompt_mean", m)
    with pytest.raises(ValueError, match="prompt_mean"):
        alg.reduction_in_advantages("prompt_mean", m, m)
    with pytest.raises(ValueError, match="token_mean_legacy.*micro_batch_size"):
        alg.reduction_weights("token_mean_legacy", m)
    with pytest.raises(ValueError, match="group_b has shape"):
        alg.reduction_weights("prompt_mean", m, group_b=GROUPS[:3])
    with pytest.raises(ValueError, match="unknown loss_reduction 'invalid'"):
        alg.reduction_in_advantages("invalid", m, m)
    with pytest.raises(ValueError, match="placement 'both'"):
        alg.place_reduction("both", "token_mean", m, m)
    assert set(alg.LOSS_REDUCTIONS) == set(REDUCTION_KW)


SKYRL_REDUCTION_CASES = {  # TestApplyLossReductionToAdvantagesMinibatch: (kind, advantages, mask, kwargs)
    "token_mean": ("token_mean", [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], {}),
    "token_mean_all_masked": ("token_mean", [[1.0, 2.0]], [[0.0, 0.0]], {}),
    "sequence_mean": ("sequence_mean", [[1.0, 2.0], [3.0, 4.0]], [[1.0, 1.0], [1.0, 0.0]], {}),
    "seq_mean_token_sum_norm": ("seq_mean_token_sum_norm", [[2.0, 3.0], [9.0, 12.0]], [[1.0, 1.0], [1.0, 0.0]],
                                {"max_seq_len": 10}),
    "token_mean_legacy": ("token_mean_legacy", [[2.0, 4.0], [6.0, 8.0], [10.0, 12.0], [14.0, 16.0]],
                          [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]], {"micro_batch_size": 2}),
    "prompt_mean": ("prompt_mean", [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]],
                    [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]], {"group_b": [0, 0, 1, 1]}),
}


@pytest.mark.parametrize("case", list(SKYRL_REDUCTION_CASES))
def test_skyrl_reduction_cases(case):
    kind, adv, m, kw = SKYRL_REDUCTION_CASES[case]
    adv, m = np.array(adv), np.array(m)
    want = ref_reduced(kind, adv, m, **ref_kw(kw))
    close(np.sum(alg.reduction_in_advantages(kind, adv, m, **kw) * m), want, TOL32)  # SkyRL's reduce_loss
    close(np.sum(adv * alg.reduction_weights(kind, m, **kw)), want, TOL32)


HOMOGENEOUS = {  # losses with L(s A) = s L(A) for s > 0: both placements agree
    "regular": {"eps_clip_low": 0.2, "eps_clip_high": 0.28}, "dual_clip": {"clip_ratio_c": 2.5},
    "gspo": {"eps_clip_low": 0.15}, "sapo": {"tau_neg": 1.7}, **{k: v[1] for k, v in CASES.items()},
}


@pytest.mark.parametrize("case", list(HOMOGENEOUS))
def test_placements_agree_for_homogeneous_losses(case):
    name, p = (CASES[case][0] if case in CASES else case), HOMOGENEOUS[case]
    lp, old, roll, adv, m = policy_batch(name, alg.policy_loss(name).resolve(p), seed=23)
    lp[6, 0] = roll[6, 0] + 0.4  # keep gspo's sequence ratio finite
    totals = {}
    with jax.enable_x64(True):
        for placement in alg.REDUCTION_PLACEMENTS:
            a, w = alg.place_reduction(placement, "prompt_mean", adv, m, group_b=GROUPS)
            a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
            loss, grad = run_loss(name, p, lp, old, roll, a, m, w, jnp.float64)
            totals[placement] = (np.sum(loss * w), grad)
    close(totals["advantages"][0], totals["loss"][0], TOL32, scale=abs(totals["loss"][0]))
    close(totals["advantages"][1], totals["loss"][1], TOL32, scale=np.abs(totals["loss"][1]).max())


def test_kl_cov_penalty_is_not_reduced_under_placement_advantages():
    """kl_cov's ppo_kl_coef*|lp - old| carries no advantage: placement "advantages" sums it unreduced."""
    p = {"kl_cov_frac": 0.2, "ppo_kl_coef": 0.7}
    lp, old, roll, adv, m = policy_batch("regular", {"eps_clip_low": 0.2, "eps_clip_high": 0.2}, seed=29)
    sel = (np.random.default_rng(1).uniform(size=m.shape) < 0.4) * m
    s = alg.reduction_scale("token_mean", m)
    with jax.enable_x64(True):
        got = {}
        for placement in alg.REDUCTION_PLACEMENTS:
            a, w = alg.place_reduction(placement, "token_mean", adv, m)
            loss, _ = run_loss("kl_cov", p, lp, old, roll, np.asarray(a, np.float64), m, w, jnp.float64, sel=sel)
            got[placement] = np.sum(loss * np.asarray(w, np.float64))
    pg = ref_losses("kl_cov", p, lp, old, roll, adv)  # no selection: the policy-gradient part
    pen = ref_losses("kl_cov", p, lp, old, roll, np.zeros_like(adv), sel)
    close(got["loss"], np.sum((pg + pen) * m * s), TOL32, scale=abs(got["loss"]))
    close(got["advantages"], np.sum((pg * s + pen) * m), TOL32, scale=abs(got["advantages"]))


# ---------------------------------------------------------------------------------------------------
# 5. the token mask's metric (SkyRL's test_off_policy_correction.py compute_token_mask cases)

TOKEN_MASK_CASES = {  # name: (old, rollout, mask)
    "all_in_bounds": ([[-1.0, -1.1, -1.0]], [[-1.1, -1.0, -1.0]], [[1.0, 1.0, 1.0]]),
    "masks_high_ratio_tokens": ([[-1.0, -1.0, -1.0]], [[-1.0, -1.0, -3.0]], [[1.0, 1.0, 1.0]]),
    "masks_low_ratio_tokens": ([[-1.0, -1.0, -3.0]], [[-1.0, -1.0, -1.0]], [[1.0, 1.0, 1.0]]),
    "ignores_already_masked_tokens": ([[-1.0, -1.0, -1.0]], [[-1.0, -1.0, -6.0]], [[1.0, 1.0, 0.0]]),
    "multi_sequence_batch": ([[-1.0, -1.0], [-3.0, -1.0]], [[-1.0, -3.0], [-1.0, -1.0]], [[1.0, 1.0], [1.0, 1.0]]),
    "boundary_values": ([[0.0, 0.0]], (-np.log([[0.5, 2.0]])).tolist(), [[1.0, 1.0]]),
}


def ref_token_mask(old, roll, m, lo, hi):
    new, masked, valid = m.copy(), 0, 0
    for b in range(m.shape[0]):
        for t in range(m.shape[1]):
            if m[b, t] > 0:
                valid += 1
                if not (lo <= sexp(old[b, t] - roll[b, t]) <= hi):
                    new[b, t] = 0.0
                    masked += 1
    return new, masked / max(valid, 1)


@pytest.mark.parametrize("case", list(TOKEN_MASK_CASES))
def test_skyrl_token_mask_cases(case):
    old, roll, m = (np.array(x, np.float64) for x in TOKEN_MASK_CASES[case])
    cfg = alg.OffPolicyCorrection(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0)
    tis, new_m, metrics = alg.apply_off_policy_correction(cfg, old, roll, m)
    want_m, want_ratio = ref_token_mask(old, roll, m, 0.5, 2.0)
    np.testing.assert_array_equal(new_m, want_m)
    np.testing.assert_array_equal(tis, np.ones_like(m))
    close(metrics["token_mask_ratio"], want_ratio, TOL64)
    assert metrics["token_mask_masked_ratio"] == metrics["token_mask_ratio"]
    if case == "boundary_values":  # kept at both bounds (>= low, <= high)
        assert metrics["token_mask_ratio"] == 0.0


def test_token_mask_ratio_after_outlier_rows_on_ragged_batch():
    """On the ragged batch the ratio counts the valid tokens left after the outlier-row step (SkyRL's order)."""
    rng = np.random.default_rng(4)
    m = ragged_mask()
    old = rng.uniform(-3, -0.1, m.shape)
    d = rng.normal(scale=0.5, size=m.shape)
    d[1, 2] = 3.0  # an outlier row
    cfg = alg.OffPolicyCorrection(outlier_token_is_threshold_high=10.0, token_mask_is_threshold_low=0.6,
                                  token_mask_is_threshold_high=1.5)
    _, new_m, metrics = alg.apply_off_policy_correction(cfg, old, old - d, m)
    after_outlier = m.copy()
    for b in range(B):
        if any(m[b, t] > 0 and sexp(d[b, t]) > 10.0 for t in range(T)):
            after_outlier[b, :] = 0.0
    want_m, want_ratio = ref_token_mask(old, old - d, after_outlier, 0.6, 1.5)
    np.testing.assert_array_equal(new_m, want_m)
    assert 0.05 < want_ratio < 0.95
    close(metrics["token_mask_ratio"], want_ratio, TOL64)


# ---------------------------------------------------------------------------------------------------
# registry: names, defaults (SkyRL 0.4.0's), config fields, input keys


def test_registry_entries_and_config_fields():
    assert {"rollout_is", "dppo", "cispo"} <= set(alg.policy_loss_names())
    assert dict(alg.policy_loss("rollout_is").params) == {"eps_clip_low": 0.2, "eps_clip_high": 0.2}
    assert dict(alg.policy_loss("dppo").params) == {"dppo_type": 0.0, "delta_low": 0.2, "delta_high": 0.2}
    assert alg.policy_loss("cispo").params["cispo_anchor"] == 0.0
    assert "rollout_logprobs" in alg.POLICY_LOSS_INPUT_KEYS
    for name in ("rollout_is", "dppo", "cispo"):
        for key in alg.policy_loss(name).params:
            assert key in alg.POLICY_LOSS_PARAM_FIELDS, key
            assert key not in ("policy_loss", "kl_estimator", "kl_loss_coef", "entropy_loss_coef")
    assert alg.POLICY_LOSS_PARAM_FIELDS["cispo_anchor"] == "cispo.cispo_anchor"
    assert alg.POLICY_LOSS_PARAM_FIELDS["dppo_type"] == "dppo.dppo_type"
    assert alg.POLICY_LOSS_PARAM_FIELDS["delta_low"] == "dppo.delta_low"
    assert alg.POLICY_LOSSES_WITHOUT_OLD_LOGPROBS == {"rollout_is", "dppo"}
