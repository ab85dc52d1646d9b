"""Drive a running `python -m tx.run` with the official tinker SDK: train a LoRA adapter on a few chat
examples, save it, sample from it.

    python -m tx.run                                   # terminal 1: serves the built-in tiny model
    python examples/tinker_client.py                   # terminal 2
    python examples/tinker_client.py --base-url http://host:8000 --api-key tml-... --steps 20
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

# the client needs only transformers' tokenizer, not PyTorch: drop the "PyTorch was not found" notice
# that transformers logs when it is imported without torch
logging.getLogger("transformers").addFilter(lambda record: "PyTorch was not found" not in record.getMessage())

import tinker  # noqa: E402
from tinker import types  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

DATA = Path(__file__).parent / "data" / "chat_train.jsonl"


def datum(tokenizer, messages: list[dict]) -> types.Datum:
    """Next-token targets over the whole conversation, loss only on the assistant's last reply."""
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": full[1:], "weights": weights})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default="tml-local")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=5e-3)
    args = p.parse_args()

    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    model = tinker.RestClient(base_url=args.base_url, api_key=args.api_key).get_server_capabilities().result()
    base_model = model.supported_models[0].model_name
    training = service.create_lora_training_client(base_model=base_model, rank=args.rank, seed=0).result()
    tokenizer = AutoTokenizer.from_pretrained(training.get_info().model_data.tokenizer_id)
    rows = [json.loads(line)["messages"] for line in DATA.read_text().splitlines()[:8]]
    batch = [datum(tokenizer, messages) for messages in rows]
    for step in range(args.steps):
        start = time.perf_counter()
        fb = training.forward_backward(batch, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=args.learning_rate))
        loss = fb.result().metrics["loss:sum"] / sum(sum(d.loss_fn_inputs["weights"].data) for d in batch)
        opt.result()
        print(json.dumps({"step": step, "loss_per_token": round(loss, 4),
                          "step_time_s": round(time.perf_counter() - start, 3)}), flush=True)
    state = training.save_state("final").result().path
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = tokenizer.apply_chat_template(rows[0][:-1], add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=24, temperature=0.0)).result()
    print(json.dumps({"saved": state, "samples": [tokenizer.decode(s.tokens) for s in out.sequences]}), flush=True)
    service.close("success").result()  # ends the session (the server unloads its adapter)


if __name__ == "__main__":
    main()
