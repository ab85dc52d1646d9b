"""Full fine-tuning through the official SDK against `python -m tx.run --training-mode full`: the
capabilities name the mode, rank 0 is accepted, a second model is refused naming the live one, and the
training flow (forward_backward, optim_step, save_state / load_state_with_optimizer, save_weights_for_sampler,
sampling, compute_logprobs) works on the trained weights."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types as T

from tests.api import sdk_flows
from tests.api.server_proc import API_KEY, Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_dirs):
    srv = Server(tmp_path_factory.mktemp("full"), "--training-mode", "full", "--mixed-precision", "fp32",
                 base_model=tiny_dirs["dense"])
    yield srv
    srv.stop()


def test_sdk_flow_in_full_mode(server):
    caps = server.get("/api/v1/get_server_capabilities").json()
    assert caps["supported_models"][0]["training_mode"] == "full"
    sc = sdk_flows.service(server.url)
    name = tinker.RestClient(base_url=server.url, api_key=API_KEY).get_server_capabilities().result() \
        .supported_models[0].model_name
    tc = sc.create_lora_training_client(base_model=name, rank=0).result()
    with pytest.raises(Exception, match=f"model '{tc.get_info().model_id}' is live"):
        sc.create_lora_training_client(base_model=name, rank=8).result()

    data = sdk_flows.datums(0)
    losses = sdk_flows.train_steps(tc, data, 3, lr=1e-3)
    assert losses[-1] < 0.9 * losses[0], losses

    # save_state, one step as the reference, load with the optimizer, the same step: equal (exact resume)
    state = tc.save_state("s1").result().path
    before = sdk_flows.logprobs_of(tc.forward(data, "cross_entropy").result())
    sdk_flows.train_steps(tc, data, 1, lr=1e-3)
    after_one = sdk_flows.logprobs_of(tc.forward(data, "cross_entropy").result())
    with pytest.warns(FutureWarning):  # deprecated in the SDK, still part of its API
        tc.load_state_with_optimizer(state).result()
    np.testing.assert_array_equal(sdk_flows.logprobs_of(tc.forward(data, "cross_entropy").result()), before)
    sdk_flows.train_steps(tc, data, 1, lr=1e-3)
    np.testing.assert_array_equal(sdk_flows.logprobs_of(tc.forward(data, "cross_entropy").result()), after_one)

    # sampling the trained weights: a named sampler save and an in-memory one agree; compute_logprobs == forward
    sampler_path = tc.save_weights_for_sampler("s1").result().path
    named = sc.create_sampling_client(model_path=sampler_path).result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    prompt_ids = data[0].model_input.to_ints()[:8]
    prompt = T.ModelInput.from_ints(prompt_ids)
    greedy = T.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    a = named.sample(prompt, 1, greedy).result().sequences[0]
    b = snapshot.sample(prompt, 1, greedy).result().sequences[0]
    assert a.tokens == b.tokens and len(a.tokens) == 6
    scored = snapshot.compute_logprobs(prompt).result()
    ref = tc.forward([T.Datum(model_input=T.ModelInput.from_ints(prompt_ids[:-1]),
                              loss_fn_inputs={"target_tokens": prompt_ids[1:], "weights": [1.0] * 7})],
                     "cross_entropy").result()
    np.testing.assert_allclose(scored[1:], sdk_flows.logprobs_of(ref)[0], atol=1e-4)

    # the base model is being trained: not sampleable; a save older than the last step: refused by name
    base = sc.create_sampling_client(base_model=name).result()
    with pytest.raises(Exception, match="cannot be sampled"):
        base.sample(prompt, 1, greedy).result()
    sdk_flows.train_steps(tc, data, 1, lr=1e-3)
    with pytest.raises(Exception, match="have changed since"):
        named.sample(prompt, 1, greedy).result()
