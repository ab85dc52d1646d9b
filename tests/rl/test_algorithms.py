"""tx.rl.algorithms against independent float64 references written from the spec's formulas (explicit
Python loops over groups, rows and tokens), on ragged masks with a fully masked row and a singleton group.
Policy-loss and KL gradients are checked against finite differences or analytic derivatives."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx.rl import algorithms as alg

T = 9
LENGTHS = [9, 5, 1, 0, 7, 3, 9, 4]  # ragged; row 3 fully masked
GROUPS = ["a", "a", "a", "b", "b", "c", "d", "d"]  # "c" is a singleton group
B = len(LENGTHS)


def ragged_mask(lengths=LENGTHS, t=T):
    m = np.zeros((len(lengths), t))
    for b, n in enumerate(lengths):
        m[b, :n] = 1.0
    return m


def token_rewards(rng, lengths=LENGTHS, t=T):
    """Response-level rewards on the last token, plus a mid-response (multi-turn) reward on some rows."""
    r = np.zeros((len(lengths), t))
    for b, n in enumerate(lengths):
        if n:
            r[b, n - 1] = rng.choice([0.0, 1.0, 0.5])
            if n > 3 and b % 2 == 0:
                r[b, 1] = rng.normal()
    return r


def groups_of(group_ids):
    out = {}
    for b, g in enumerate(group_ids):
        out.setdefault(g, []).append(b)
    return out


def close(got, want, rtol=1e-6, atol=1e-6):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------------
# advantage estimators


def ref_scores(r):
    return [sum(float(x) for x in row) for row in r]


def ref_grpo(r, m, group_ids, norm, eps=1e-6):
    scores = ref_scores(r)
    a = np.zeros_like(r)
    for rows in groups_of(group_ids).values():
        vals = [scores[b] for b in rows]
        n = len(vals)
        if n == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(vals) / n
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
        for b in rows:
            adv = (scores[b] - mean) / (std + eps) if norm else scores[b] - mean
            for t in range(r.shape[1]):
                a[b, t] = adv * m[b, t]
    return a


def ref_rloo(r, m, group_ids):
    scores = ref_scores(r)
    a = np.zeros_like(r)
    for rows in groups_of(group_ids).values():
        for b in rows:
            others = [scores[o] for o in rows if o != b]
            adv = scores[b] - sum(others) / len(others) if others else 0.0
            for t in range(r.shape[1]):
                a[b, t] = adv * m[b, t]
    return a


def ref_whiten(x, m):
    n = 0.0
    total = 0.0
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            n += m[b, t]
            total += x[b, t] * m[b, t]
    mean = total / n
    ss = 0.0
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            ss += (x[b, t] - mean) ** 2 * m[b, t]
    var = ss / (n - 1)  # Bessel: (ss / n) * n / (n - 1)
    return (x - mean) / math.sqrt(var + 1e-8)


def ref_reinforce_pp(r, m, gamma):
    g = np.zeros_like(r)
    for b in range(r.shape[0]):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            running = r[b, t] + gamma * running
            g[b, t] = running
            if m[b, t] == 0:
                running = 0.0
    return ref_whiten(g, m) * m, g


def ref_gae(r, m, v, gamma, lambd):
    a = np.zeros_like(r)
    for b in range(r.shape[0]):
        last = 0.0
        for t in reversed(range(r.shape[1])):
            next_v = v[b, t + 1] if t + 1 < r.shape[1] else 0.0
            delta = r[b, t] + gamma * next_v - v[b, t]
            last = delta + gamma * lambd * last
            a[b, t] = last
    return ref_whiten(a, m), a + v


@pytest.mark.parametrize("norm", [True, False])
def test_grpo(norm):
    rng = np.random.default_rng(0)
    m = ragged_mask()
    r = token_rewards(rng)
    r[6], r[7] = 0.0, 0.0  # group "d": equal scores, std 0
    r[6, 8] = r[7, 3] = 1.0
    r[5, 2] = 0.5  # the singleton group's reward
    adv, ret = alg.compute_advantages("grpo", r, m, GROUPS, params=alg.EstimatorParams(grpo_norm_by_std=norm))
    want = ref_grpo(r, m, GROUPS, norm)
    assert adv.dtype == np.float32 and ret.dtype == np.float32
    close(adv, want)
    close(ret, want)
    assert np.abs(want[5]).max() > 0  # the singleton group keeps its (score / (1 + eps)) advantage
    assert np.abs(want[[0, 1, 2]]).max() > 0.1


def test_grpo_integer_group_ids_and_direct_call():
    rng = np.random.default_rng(1)
    m = ragged_mask()
    r = token_rewards(rng)
    gid = np.array([7, 7, 7, 2, 2, 11, 5, 5])
    adv, _ = alg.advantage_estimator("grpo")(r, m, gid, None, alg.EstimatorParams(epsilon=1e-3))
    close(adv, ref_grpo(r, m, list(gid), True, eps=1e-3))


def test_rloo():
    rng = np.random.default_rng(2)
    m = ragged_mask()
    r = token_rewards(rng)
    with pytest.warns(RuntimeWarning, match="one sample"):
        adv, ret = alg.compute_advantages("rloo", r, m, GROUPS)
    want = ref_rloo(r, m, GROUPS)
    close(adv, want)
    close(ret, want)
    assert np.all(adv[5] == 0) and np.abs(want).max() > 0.1


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp(gamma):
    rng = np.random.default_rng(3)
    m = ragged_mask()
    r = token_rewards(rng)
    adv, ret = alg.compute_advantages("reinforce++", r, m, GROUPS, params=alg.EstimatorParams(gamma=gamma))
    want_adv, want_ret = ref_reinforce_pp(r, m, gamma)
    close(adv, want_adv)
    close(ret, want_ret)
    # a masked position inside a response resets the running return
    m[0, 4], r[0, 6] = 0.0, 1.0
    adv, ret = alg.compute_advantages("reinforce++", r, m, GROUPS, params=alg.EstimatorParams(gamma=gamma))
    want_adv, want_ret = ref_reinforce_pp(r, m, gamma)
    close(adv, want_adv)
    close(ret, want_ret)
    assert want_ret[0, 3] == r[0, 3]


def test_gae():
    rng = np.random.default_rng(4)
    m = ragged_mask()
    r = token_rewards(rng)
    v = rng.normal(size=r.shape) * m
    params = alg.EstimatorParams(gamma=0.95, lambd=0.8)
    adv, ret = alg.compute_advantages("gae", r, m, GROUPS, v, params)
    want_adv, want_ret = ref_gae(r, m, v, 0.95, 0.8)
    close(adv, want_adv)
    close(ret, want_ret)
    with pytest.raises(ValueError, match="values"):
        alg.compute_advantages("gae", r, m, GROUPS, None, params)


def test_batch_normalize_advantages():
    rng = np.random.default_rng(5)
    m = ragged_mask()
    a = rng.normal(size=m.shape) * 2 + 0.7
    a[3] = 5.0  # values on a fully masked row must not count and come out 0
    n = total = 0.0
    for b in range(B):
        for t in range(T):
            n += m[b, t]
            total += a[b, t] * m[b, t]
    mu = total / n
    var = sum((a[b, t] - mu) ** 2 * m[b, t] for b in range(B) for t in range(T)) / n
    want = np.array([[(a[b, t] - mu) / math.sqrt(var) if m[b, t] > 0 else 0.0 for t in range(T)] for b in range(B)])
    close(alg.batch_normalize_advantages(a, m), want)


def test_advantage_registry():
    name = "test_constant_estimator"
    try:
        @alg.register_advantage_estimator(name)
        def const(r, m, g, v, p):
            return m * 2.0, m * 3.0

        assert name in alg.advantage_estimator_names()
        adv, ret = alg.compute_advantages(name, np.zeros((2, 3)), np.ones((2, 3)), [0, 1])
        assert np.all(adv == 2.0) and np.all(ret == 3.0)
        with pytest.raises(ValueError, match=name):
            alg.register_advantage_estimator(name, const)
        alg.register_advantage_estimator(name, lambda r, m, g, v, p: (m * 5.0, m), replace=True)
        assert np.all(alg.compute_advantages(name, np.zeros((2, 3)), np.ones((2, 3)), [0, 1])[0] == 5.0)
    finally:
        if name in alg.ADVANTAGE_ESTIMATORS:
            alg.ADVANTAGE_ESTIMATORS.unregister(name)
    with pytest.raises(KeyError, match="no_such_estimator.*grpo"):
        alg.advantage_estimator("no_such_estimator")
    assert set(alg.advantage_estimator_names()) >= {"grpo", "rloo", "reinforce++", "gae"}


# ---------------------------------------------------------------------------------------------------
# KL estimators


def ref_kl(kind, lp, ref):
    out, grad = np.zeros_like(lp), np.zeros_like(lp)
    for i in range(lp.size):
        x, y = lp.flat[i], ref.flat[i]
        if kind == "k1":
            out.flat[i], grad.flat[i] = x - y, 1.0
        elif kind == "k2":
            out.flat[i], grad.flat[i] = 0.5 * (x - y) ** 2, x - y
        elif kind == "abs":
            out.flat[i], grad.flat[i] = abs(x - y), float(x > y) - float(x < y)  # torch's subgradient: 0 at x == y
        else:  # k3 = exp(d) - d - 1, d = ref - lp, with clamps |d| <= 20 and value <= 10
            d = y - x
            if d > 20 or d < -20:
                d = max(-20.0, min(20.0, d))
                val = math.exp(d) - d - 1
                out.flat[i], grad.flat[i] = min(val, 10.0), 0.0
            else:
                val = math.exp(d) - d - 1
                out.flat[i] = min(val, 10.0)
                grad.flat[i] = 0.0 if val > 10 else 1.0 - math.exp(d)
    return out, grad


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_estimators(kind):
    ref = np.linspace(-3.0, -0.1, 12)
    d = np.array([-25.0, -15.0, -11.5, -5.0, -1.0, -0.3, 0.2, 1.5, 2.5, 3.0, 10.0, 25.0])  # d = ref - lp
    lp = ref - d
    want, want_grad = ref_kl(kind, lp, ref)
    if kind == "k3":  # both clamps are exercised
        assert (want == 10.0).sum() >= 3 and ((want > 0) & (want < 10)).sum() >= 5
    with jax.enable_x64(True):
        got = alg.kl_estimate(kind, jnp.asarray(lp), jnp.asarray(ref))
        got_grad = jax.grad(lambda x: jnp.sum(alg.kl_estimate(kind, x, jnp.asarray(ref))))(jnp.asarray(lp))
    close(got, want, rtol=1e-9, atol=1e-9)
    close(got_grad, want_grad, rtol=1e-9, atol=1e-9)
    got32 = alg.kl_estimate(kind, lp.astype(np.float32), ref.astype(np.float32))
    assert got32.dtype == jnp.float32
    close(got32, want, rtol=2e-5, atol=1e-5)


def test_kl_estimator_unknown():
    with pytest.raises(KeyError, match="low_var_kl"):
        alg.kl_estimate("low_var_kl", jnp.zeros(2), jnp.zeros(2))
    assert set(alg.KL_ESTIMATORS) == {"k1", "k2", "k3", "abs"}


# ---------------------------------------------------------------------------------------------------
# policy losses

PARAMS = {  # non-default values so a loss reading the wrong key or a hard-coded default fails
    "regular": {"eps_clip_low": 0.2, "eps_clip_high": 0.28},
    "dual_clip": {"eps_clip_low": 0.2, "eps_clip_high": 0.28, "clip_ratio_c": 3.0},
    "gspo": {"eps_clip_low": 0.15, "eps_clip_high": 0.25},
    "cispo": {"cispo_eps_clip_low": 0.3, "cispo_eps_clip_high": 1.0},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.7},
    "clip_cov": {"eps_clip_low": 0.2, "eps_clip_high": 0.28},
    "kl_cov": {"ppo_kl_coef": 0.7},
}
SEED_DEFAULTS = {
    "regular": {"eps_clip_low": 0.2, "eps_clip_high": 0.2},
    "dual_clip": {"eps_clip_low": 0.2, "eps_clip_high": 0.2, "clip_ratio_c": 3.0},
    "gspo": {"eps_clip_low": 0.2, "eps_clip_high": 0.2},
    "cispo": {"cispo_eps_clip_low": 0.0, "cispo_eps_clip_high": 5.0, "cispo_anchor": 0.0},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "clip_cov": {"eps_clip_low": 0.2, "eps_clip_high": 0.2, "clip_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_frac": 0.2, "ppo_kl_coef": 1.0},
}


def ref_token_loss(name, lp, old, adv, sel, p, seq_log_ratio=None):
    """One token's loss from the spec's formulas (scalars, float64)."""
    d = lp - old
    if name in ("regular", "dual_clip", "gspo"):
        if name == "gspo":
            ratio = math.exp(min(seq_log_ratio, 10.0))
        else:
            ratio = math.exp(max(-20.0, min(20.0, d)))
        bounded = max(1 - p["eps_clip_low"], min(1 + p["eps_clip_high"], ratio))
        loss = -min(ratio * adv, bounded * adv)
        if name == "dual_clip" and adv < 0:
            loss = min(-adv * p["clip_ratio_c"], loss)
        return loss
    if name == "cispo":
        ratio = math.exp(max(-20.0, min(20.0, d)))
        w = max(1 - p["cispo_eps_clip_low"], min(1 + p["cispo_eps_clip_high"], ratio))
        return -adv * w * lp
    if name == "sapo":
        ratio = math.exp(max(-20.0, min(20.0, d)))
        tau = p["tau_pos"] if adv > 0 else p["tau_neg"]
        return -adv * (4.0 / tau) / (1.0 + math.exp(-tau * (ratio - 1.0)))
    if name == "clip_cov":
        ratio = math.exp(d)
        bounded = max(1 - p["eps_clip_low"], min(1 + p["eps_clip_high"], ratio))
        return max(-adv * ratio, -adv * bounded) * (1.0 - sel)
    if name == "kl_cov":
        loss = -adv * math.exp(d)
        return loss + p["ppo_kl_coef"] * abs(d) if sel > 0 else loss
    raise KeyError(name)


def ref_seq_log_ratio(lp_row, old_row, m_row):
    num = den = 0.0
    for t in range(len(lp_row)):
        if m_row[t] > 0:
            num += (lp_row[t] - old_row[t]) * m_row[t]
            den += m_row[t]
    return num / max(den, 1.0)


def ref_policy_losses(name, lp, old, adv, m, sel, p):
    out = np.zeros_like(lp)
    for b in range(lp.shape[0]):
        s = ref_seq_log_ratio(lp[b], old[b], m[b])
        for t in range(lp.shape[1]):
            out[b, t] = ref_token_loss(name, lp[b, t], old[b, t], adv[b, t], sel[b, t], p, s)
    return out


def ref_policy_grad(name, lp, old, adv, m, sel, w, p):
    """d sum(L*w) / d lp: gspo and cispo analytically (their gradients are defined through stop-gradients),
    the others by central differences of the per-token reference (L_t depends on lp_t alone)."""
    g = np.zeros_like(lp)
    h = 1e-6
    for b in range(lp.shape[0]):
        s = ref_seq_log_ratio(lp[b], old[b], m[b])
        for t in range(lp.shape[1]):
            a = adv[b, t]
            if name == "cispo":
                ratio = math.exp(max(-20.0, min(20.0, lp[b, t] - old[b, t])))
                clip_w = max(1 - p["cispo_eps_clip_low"], min(1 + p["cispo_eps_clip_high"], ratio))
                g[b, t] = -a * clip_w * w[b, t]
            elif name == "gspo":
                ratio = math.exp(min(s, 10.0))
                lo, hi = 1 - p["eps_clip_low"], 1 + p["eps_clip_high"]
                bounded = max(lo, min(hi, ratio))
                unclipped_active = lo < ratio < hi or ratio * a < bounded * a
                g[b, t] = (-a * ratio if unclipped_active and s < 10 else 0.0) * w[b, t]
            else:
                up = ref_token_loss(name, lp[b, t] + h, old[b, t], a, sel[b, t], p)
                down = ref_token_loss(name, lp[b, t] - h, old[b, t], a, sel[b, t], p)
                g[b, t] = (up - down) / (2 * h) * w[b, t]
    return g


def kinks(name, p):
    """Log-ratios where a loss is not differentiable (finite differences must stay away from them)."""
    if name in ("regular", "dual_clip", "clip_cov", "gspo"):
        out = [math.log(1 - p["eps_clip_low"]), math.log(1 + p["eps_clip_high"]), 20.0, -20.0]
        return out + ([math.log(p["clip_ratio_c"])] if name == "dual_clip" else [])
    if name == "kl_cov":
        return [0.0]
    return [20.0, -20.0]


def policy_batch(name, p, seed=0):
    rng = np.random.default_rng(seed)
    m = ragged_mask()
    old = rng.uniform(-4.0, -0.2, size=m.shape)
    def draw(shape):  # ratios 0.2 .. 6 (both sides of every clip), a third of them near 1
        return np.where(rng.uniform(size=shape) < 0.35, rng.uniform(-0.3, 0.3, shape), rng.uniform(-1.6, 1.8, shape))

    d = draw(m.shape)
    for _ in range(100):
        near = np.zeros(m.shape, bool)
        for k in kinks(name, p):
            near |= np.abs(d - k) < 1e-3
        if not near.any():
            break
        d[near] = draw(near.sum())
    d[6, 0], d[6, 1] = 21.0, -21.0  # beyond safe_exp's clamp
    d[7, :4] = 11.0 + rng.uniform(0, 0.5, 4)  # gspo: sequence log-ratio above the cap of 10
    lp = old + d
    adv = rng.normal(size=m.shape) * 1.5
    adv[6, 0], adv[6, 1] = -1.3, 0.8
    sel = (rng.uniform(size=m.shape) < 0.4) * m
    w = rng.uniform(0.2, 1.0, size=m.shape) * m
    return lp, old, adv, m, sel, w


def run_policy_loss(name, p, lp, old, adv, m, sel, w, dtype):
    spec = alg.policy_loss(name)
    params = {k: jnp.asarray(v, dtype) for k, v in spec.resolve(p).items()}
    inputs = {"old_logprobs": jnp.asarray(old, dtype), "advantages": jnp.asarray(adv, dtype),
              "mask": jnp.asarray(m, dtype), "selected": jnp.asarray(sel, dtype)}
    per_row = jax.vmap(spec.fn, in_axes=(0, 0, None))
    loss = per_row(jnp.asarray(lp, dtype), inputs, params)
    grad = jax.grad(lambda x: jnp.sum(per_row(x, inputs, params) * jnp.asarray(w, dtype)))(jnp.asarray(lp, dtype))
    return np.asarray(loss, np.float64), np.asarray(grad, np.float64)


@pytest.mark.parametrize("name", list(PARAMS))
def test_policy_loss_value_and_gradient(name):
    p = alg.policy_loss(name).resolve(PARAMS[name])
    lp, old, adv, m, sel, w = policy_batch(name, p)
    want = ref_policy_losses(name, lp, old, adv, m, sel, p)
    want_grad = ref_policy_grad(name, lp, old, adv, m, sel, w, p)
    with jax.enable_x64(True):
        got, got_grad = run_policy_loss(name, p, lp, old, adv, m, sel, w, jnp.float64)
    close(got, want, rtol=1e-9, atol=1e-9)
    scale = np.abs(want_grad).max()
    close(got_grad, want_grad, rtol=1e-6, atol=1e-6 * scale)
    assert np.abs(want_grad).max() > 0.1

    # float32, as the trainer runs it, away from the huge-ratio tokens
    got32, grad32 = run_policy_loss(name, p, lp, old, adv, m, sel, w, jnp.float32)
    rows = [0, 1, 2, 4, 5]
    close(got32[rows], want[rows], rtol=2e-5, atol=2e-5)
    close(grad32[rows], want_grad[rows], rtol=2e-5, atol=2e-5)


def test_policy_loss_test_data_covers_branches():
    p = alg.policy_loss("dual_clip").resolve(PARAMS["dual_clip"])
    lp, old, adv, m, _, _ = policy_batch("dual_clip", p)
    ratio, valid = np.exp(lp - old), m > 0
    lo, hi = 1 - p["eps_clip_low"], 1 + p["eps_clip_high"]
    for region in (ratio < lo, ratio > hi, (ratio > lo) & (ratio < hi)):
        for sign in (adv > 0, adv < 0):
            assert (region & sign & valid).sum() >= 2
    assert ((ratio > 3.0) & (adv < 0) & valid).sum() >= 2  # dual-clip branch
    assert ((ratio > hi) & (ratio < 3.0) & (adv < 0) & valid).sum() >= 2
    # gspo: one ratio per sequence, on both sides of the clip and above the cap
    gp = alg.policy_loss("gspo").resolve(PARAMS["gspo"])
    lp, old, adv, m, _, _ = policy_batch("gspo", gp)
    s = [ref_seq_log_ratio(lp[b], old[b], m[b]) for b in range(B)]
    assert s[7] > 10 and any(math.exp(x) > 1 + gp["eps_clip_high"] for x in s[:7])
    assert any(math.exp(x) < 1 - gp["eps_clip_low"] for x in s) or any(
        1 - gp["eps_clip_low"] < math.exp(x) < 1 + gp["eps_clip_high"] for x in s)


def test_gspo_sequence_ratio_is_the_masked_geometric_mean():
    """Every token carries exp(mean log-ratio over the datum's mask); padding values do not count."""
    rng = np.random.default_rng(9)
    lp = rng.uniform(-3, -0.5, 6)
    old = lp - np.array([0.1, -0.05, 0.02, 0.04, 7.0, -9.0])
    mask = np.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    adv = np.full(6, -1.0)  # negative advantage: unclipped ratio for ratio < 1+eps
    p = {"eps_clip_low": 0.2, "eps_clip_high": 0.2}
    with jax.enable_x64(True):
        inputs = {"old_logprobs": jnp.asarray(old), "advantages": jnp.asarray(adv), "mask": jnp.asarray(mask),
                  "selected": jnp.zeros(6)}
        loss = alg.policy_loss("gspo").fn(jnp.asarray(lp), inputs, {k: jnp.asarray(v) for k, v in p.items()})
    geo = math.exp((0.1 - 0.05 + 0.02 + 0.04) / 4)
    close(loss, np.full(6, geo), rtol=1e-12, atol=0)


def test_cispo_gradient_is_stop_gradient_weight():
    lp = np.array([-1.0, -2.0, -0.5, -1.5])
    old = lp - np.log([0.5, 1.2, 3.0, 8.0])
    adv = np.array([1.0, -2.0, 0.5, 1.5])
    with jax.enable_x64(True):
        inputs = {"old_logprobs": jnp.asarray(old), "advantages": jnp.asarray(adv), "mask": jnp.ones(4),
                  "selected": jnp.zeros(4)}
        params = {"cispo_eps_clip_low": jnp.asarray(0.2), "cispo_eps_clip_high": jnp.asarray(1.0),
                  "cispo_anchor": jnp.asarray(0.0)}
        grad = jax.grad(lambda x: alg.policy_loss("cispo").fn(x, inputs, params).sum())(jnp.asarray(lp))
    close(grad, -adv * np.array([0.8, 1.2, 2.0, 2.0]), rtol=1e-12, atol=0)


def test_policy_loss_defaults_and_registry():
    for name, defaults in SEED_DEFAULTS.items():
        assert dict(alg.policy_loss(name).params) == defaults, name
    assert set(alg.policy_loss_names()) >= set(SEED_DEFAULTS)
    with pytest.raises(ValueError, match="tau_pos.*regular|regular.*tau_pos"):
        alg.policy_loss("regular").resolve({"tau_pos": 1.0})
    with pytest.raises(KeyError, match="my_missing_loss"):
        alg.policy_loss("my_missing_loss")
    with pytest.raises(ValueError, match="regular"):
        alg.register_policy_loss("regular", lambda lp, i, p: lp)

    name = "test_scaled_pg"
    try:
        @alg.register_policy_loss(name, params={"scale": 2.0})
        def scaled(lp, inputs, params):
            return -params["scale"] * inputs["advantages"] * lp

        spec = alg.policy_loss(name)
        assert spec.fn is scaled and spec.params == {"scale": 2.0} and name in alg.policy_loss_names()
        inputs = {"old_logprobs": jnp.zeros((2, 3)), "advantages": jnp.ones((2, 3)), "mask": jnp.ones((2, 3)),
                  "selected": jnp.zeros((2, 3))}
        out = jax.vmap(spec.fn, in_axes=(0, 0, None))(jnp.full((2, 3), -0.5), inputs, {"scale": jnp.float32(3.0)})
        close(out, np.full((2, 3), 1.5))
        with pytest.raises(ValueError, match=name):
            alg.register_policy_loss(name, scaled, params={"scale": 1.0})
        alg.register_policy_loss(name, scaled, params={"scale": 5.0}, replace=True)
        assert alg.policy_loss(name).params == {"scale": 5.0}
    finally:
        if name in alg.POLICY_LOSSES:
            alg.unregister_policy_loss(name)
    assert name not in alg.policy_loss_names()


# ---------------------------------------------------------------------------------------------------
# clip_cov / kl_cov token selection and the clip-fraction metric


def cov_batch(seed=11):
    rng = np.random.default_rng(seed)
    m = ragged_mask()
    lp = rng.uniform(-4.0, -0.1, size=m.shape)
    adv = rng.normal(size=m.shape) * 2.5
    old = lp - rng.uniform(-0.5, 0.5, size=m.shape)
    return lp, old, adv, m


def ref_cov(lp, adv, m):
    n = sa = sl = 0.0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if m[b, t] > 0:
                n += 1
                sa += adv[b, t]
                sl += lp[b, t]
    return {(b, t): (adv[b, t] - sa / n) * (lp[b, t] - sl / n)
            for b in range(lp.shape[0]) for t in range(lp.shape[1]) if m[b, t] > 0}


def ref_clip_cov_candidates(lp, old, adv, m, p):
    cands = set()
    for (b, t), c in ref_cov(lp, adv, m).items():
        ratio = math.exp(lp[b, t] - old[b, t]) if old is not None else 1.0
        bounded = max(1 - p["eps_clip_low"], min(1 + p["eps_clip_high"], ratio))
        clipped = -adv[b, t] * bounded > -adv[b, t] * ratio
        if not clipped and p["clip_cov_lb"] < c < p["clip_cov_ub"]:
            cands.add((b, t))
    return cands


@pytest.mark.parametrize("use_old", [False, True])
@pytest.mark.parametrize("clip_ratio", [0.1, 0.5])
def test_clip_cov_selection(use_old, clip_ratio):
    lp, old, adv, m = cov_batch()
    p = alg.policy_loss("clip_cov").resolve({"clip_ratio": clip_ratio, "clip_cov_lb": 0.1})
    old_arg = old if use_old else None
    cands = ref_clip_cov_candidates(lp, old_arg, adv, m, p)
    k = max(int(clip_ratio * m.sum()), 1)
    assert len(cands) >= 6
    if use_old:  # the clipped tokens removed real candidates
        assert len(ref_clip_cov_candidates(lp, None, adv, m, p) - cands) >= 1
    counts = np.zeros(m.shape)
    draws = 300
    for seed in range(draws):
        sel = alg.select_cov_tokens("clip_cov", lp, adv, m, p, np.random.default_rng(seed), old_logprobs_bt=old_arg)
        assert sel.dtype == np.float32 and set(np.unique(sel)) <= {0.0, 1.0}
        chosen = {(int(b), int(t)) for b, t in zip(*np.nonzero(sel))}
        assert chosen <= cands and len(chosen) == min(k, len(cands))
        counts += sel
    again = alg.select_cov_tokens("clip_cov", lp, adv, m, p, np.random.default_rng(3), old_logprobs_bt=old_arg)
    np.testing.assert_array_equal(again, alg.select_cov_tokens("clip_cov", lp, adv, m, p, np.random.default_rng(3),
                                                               old_logprobs_bt=old_arg))
    # uniform: every candidate is chosen with probability min(k, n) / n
    expect = min(k, len(cands)) / len(cands)
    freq = [counts[bt] / draws for bt in cands]
    assert max(abs(f - expect) for f in freq) < 0.12


def test_clip_cov_selection_edge_cases():
    lp, old, adv, m = cov_batch()
    p = alg.policy_loss("clip_cov").resolve({"clip_cov_lb": 1e6, "clip_cov_ub": 2e6})
    assert alg.select_cov_tokens("clip_cov", lp, adv, m, p, np.random.default_rng(0)).sum() == 0
    p = alg.policy_loss("clip_cov").resolve({"clip_cov_lb": -1e9, "clip_cov_ub": 1e9})  # default clip_ratio: k = 1
    assert alg.select_cov_tokens("clip_cov", lp, adv, m, p, np.random.default_rng(0)).sum() == 1
    with pytest.raises(ValueError, match="rng"):
        alg.select_cov_tokens("clip_cov", lp, adv, m, p, None)
    with pytest.raises(ValueError, match="regular"):
        alg.select_cov_tokens("regular", lp, adv, m, {}, None)


@pytest.mark.parametrize("frac", [0.2, 0.5, 0.0])
def test_kl_cov_selection(frac):
    lp, _, adv, m = cov_batch(12)
    cov = ref_cov(lp, adv, m)
    k = max(1, int(len(cov) * frac))
    order = sorted(cov, key=lambda bt: -cov[bt])
    want = np.zeros(m.shape)
    for bt in order[:k]:
        want[bt] = 1.0
    got = alg.select_cov_tokens("kl_cov", lp, adv, m, {"kl_cov_frac": frac}, None)
    np.testing.assert_array_equal(got, want)
    assert np.all(got[m == 0] == 0)


def ref_clip_fraction(name, lp, old, adv, m, p, sel=None):
    hit = n = 0.0
    for b in range(lp.shape[0]):
        s = ref_seq_log_ratio(lp[b], old[b], m[b])
        for t in range(lp.shape[1]):
            if m[b, t] == 0:
                continue
            n += m[b, t]
            a = adv[b, t]
            if name == "cispo":
                r = math.exp(max(-20, min(20, lp[b, t] - old[b, t])))
                hit += m[b, t] * (r < 1 - p["cispo_eps_clip_low"] or r > 1 + p["cispo_eps_clip_high"])
            elif name == "clip_cov":
                hit += m[b, t] * sel[b, t]
            elif name in ("regular", "dual_clip", "gspo"):
                r = math.exp(min(s, 10.0)) if name == "gspo" else math.exp(max(-20, min(20, lp[b, t] - old[b, t])))
                c = max(1 - p["eps_clip_low"], min(1 + p["eps_clip_high"], r))
                hit += m[b, t] * (-c * a > -r * a)
    return hit / max(n, 1.0)


@pytest.mark.parametrize("name", ["regular", "dual_clip", "gspo", "cispo", "clip_cov", "sapo", "kl_cov"])
def test_clip_fraction(name):
    p = alg.policy_loss(name).resolve(PARAMS[name])
    lp, old, adv, m, sel, _ = policy_batch(name, p, seed=3)
    got = alg.clip_fraction(name, lp, old, adv, m, PARAMS[name], selected_bt=sel)
    want = ref_clip_fraction(name, lp, old, adv, m, p, sel)
    close(got, want, rtol=1e-12, atol=0)
    if name in ("sapo", "kl_cov"):
        assert got == 0.0
    else:
        assert 0.02 < got < 0.98


# ---------------------------------------------------------------------------------------------------
# loss reduction


def ref_reduce(kind, loss, m, max_seq_len=None):
    rows = loss.shape[0]
    if kind == "token_mean":
        num = den = 0.0
        for b in range(rows):
            for t in range(loss.shape[1]):
                num += loss[b, t] * m[b, t]
                den += m[b, t]
        return num / max(den, 1.0)
    total = 0.0
    for b in range(rows):
        row = sum(loss[b, t] * m[b, t] for t in range(loss.shape[1]))
        if kind == "sequence_mean":
            total += row / max(sum(m[b]), 1.0)
        else:
            total += row / max_seq_len
    return total / rows


@pytest.mark.parametrize("kind", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"])
def test_reduction_weights(kind):
    rng = np.random.default_rng(13)
    m = ragged_mask()
    m[0, 2] = 0.0  # an observation token inside a response
    loss = rng.normal(size=m.shape) + 0.3
    w = alg.reduction_weights(kind, m, max_seq_len=20)
    assert w.dtype == np.float32 and np.all(w[m == 0] == 0)
    close(np.sum(loss * w.astype(np.float64)), ref_reduce(kind, loss, m, 20), rtol=1e-6, atol=1e-7)
    # exact under gradient accumulation: the mini-batch weights split over micro-batches sum to the same
    parts = sum(np.sum(loss[s] * w[s]) for s in (slice(0, 3), slice(3, 8)))
    close(parts, ref_reduce(kind, loss, m, 20), rtol=1e-6, atol=1e-7)


def test_reduction_errors_and_kl_weights():
    m = ragged_mask()
    with pytest.raises(ValueError, match="max_seq_len"):
        alg.reduction_weights("seq_mean_token_sum_norm", m, None)
    with pytest.raises(ValueError, match="prompt_mean"):
        alg.reduction_weights("prompt_mean", m)
    kl = np.random.default_rng(1).uniform(size=m.shape)
    close(np.sum(kl * alg.sequence_mean_weights(m)), ref_reduce("sequence_mean", kl, m), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# off-policy correction


def ref_off_policy(cfg, old, roll, mask):
    """The four steps of spec 2.7, row by row, token by token."""
    m = mask.copy()
    rows, cols = m.shape
    rho = [[math.exp(max(-20.0, min(20.0, old[b, t] - roll[b, t]))) for t in range(cols)] for b in range(rows)]
    stats = {"outlier_rows": 0, "token_masked": 0, "seq_masked": 0}
    lo, hi = cfg["outlier_token_is_threshold_low"], cfg["outlier_token_is_threshold_high"]
    if lo is not None or hi is not None:
        for b in range(rows):
            bad = any(m[b, t] > 0 and ((hi is not None and rho[b][t] > hi) or (lo is not None and rho[b][t] < lo))
                      for t in range(cols))
            if bad:
                stats["outlier_rows"] += 1
                m[b, :] = 0.0
    lo, hi = cfg["token_mask_is_threshold_low"], cfg["token_mask_is_threshold_high"]
    if lo is not None:
        for b in range(rows):
            for t in range(cols):
                if m[b, t] > 0 and not (lo <= rho[b][t] <= hi):
                    m[b, t] = 0.0
                    stats["token_masked"] += 1
    tis = np.ones_like(m)
    for b in range(rows):
        log_sum = sum((old[b, t] - roll[b, t]) * m[b, t] for t in range(cols))
        if cfg["tis_ratio_type"] == "token":
            for t in range(cols):
                tis[b, t] = min(rho[b][t], cfg["token_tis_ratio_clip_high"])
        elif cfg["tis_ratio_type"] == "sequence":
            tis[b, :] = min(math.exp(max(-20.0, min(20.0, log_sum))), cfg["sequence_tis_ratio_clip_high"])
    for b in range(rows):
        log_sum = sum((old[b, t] - roll[b, t]) * m[b, t] for t in range(cols))
        n = sum(m[b])
        if cfg["sequence_mask_metric"] == "geometric":
            g = math.exp(max(-20.0, min(20.0, log_sum / max(n, 1.0))))
            keep = cfg["geo_mask_low"] <= g <= cfg["geo_mask_high"]
        elif cfg["sequence_mask_metric"] == "product":
            g = math.exp(max(-20.0, min(20.0, log_sum)))
            keep = cfg["product_mask_low"] <= g <= cfg["product_mask_high"]
        else:
            keep = True
        if not keep:
            m[b, :] = 0.0
            stats["seq_masked"] += 1
    return tis, m, stats


OFF_POLICY_CASES = {
    "token_tis": {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.5},
    "sequence_tis": {"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 3.0},
    "geometric": {"sequence_mask_metric": "geometric", "geo_mask_low": 0.9, "geo_mask_high": 1.1},
    "product": {"sequence_mask_metric": "product"},
    "outlier": {"outlier_token_is_threshold_low": 0.2, "outlier_token_is_threshold_high": 4.0},
    "outlier_high_only": {"outlier_token_is_threshold_high": 4.0},
    "token_mask": {"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0},
    "all": {"outlier_token_is_threshold_low": 0.1, "outlier_token_is_threshold_high": 6.0,
            "token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0,
            "tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 3.0,
            "sequence_mask_metric": "geometric", "geo_mask_low": 0.9, "geo_mask_high": 1.1},
}


def off_policy_batch():
    rng = np.random.default_rng(21)
    m = ragged_mask()
    old = rng.uniform(-3, -0.1, size=m.shape)
    d = rng.normal(scale=0.3, size=m.shape)
    d[1, 2], d[4, 5], d[6, 0], d[0, 3] = 2.2, -2.6, 1.0, -0.9  # outliers and token-mask hits
    d[5, 1], d[0, 6] = math.log(0.48), math.log(2.1)  # just outside the token-mask bounds [0.5, 2]
    return old, old - d, m


@pytest.mark.parametrize("case", list(OFF_POLICY_CASES))
def test_off_policy_correction(case):
    old, roll, m = off_policy_batch()
    cfg = alg.OffPolicyCorrection(**OFF_POLICY_CASES[case])
    assert cfg.enabled
    ref_cfg = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
    want_tis, want_m, stats = ref_off_policy(ref_cfg, old, roll, m)
    tis, new_m, metrics = alg.apply_off_policy_correction(cfg, old, roll, m)
    assert tis.dtype == np.float32 and new_m.dtype == np.float32
    close(tis, want_tis)
    np.testing.assert_array_equal(new_m, want_m)
    # the data exercises each enabled step
    if cfg.outlier_enabled:
        assert stats["outlier_rows"] >= 1
        close(metrics["outlier_seq_masked_ratio"], stats["outlier_rows"] / B, rtol=1e-12, atol=0)
    if cfg.token_mask_enabled:
        assert stats["token_masked"] >= 1
    if cfg.sequence_mask_metric:
        assert stats["seq_masked"] >= 1
        key = ("geo" if cfg.sequence_mask_metric == "geometric" else "product") + "_sequence_mask_masked_ratio"
        close(metrics[key], stats["seq_masked"] / B, rtol=1e-12, atol=0)
    if cfg.tis_ratio_type == "token":
        assert (want_tis == 1.5).sum() >= 1 and metrics["tis_token_clip_high_ratio"] > 0
    if cfg.tis_ratio_type == "sequence":
        assert len({round(float(x), 9) for x in want_tis[:, 0]}) >= 3
    valid = [math.exp(old[b, t] - roll[b, t]) for b in range(B) for t in range(T) if m[b, t] > 0]
    close(metrics["is_ratio_mean"], sum(valid) / len(valid), rtol=1e-12, atol=0)
    close(metrics["is_ratio_max"], max(valid), rtol=1e-12, atol=0)


def test_off_policy_correction_noop_and_validation():
    old, roll, m = off_policy_batch()
    cfg = alg.OffPolicyCorrection()
    assert not cfg.enabled and cfg.token_tis_ratio_clip_high == 2.0 and cfg.sequence_tis_ratio_clip_high == 5.0
    assert (cfg.geo_mask_high, cfg.geo_mask_low, cfg.product_mask_high, cfg.product_mask_low) == (1.01, 0.99, 2.0, 0.5)
    tis, new_m, metrics = alg.apply_off_policy_correction(cfg, old, roll, m)
    assert np.all(tis == 1.0) and np.array_equal(new_m, m) and metrics == {}
    with pytest.raises(ValueError, match="tis_ratio_type"):
        alg.OffPolicyCorrection(tis_ratio_type="tokens")
    with pytest.raises(ValueError, match="sequence_mask_metric"):
        alg.OffPolicyCorrection(sequence_mask_metric="arith")
    with pytest.raises(ValueError, match="token_mask_is_threshold"):
        alg.OffPolicyCorrection(token_mask_is_threshold_low=0.5)


# ---------------------------------------------------------------------------------------------------
# filters, KL controller, KL in reward


def test_zero_variance_and_dynamic_sampling_filters():
    scores = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.1, 0.1, 0.1, 2.0])
    groups = ["a", "a", "a", "b", "b", "c", "d", "d", "d", "e"]
    members = groups_of(groups)

    def all_equal(g):
        return len({scores[b] for b in members[g]}) == 1

    want_keep = np.array([not (len(members[g]) > 1 and all_equal(g)) for g in groups])
    np.testing.assert_array_equal(alg.zero_variance_mask(scores, groups), want_keep)
    assert list(want_keep) == [False] * 3 + [True] * 3 + [False] * 3 + [True]
    # np.std of three 0.1s is not exactly 0; tx tests exact equality instead
    assert np.std(scores[6:9]) != 0.0

    want_good = np.array([not all_equal(g) for g in groups])
    np.testing.assert_array_equal(alg.dynamic_sampling_filter(scores, groups, n_samples=3), want_good)
    assert not want_good[5]  # a lone sample of a group is not "good" when n_samples > 1
    assert alg.dynamic_sampling_filter(scores, groups, n_samples=1).all()


def test_kl_controller():
    fixed = alg.KLController("fixed", init_coef=0.05)
    fixed.update(10.0, 64)
    assert fixed.value == 0.05

    ctl = alg.KLController("adaptive", init_coef=0.1, kl_target=0.2, horizon=500)
    beta = 0.1
    for current, n in [(1.0, 64), (0.21, 32), (0.0, 16), (0.15, 8)]:
        ctl.update(current, n)
        err = current / 0.2 - 1
        err = 0.2 if err > 0.2 else (-0.2 if err < -0.2 else err)
        beta = beta * (1 + err * n / 500)
        close(ctl.value, beta, rtol=1e-12, atol=0)
    assert ctl.value != 0.1
    with pytest.raises(ValueError, match="horizon"):
        alg.KLController("adaptive", horizon=0)
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        alg.KLController("pid")


@pytest.mark.parametrize("coef", [0.3, -0.2])
def test_apply_kl_in_reward(coef):
    rng = np.random.default_rng(31)
    m = ragged_mask()
    r = token_rewards(rng)
    kl = rng.uniform(-0.1, 0.5, size=m.shape)
    got_r, got_kl = alg.apply_kl_in_reward(r, kl, m, coef)
    beta = max(0.0, coef)
    want_r = np.zeros_like(r)
    per_row = []
    for b in range(B):
        s = n = 0.0
        for t in range(T):
            k = kl[b, t] * m[b, t]
            want_r[b, t] = r[b, t] - beta * k
            s += k
            n += m[b, t]
        per_row.append(s / max(n, 1.0))
    close(got_r, want_r)
    close(got_kl, sum(per_row) / B, rtol=1e-12, atol=0)
    assert coef > 0 or np.array_equal(got_r, r.astype(np.float32))


# ---------------------------------------------------------------------------------------------------
# the critic's value loss


def ref_value_loss(v, old, ret, clip):
    """Per token, in loops: 0.5 * max((old + clip(v - old) - R)^2, (v - R)^2), or 0.5 * (v - R)^2 without clip;
    its derivative in v (the clipped branch has slope 0 where v - old is outside [-clip, clip])."""
    loss, grad = np.zeros_like(v), np.zeros_like(v)
    for i in np.ndindex(v.shape):
        plain = (v[i] - ret[i]) ** 2
        if clip <= 0:
            loss[i], grad[i] = 0.5 * plain, v[i] - ret[i]
            continue
        inside = -clip <= v[i] - old[i] <= clip
        vc = v[i] if inside else old[i] + (clip if v[i] > old[i] else -clip)
        clipped = (vc - ret[i]) ** 2
        if clipped > plain:
            loss[i], grad[i] = 0.5 * clipped, (vc - ret[i]) if inside else 0.0
        else:
            loss[i], grad[i] = 0.5 * plain, v[i] - ret[i]
    return loss, grad


@pytest.mark.parametrize("clip", [0.2, 0.0])
def test_value_loss_and_clip_fraction(clip):
    rng = np.random.default_rng(21)
    old = rng.normal(size=(B, T))
    v = old + rng.uniform(-0.6, 0.6, (B, T))  # about half outside the clip range
    ret = old + rng.normal(scale=0.5, size=(B, T))
    m = ragged_mask()
    want, want_grad = ref_value_loss(v, old, ret, clip)
    with jax.enable_x64(True):
        got = alg.value_loss(v, old, ret, clip)
        got_grad = jax.grad(lambda x: jnp.sum(alg.value_loss(x, old, ret, clip)))(jnp.asarray(v))
    close(got, want, rtol=1e-9, atol=1e-12)
    close(got_grad, want_grad, rtol=1e-9, atol=1e-12)
    n_clipped = sum(m[i] * (0.5 * (v[i] - ret[i]) ** 2 < want[i]) for i in np.ndindex(v.shape))
    assert (n_clipped > 5) == (clip > 0)  # both branches are exercised
    assert alg.value_clip_fraction(v, old, ret, m, clip) == pytest.approx(n_clipped / m.sum(), abs=1e-12)
