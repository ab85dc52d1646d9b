"""Process 0 of the multi-host tests (also run alone as the single-process reference).

    python tests/distributed/driver.py SCENARIO MODEL_DIR OUT_JSON [COORDINATOR_ADDRESS NUM_PROCESSES]

Scenarios: parity (every backend method; results written as JSON), model_parity (only the calls that run the
model: forward_backward, optim_step, forward, sample), full_parity (the same for full
fine-tuning: steps, forward, sampling, checkpoint save/load, sampler save), faults (errors on workers, files
missing on the worker only, peers without the secret, then normal calls), one_sided (the worker fails
inside a call while process 0 sits in its collective), stop (a SIGSTOPped worker), kill (a worker killed
in the middle of a call).
"""

import json
import os
import signal
import sys
import threading
import time

import jax
import numpy as np

scenario, model_dir, out_path = sys.argv[1:4]
multi = len(sys.argv) > 4
if multi:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[4], num_processes=int(sys.argv[5]), process_id=0)
    jax.devices()  # every process must bring up its backend (topology exchange) before anything waits

from tests.helpers import TESTS_CPU_MOE_IMPL  # noqa: E402
from tx import types  # noqa: E402
from tx.backends.config import JaxBackendConfig  # noqa: E402
from tx.distributed.backend import DistributedBackend  # noqa: E402
from tx.distributed.auth import resolve_secret, split_address  # noqa: E402
from tx.distributed.control import Coordinator, RemoteError, WorkerFailure  # noqa: E402

SP = types.SamplingParams
# MoE models (DeepSeek-V3) run the tests' CPU MoE kernel (tests/helpers.py); the config reaches the worker host
COMMON = dict(fully_sharded_data_parallel_size=2, expert_parallel_size=2, tensor_parallel_size=2,
              moe_impl=TESTS_CPU_MOE_IMPL)
if scenario == "full_parity":  # full fine-tuning: every base weight trained, float32
    config = JaxBackendConfig(training_mode="full", mixed_precision="fp32", max_seq_len=64, **COMMON)
else:
    config = JaxBackendConfig(max_lora_adapters=5, max_lora_rank=4, max_seq_len=64, **COMMON)
coordinator = None
if multi:
    host, port = split_address(sys.argv[4])
    secret = resolve_secret(secret=None, secret_file=None, host=host, port=port + 1, coordinator=True)
    coordinator = Coordinator(host, port + 1, int(sys.argv[5]) - 1, secret, heartbeat_timeout=3.0, connect_timeout=120)
backend = DistributedBackend(model_dir, config, coordinator, run_id="test")
results = {}


def train_batch(seed):
    rng = np.random.default_rng(seed)
    ids, tg, mids, slices = [], [], [], []
    for rid, mid, lens in [("ra", "a", [12, 7]), ("rb", "b", [9, 5, 3])]:
        start = len(ids)
        for n in lens:
            s = rng.integers(0, 512, n + 1).tolist()
            ids.append(s[:-1]), tg.append(s[1:]), mids.append(mid)
        slices.append((rid, mid, start, len(ids)))
    n = len(ids)
    return types.PreparedModelPassBatch(all_input_ids=ids, all_targets=tg, all_token_weights=[[1.0] * len(x) for x in ids],
                                        all_sampling_logprobs=[[]] * n, all_advantages=[[]] * n, all_model_ids=mids,
                                        all_loss_fns=["cross_entropy"] * n, all_loss_fn_configs=[None] * n,
                                        request_batch_slices=slices)


def logprobs(out):
    return {rid: [o["logprobs"].data for o in r.loss_fn_outputs] for rid, r in out.items()}


def forward_as(model_map, seed=7):
    batch = train_batch(seed)
    batch.all_model_ids = [model_map.get(m, m) for m in batch.all_model_ids]
    batch.request_batch_slices = [(r, model_map.get(m, m), s, e) for r, m, s, e in batch.request_batch_slices]
    return logprobs(backend.forward(batch))


def sample_batch(path=""):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = [SP(max_tokens=6, temperature=0.0, stop=[]), SP(max_tokens=5, temperature=1.0, seed=3), SP(max_tokens=4, temperature=0.8, top_p=0.9, seed=4)]
    models = ["a", "b", ""]
    return types.PreparedSampleBatch(all_prompts=prompts, all_sampling_params=params, all_model_ids=models,
                                     all_checkpoint_ids=[""] * 3, all_checkpoint_paths=[path] * 3 if path else [""] * 3,
                                     request_batch_slices=[(f"s{i}", models[i], i, i + 1, True, 2) for i in range(3)])


def samples(out):
    return {rid: {"tokens": [s.tokens for s in r.sequences], "logprobs": [s.logprobs for s in r.sequences],
                  "prompt": r.prompt_logprobs[1:]} for rid, r in out.items()}


def intruders(coordinator) -> dict[str, bool]:
    """Peers without the secret: is each one disconnected by process 0 (without being welcomed)?"""
    import socket

    from tx.distributed import auth
    from tx.distributed.rpc import Channel

    refused = {}
    for attempt in ("garbage", "no-mac", "wrong-secret"):
        channel = Channel(socket.create_connection(coordinator.address, timeout=30))
        try:
            if attempt == "wrong-secret":
                auth.join(channel, b"not the secret", {"process_id": 1, "pid": 0, "losses": []})
                refused[attempt] = False  # welcomed
                continue
            assert channel.recv()["type"] == "challenge"
            if attempt == "garbage":
                channel.sock.sendall(b"\xff" * 64)
            else:
                channel.send({"type": "hello", "process_id": 1, "pid": 0, "losses": [], "nonce": "00"})
            refused[attempt] = channel.recv() is None
        except (auth.AuthError, ConnectionResetError):
            refused[attempt] = True
        finally:
            channel.close()
    return refused


def timed_failure(fn):
    start = time.monotonic()
    try:
        fn()
    except WorkerFailure as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


if scenario in ("parity", "model_parity"):
    backend.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=1))
    backend.create_model("b", types.LoraConfig(rank=2, alpha=4, seed=2, train_attn=False))
    out = backend.forward_backward(train_batch(0))
    results["fb"] = logprobs(out)
    results["fb_loss"] = {k: v.metrics["loss:sum"] for k, v in out.items()}
    results["optim"] = [backend.optim_step(m, types.OptimStepInput(adam_params=types.AdamParams(learning_rate=5e-2, weight_decay=0.1))).metrics["grad_norm"] for m in "ab"]
    results["forward"] = forward_as({})
    results["sample"] = samples(backend.sample(sample_batch()))
    if scenario == "parity":  # the calls that move adapter state between hosts and files, the same for every model
        ckpt = os.path.join(os.path.dirname(out_path), f"ckpt-{os.getpid()}")
        backend.save_checkpoint(ckpt, "a")
        backend.create_model("c", types.LoraConfig(rank=4, alpha=8, seed=9))
        backend.load_checkpoint(ckpt, "c")
        results["restored"] = forward_as({"a": "c"})
        backend.save_sampler_checkpoint(ckpt + ".tar.gz", "a")
        results["sample_ckpt"] = samples(backend.sample(sample_batch(ckpt + ".tar.gz")))
        backend.delete_model("b")
        backend.create_model("d", types.LoraConfig(rank=2, alpha=4, seed=2, train_attn=False))
        results["recreated"] = forward_as({"b": "d"})
elif scenario == "full_parity":
    def step(seed):
        batch = train_batch(seed)
        batch.all_model_ids = ["m"] * len(batch.all_model_ids)
        batch.request_batch_slices = [(r, "m", s, e) for r, _, s, e in batch.request_batch_slices]
        loss = {k: v.metrics["loss:sum"] for k, v in backend.forward_backward(batch).items()}
        adam = types.AdamParams(learning_rate=1e-3, weight_decay=0.1, grad_clip_norm=1.0)
        return loss, backend.optim_step("m", types.OptimStepInput(adam_params=adam)).metrics["grad_norm"]

    def sample_m(path=""):
        batch = sample_batch(path)
        batch.all_model_ids = ["m"] * 3
        batch.request_batch_slices = [(r, "m", s, e, p, k) for r, _, s, e, p, k in batch.request_batch_slices]
        return samples(backend.sample(batch))

    backend.create_model("m", types.LoraConfig(rank=0))
    results["step1"] = step(0)
    results["forward"] = forward_as({"a": "m", "b": "m"})
    results["sample"] = sample_m()
    ckpt = os.path.join(os.path.dirname(out_path), f"full-ckpt-{os.getpid()}")
    backend.save_checkpoint(ckpt, "m")
    results["step2"] = step(1)
    backend.load_checkpoint(ckpt, "m")
    results["restored"] = forward_as({"a": "m", "b": "m"})
    results["step2_again"] = step(1)
    backend.save_sampler_checkpoint(ckpt + ".tar", "m")
    results["sample_ckpt"] = sample_m(ckpt + ".tar")
elif scenario == "faults":
    backend.create_model("a", types.LoraConfig(rank=4, seed=1))
    backend.create_model("b", types.LoraConfig(rank=2, seed=2))
    results["refused"] = intruders(coordinator)
    errors = []
    try:
        backend.debug_fail("injected in prepare", [1], phase="prepare")
    except RemoteError as e:
        errors.append(str(e))
    results["after_prepare"] = forward_as({})
    # Relative paths: process 0 runs in the output directory, which holds them; the worker runs elsewhere.
    os.chdir(os.path.dirname(out_path))
    backend.save_checkpoint(os.path.abspath("ckpt-here"), "a")
    backend.save_sampler_checkpoint(os.path.abspath("sampler-here.tar.gz"), "a")
    for call in (lambda: backend.load_checkpoint("ckpt-here", "b"), lambda: backend.sample(sample_batch("sampler-here.tar.gz"))):
        try:
            call()
        except RemoteError as e:
            errors.append(str(e))
    results["after_missing"] = forward_as({})
    try:
        backend.create_model("a", types.LoraConfig(rank=2))
    except ValueError as e:
        errors.append(f"local: {e}")
    results["errors"] = errors
    results["final"] = forward_as({})
    results["refused_later"] = intruders(coordinator)
    results["bound"] = list(coordinator.address)
elif scenario == "one_sided":  # the worker runs with TX_DEBUG_FAIL_CALL=forward
    backend.create_model("a", types.LoraConfig(rank=4, seed=1))
    results["failure"] = timed_failure(lambda: forward_as({}))
    results["later"] = timed_failure(lambda: backend.create_model("z", types.LoraConfig(rank=1)))
    backend.shutdown(reason=results["failure"]["error"])  # what tx.run does before os._exit
elif scenario == "stop":
    backend.create_model("a", types.LoraConfig(rank=4, seed=1))
    worker = next(iter(coordinator.workers.values()))
    os.kill(worker.pid, signal.SIGSTOP)
    results["failure"] = timed_failure(lambda: forward_as({"b": "a"}))
    results["later"] = timed_failure(lambda: backend.create_model("z", types.LoraConfig(rank=1)))
    os.kill(worker.pid, signal.SIGKILL)
elif scenario == "kill":
    backend.create_model("a", types.LoraConfig(rank=4, seed=1))
    worker = next(iter(coordinator.workers.values()))
    threading.Timer(0.3, lambda: os.kill(worker.pid, signal.SIGKILL)).start()

    def many_calls():
        for i in range(200):
            forward_as({"b": "a"}, seed=i)

    results["failure"] = timed_failure(many_calls)
else:
    raise SystemExit(f"unknown scenario {scenario}")

with open(out_path, "w") as f:
    json.dump(results, f)
if scenario in ("parity", "model_parity", "full_parity", "faults"):
    backend.shutdown()
    jax.distributed.shutdown() if multi else None
    sys.exit(0)
os._exit(0)  # a dead peer would block jax.distributed's exit barrier
