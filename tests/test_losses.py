"""Built-in losses: per-token values and gradients equal PyTorch autograd on Tinker's formulas, in
clipped and unclipped regions; mixed losses per row; registry errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tx import losses


def torch_reference(name, tlp, slp, adv, w, cfg):
    """Tinker's documented formulas (tinker docs: losses/*), per token."""
    ratio = torch.exp(tlp - slp)
    if name == "cross_entropy":
        return -tlp * w
    if name == "importance_sampling":
        return -ratio * adv
    if name == "ppo":
        clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -torch.min(ratio * adv, clipped * adv)
    if name == "cispo":
        clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -clipped.detach() * tlp * adv
    if name == "dro":
        return -(tlp * adv - 0.5 * cfg["beta"] * (tlp - slp) ** 2)
    raise KeyError(name)


CASES = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5},
    "dro": {"beta": 0.3},
}


@pytest.mark.parametrize("name", list(CASES))
def test_builtin_values_and_gradients(name):
    rng = np.random.default_rng(0)
    t = 64
    slp = rng.uniform(-4, -0.1, t).astype(np.float32)
    # ratios from 0.3 to 3: both sides of every clip range are exercised
    tlp = (slp + rng.uniform(np.log(0.3), np.log(3.0), t)).astype(np.float32)
    adv = rng.standard_normal(t).astype(np.float32)
    w = rng.uniform(0, 1, t).astype(np.float32)
    ratio = np.exp(tlp - slp)
    if name == "ppo":
        assert (ratio < 0.8).any() and (ratio > 1.2).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
    cfg = losses.resolve_config(name, CASES[name])
    spec = losses.get(name)
    inputs = {"weights": jnp.asarray(w), "logprobs": jnp.asarray(slp), "advantages": jnp.asarray(adv)}
    jcfg = {k: jnp.float32(v) for k, v in cfg.items()}
    got = spec.fn(jnp.asarray(tlp), inputs, jcfg)
    got_grad = jax.grad(lambda x: spec.fn(x, inputs, jcfg).sum())(jnp.asarray(tlp))

    tlp_t = torch.tensor(tlp, dtype=torch.float64, requires_grad=True)
    want = torch_reference(name, tlp_t, torch.tensor(slp, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
                           torch.tensor(w, dtype=torch.float64), cfg)
    want.sum().backward()
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_grad), tlp_t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_mixed_rows_and_isolation_from_non_finite_branches():
    """Rows pick their own loss and config; a row's huge sampling logprob that would overflow another
    loss's exp() never reaches the rows that do not use it."""
    t = 5
    tlp = jnp.full((3, t), -1.0)
    inputs = {
        "weights": jnp.ones((3, t)),
        "logprobs": jnp.array([[-200.0] * t, [-1.5] * t, [-0.5] * t]),  # row 0: exp(199) overflows
        "advantages": jnp.ones((3, t)),
    }
    names = losses.names()
    keys = losses.config_keys()
    cfg = np.zeros((3, len(keys)), np.float32)
    for b, (name, conf) in enumerate([("cross_entropy", {}), ("ppo", {"clip_high_threshold": 1.1}), ("dro", {})]):
        for k, v in losses.resolve_config(name, conf).items():
            cfg[b, keys.index(k)] = v
    index = jnp.array([names.index("cross_entropy"), names.index("ppo"), names.index("dro")])

    def total(x):
        return losses.per_token_losses(x, inputs, index, jnp.asarray(cfg), names, keys).sum()

    per_token = losses.per_token_losses(tlp, inputs, index, jnp.asarray(cfg), names, keys)
    np.testing.assert_allclose(per_token[0], 1.0)  # cross-entropy: -(-1) * 1
    np.testing.assert_allclose(per_token[1], -min(np.exp(0.5), 1.1))  # ppo clipped high at 1.1
    np.testing.assert_allclose(per_token[2], -(-1.0 - 0.5 * 0.05 * 0.25), rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(jax.grad(total)(tlp))))


def test_registry_errors():
    with pytest.raises(KeyError, match="unknown loss function 'nope'"):
        losses.get("nope")
    with pytest.raises(ValueError, match="'clip_ratio' is not accepted by loss 'ppo'"):
        losses.resolve_config("ppo", {"clip_ratio": 0.2})
    with pytest.raises(ValueError, match="already registered"):
        losses.register("ppo", lambda t, i, c: t)


def torch_gspo(tlp, slp, adv, mask, cfg):
    """Tinker's GSPO page (tinker-docs.thinkingmachines.ai/tinker/losses/gspo), GSPO-token of Zheng et al.
    2025, written here with torch: the sequence log-ratio is the mean over the masked tokens of
    detach(tlp) - slp; each token's ratio has that value and its own log-prob's gradient."""
    in_ratio = mask != 0
    log_ratio = (tlp.detach() - slp)[in_ratio].mean()
    ratio = torch.exp(log_ratio + tlp - tlp.detach())
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.min(ratio * adv, clipped * adv)


def torch_stable_reinforce(tlp, q, adv, mask, cfg):
    """tx's stable_reinforce (its docstring), in torch: truncated-IS REINFORCE + quadratic penalty against
    the recorded sampler log-probs q on recorded positions."""
    delta = torch.where(mask != 0, tlp - q, torch.zeros_like(tlp))
    weight = torch.clamp(torch.exp(delta), max=cfg["clip_high_threshold"]).detach()
    return -weight * adv * tlp + cfg["kl_coeff"] * 0.5 * delta**2


@pytest.mark.parametrize("name,conf,spread", [
    ("gspo", {}, 1e-4),  # default (paper) clip ranges: ratios on both sides of 1 - 3e-4 / 1 + 4e-4
    ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, 0.5),
    ("stable_reinforce", {}, 1.5),
    ("stable_reinforce", {"kl_coeff": 0.3, "clip_high_threshold": 1.5}, 1.5),
])
def test_sequence_losses_values_and_gradients(name, conf, spread):
    cfg = losses.resolve_config(name, conf)
    jcfg = {k: jnp.float32(v) for k, v in cfg.items()}
    spec = losses.get(name)
    ref = torch_gspo if name == "gspo" else torch_stable_reinforce
    for seed in range(6):  # several sequences: clipped above, below and not at all
        rng = np.random.default_rng(seed)
        t = 40
        slp = rng.uniform(-4, -0.1, t).astype(np.float32)
        tlp = (slp + rng.uniform(-spread, spread, t) + rng.uniform(-spread, spread)).astype(np.float32)
        mask = np.r_[np.zeros(8), np.ones(t - 8)].astype(np.float32)  # prompt positions out of the ratio
        adv = np.r_[np.zeros(8), np.full(t - 8, rng.standard_normal())].astype(np.float32)
        adv[-5:] = rng.standard_normal(5)  # per-token advantages work too
        inputs = {"weights": jnp.zeros(t), "logprobs": jnp.asarray(slp), "advantages": jnp.asarray(adv),
                  "sequence_ratio_mask": jnp.asarray(mask)}
        got = spec.fn(jnp.asarray(tlp), inputs, jcfg)
        got_grad = jax.grad(lambda x: spec.fn(x, inputs, jcfg).sum())(jnp.asarray(tlp))
        tlp_t = torch.tensor(tlp, dtype=torch.float64, requires_grad=True)
        want = ref(tlp_t, torch.tensor(slp, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
                   torch.tensor(mask), cfg)
        want.sum().backward()
        np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_grad), tlp_t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_gspo_sequence_ratio_is_per_row():
    """Two rows in one batch: the second row's log-probs and inputs change neither the first row's loss
    nor its gradient (the sequence mean never crosses datums)."""
    names, keys = losses.names(), losses.config_keys()
    cfg = np.zeros((2, len(keys)), np.float32)
    for k, v in losses.resolve_config("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}).items():
        cfg[:, keys.index(k)] = v
    index = jnp.full(2, names.index("gspo"))
    rng = np.random.default_rng(3)
    slp = jnp.asarray(rng.uniform(-3, -0.5, (2, 12)), jnp.float32)
    inputs = {"weights": jnp.zeros((2, 12)), "logprobs": slp, "advantages": jnp.ones((2, 12)),
              "sequence_ratio_mask": jnp.ones((2, 12))}

    def row0(x, second):
        tlp = jnp.stack([x, second])
        return losses.per_token_losses(tlp, inputs, index, jnp.asarray(cfg), names, keys)[0].sum()

    x = slp[0] + 0.1
    for second in (slp[1] + 0.3, slp[1] - 2.0):
        np.testing.assert_allclose(row0(x, second), -12 * np.exp(0.1), rtol=1e-6)
        np.testing.assert_allclose(jax.grad(row0)(x, second), -np.exp(0.1), rtol=1e-6)


def test_two_d_targets_only_for_multi_target_losses():
    assert losses.get("cross_entropy").multi_target
    assert not any(losses.get(n).multi_target for n in ("ppo", "gspo", "stable_reinforce"))
