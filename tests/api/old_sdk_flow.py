"""The basic Tinker flow, run as a script under whichever `tinker` package comes first on sys.path (an
older SDK installed with `pip install --target DIR`, put first on PYTHONPATH by tests/api/test_old_sdks.py).

    python tests/api/old_sdk_flow.py URL API_KEY EXPECTED_VERSION

create LoRA training client -> forward_backward -> optim_step (a few steps) -> forward ->
save_weights_for_sampler -> sample (named checkpoint and in-memory snapshot). Prints one JSON line with
what the test checks; anything wrong raises (non-zero exit).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tinker
from tinker import types as T

SEQ_LEN, ROWS, STEPS = 12, 3, 4


def main(url: str, api_key: str, expected_version: str) -> None:
    if tinker.__version__ != expected_version:
        raise SystemExit(f"imported tinker {tinker.__version__} from {tinker.__file__}, expected {expected_version}")
    service = tinker.ServiceClient(base_url=url, api_key=api_key)
    caps = service.get_server_capabilities()
    name = caps.supported_models[0].model_name
    tc = service.create_lora_training_client(base_model=name, rank=8, seed=0)
    model_id = tc.get_info().model_id
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, 500, (ROWS, SEQ_LEN + 1))
    data = [T.Datum(model_input=T.ModelInput.from_ints(s[:-1].tolist()),
                    loss_fn_inputs={"target_tokens": s[1:].tolist(), "weights": [1.0] * SEQ_LEN}) for s in seqs]
    losses, first_logprobs = [], None
    for _ in range(STEPS):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(T.AdamParams(learning_rate=1e-2))
        result = fb.result()
        opt.result()
        losses.append(result.metrics["loss:sum"])
        if first_logprobs is None:
            first_logprobs = [list(map(float, out["logprobs"].data)) for out in result.loss_fn_outputs]
    fwd = tc.forward(data, "cross_entropy").result()
    fwd_logprobs = [list(map(float, out["logprobs"].data)) for out in fwd.loss_fn_outputs]
    sampler_path = tc.save_weights_for_sampler("final").result().path
    named = service.create_sampling_client(model_path=sampler_path)
    snapshot = tc.save_weights_and_get_sampling_client()
    prompt = T.ModelInput.from_ints(seqs[0][:6].tolist())
    greedy = T.SamplingParams(max_tokens=5, temperature=0.0)
    a = named.sample(prompt, 2, greedy).result()
    b = snapshot.sample(prompt, 1, greedy).result()
    print(json.dumps({
        "version": tinker.__version__, "model_id": model_id, "losses": losses,
        "first_logprobs": first_logprobs, "forward_loss": fwd.metrics["loss:sum"], "forward_logprobs": fwd_logprobs,
        "sampler_path": sampler_path,
        "named": [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason} for s in a.sequences],
        "snapshot": [{"tokens": s.tokens, "logprobs": s.logprobs} for s in b.sequences],
    }), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
