"""`python -m tx.run`: the one entry point for every host.

    python -m tx.run                                          # serve the built-in tiny model on :8000
    python -m tx.run --coordinator-address 10.0.0.2:8476 --num-processes 4 --process-id 0 \\
        --base-model Qwen/Qwen3-8B --tensor-parallel-size 4 --fully-sharded-data-parallel-size 8 \\
        --host 0.0.0.0 --api-key tml-... --control-secret-file ~/tx-control.secret

Process 0 (launched with `--process-id 0`, on the coordinator address's host; on a TPU pod not always
`jax.process_index()` 0, see tx/ranks.py) serves the Tinker HTTP API (drive it with the `tinker` SDK:
base_url=http://HOST:PORT and any key starting with tml- that the server accepts) and broadcasts every
backend call over a control channel (TCP, `--control-port`, default coordinator port + 1; peers prove a
shared secret, see `--control-secret-file`) to the other processes, which run the worker loop. On Cloud
TPU pass `--auto-distributed` and let `jax.distributed.initialize()` discover the hosts (process 0 is then
the process id it detects). The (fsdp, ep, tp) mesh
spans every device of every process unless sized smaller: fsdp is the devices left by ep x tp (-1 or
'auto'; any one axis may take that role), and the startup log names the mesh and its devices.
`--job smoke` instead trains, samples and saves one adapter and exits (a quick self-check).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import time

from pydantic import BaseModel, ValidationError

from tx.api.app import ApiConfig
from tx.api.server import ServiceConfig
from tx.backends.config import JaxBackendConfig
from tx.engine.engine import EngineConfig

logger = logging.getLogger("tx.run")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tx.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    g = p.add_argument_group("processes")
    g.add_argument("--coordinator-address", help="host:port of process 0 for jax.distributed (absent: one process)")
    g.add_argument("--num-processes", type=int, help="number of processes (hosts) in the run")
    g.add_argument("--process-id", type=int, help="this process's index in [0, num-processes)")
    g.add_argument("--auto-distributed", action="store_true",
                   help="call jax.distributed.initialize() without arguments (Cloud TPU, SLURM discover the hosts)")
    g.add_argument("--control-port", type=int, help="TCP port of the control channel on process 0 (default: coordinator port + 1)")
    g.add_argument("--control-bind", help="address the control channel listens on (default: the coordinator address's host)")
    g.add_argument("--control-secret-file", help="file holding the control channel's shared secret (same on every host; "
                   "or TX_CONTROL_SECRET); needed unless the coordinator address is loopback")
    g.add_argument("--control-secret", help="the shared secret itself (visible in the process list: prefer the file)")
    g.add_argument("--heartbeat-timeout", type=float, default=15.0,
                   help="seconds without a worker heartbeat before process 0 reports it dead (default 15)")
    g.add_argument("--connect-timeout", type=float, default=300.0, help="seconds to wait for all hosts to connect")
    m = p.add_argument_group("model and backend")
    m.add_argument("--base-model", default="tiny", help="HF directory or hub id; 'tiny' = the built-in tiny model")
    m.add_argument("--extra-base-model", action="append", default=[],
                   help="another base model to serve beside --base-model (repeatable): its own adapter slots, "
                        "on the same devices; requests choose it by base_model")
    m.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE on every process before serving (repeatable): modules that register losses, "
                        "e.g. `--import tx.rl` for the RL trainer's objective (python -m tx.rl --base-url)")
    m.add_argument("--backend-config", default="{}", help="JaxBackendConfig as JSON (the flags given override it; "
                   "--coordinator-address / --num-processes must agree with it); the mesh sizes default to every "
                   "device: fsdp = devices / (ep x tp), 'auto' or -1 for the axis that takes the rest")
    add_config_flags(m, JaxBackendConfig, skip=PROCESS_FIELDS)
    m.add_argument("--compile-cache", metavar="DIR",
                   help="JAX's persistent compilation cache (default: $JAX_COMPILATION_CACHE_DIR, else "
                        "DATA_DIR/compile-cache; on every host): a restarted process reads the programs it compiled "
                        "before instead of compiling them again")
    m.add_argument("--no-compile-cache", action="store_true", help="no persistent compilation cache")
    m.add_argument("--precompile", nargs="?", const="cross_entropy", metavar="LOSS[,LOSS...]",
                   help="before serving, compile forward_backward at every micro-batch shape the config allows for "
                        "these loss functions (default cross_entropy) and the paged sampling engine at every slot "
                        "count, by running each once on a scratch adapter (see tx/backends/precompile.py); the "
                        "time is logged. With the compilation cache a restart reads them from disk")
    j = p.add_argument_group("job (process 0)")
    j.add_argument("--job", choices=["serve", "smoke"], default="serve",
                   help="serve: the Tinker API; smoke: train an adapter on synthetic batches, sample, exit")
    j.add_argument("--steps", type=int, default=10, help="training steps of the smoke job")
    s = p.add_argument_group("service (--job serve)")
    add_config_flags(s, ServiceConfig)
    s.add_argument("--api-key", action="append", default=[],
                   help="accepted X-API-Key (repeatable; also TX_API_KEYS=k1,k2); none on loopback = any key")
    s.add_argument("--admin-api-key", action="append", default=[],
                   help="X-API-Key that sees and acts on every tenant's work (repeatable; also TX_ADMIN_API_KEYS)")
    s.add_argument("--no-auth", action="store_true", help="accept any key; each distinct key is still a tenant")
    add_config_flags(s, ApiConfig, skip=KEY_FIELDS)
    add_config_flags(s, EngineConfig, skip=("checkpoint_root",))
    return p


KEY_FIELDS = ("api_keys", "admin_api_keys", "no_auth")  # flags of their own: repeatable, with env variables


def env_list(name: str) -> list[str]:
    return [k for k in os.environ.get(name, "").split(",") if k]


def add_config_flags(group, config: type[BaseModel], skip: tuple[str, ...] = ()) -> None:
    """One flag per field of a pydantic config (values are validated by the model, not by argparse)."""
    for name, field in config.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=field.description)
        else:
            group.add_argument(flag, default=None, help=f"{field.description} (default {field.default})")


def service_configs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[ServiceConfig, ApiConfig, dict]:
    def given(names) -> dict:
        return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}

    keys = args.api_key + env_list("TX_API_KEYS")
    admin_keys = args.admin_api_key + env_list("TX_ADMIN_API_KEYS")
    engine = given(n for n in EngineConfig.model_fields if n != "checkpoint_root")
    try:
        EngineConfig(checkpoint_root="", **engine)
        return (ServiceConfig(**given(ServiceConfig.model_fields)),
                ApiConfig(api_keys=keys, admin_api_keys=admin_keys, no_auth=args.no_auth,
                          **given(n for n in ApiConfig.model_fields if n not in KEY_FIELDS)), engine)
    except ValidationError as e:
        parser.error(f"invalid service config: {e}")


PROCESS_FIELDS = ("coordinator_address", "num_processes")  # flags of their own group, also JaxBackendConfig fields


def backend_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> JaxBackendConfig:
    """`--backend-config` JSON with the flags the user passed on top. The process flags
    (--coordinator-address, --num-processes) and the JSON's fields of the same names must agree when both
    are given; either one starts the run (`args` is updated from the result)."""
    try:
        values = json.loads(args.backend_config)
    except json.JSONDecodeError as e:
        parser.error(f"--backend-config is not valid JSON: {e}")
    if not isinstance(values, dict):
        parser.error(f"--backend-config must be a JSON object, got {args.backend_config!r}")
    for name in JaxBackendConfig.model_fields:
        value = getattr(args, name, None)
        if value is None:
            continue
        if name in PROCESS_FIELDS and values.get(name) is not None and str(values[name]) != str(value):
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} {value} and --backend-config {name}={values[name]!r} differ: give one, or the same")
        values[name] = value
    try:
        config = JaxBackendConfig.model_validate(values)
    except ValidationError as e:
        parser.error(f"invalid backend config: {e}")
    for name in PROCESS_FIELDS:
        setattr(args, name, getattr(config, name))
    return config


def base_models(args: argparse.Namespace, parser: argparse.ArgumentParser):
    from tx.distributed.models import BaseModels

    try:
        return BaseModels(base_model=args.base_model, extra_base_models=args.extra_base_model)
    except ValidationError as e:
        parser.error(f"invalid base models: {e}")


def precompile_loss_fns(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """The loss functions `--precompile` names (none without it), each a registered one."""
    if args.precompile is None:
        return ()
    from tx import losses

    names = tuple(n.strip() for n in args.precompile.split(",") if n.strip())
    unknown = [n for n in names if n not in losses.names()]
    if unknown or not names:
        parser.error(f"--precompile {args.precompile!r}: {unknown or 'no'} loss function(s); registered: "
                     f"{', '.join(losses.names())}")
    return names


def validate_processes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    explicit = [args.coordinator_address, args.num_processes, args.process_id]
    if any(x is not None for x in explicit) and not all(x is not None for x in explicit):
        parser.error("--coordinator-address, --num-processes and --process-id go together (the first two may come "
                     "from --backend-config)")
    if args.num_processes is not None:
        if args.num_processes < 1:
            parser.error(f"--num-processes {args.num_processes} must be >= 1")
        if not 0 <= args.process_id < args.num_processes:
            parser.error(f"--process-id {args.process_id} is outside [0, --num-processes={args.num_processes})")
    if args.coordinator_address is not None:
        host, _, port = args.coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            parser.error(f"--coordinator-address {args.coordinator_address!r} must be host:port")


def initialize_distributed(args: argparse.Namespace) -> None:
    import jax

    # CPU hosts exchange collectives through gloo; TPU/GPU use their own interconnects.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.auto_distributed:
        jax.distributed.initialize()
    elif args.coordinator_address is not None and args.num_processes > 1:
        jax.distributed.initialize(coordinator_address=args.coordinator_address,
                                   num_processes=args.num_processes, process_id=args.process_id)
    # Bring up the backend now: its topology exchange needs every process, before anyone blocks elsewhere.
    jax.devices()


def control_endpoint(args: argparse.Namespace) -> tuple[str, int]:
    from tx.distributed.auth import split_address

    address = args.coordinator_address
    if address is None:
        from jax._src import distributed

        address = distributed.global_state.coordinator_address
    host, port = split_address(address)
    return host, args.control_port or port + 1


def control_channel(args: argparse.Namespace, parser: argparse.ArgumentParser, launch_rank: int):
    """(host, port, secret) of the control channel; exits with the reason if no secret can be had. Launch rank 0
    (the coordinator address's host, which listens) writes a loopback run's per-launch secret."""
    from tx.distributed.auth import resolve_secret

    host, port = control_endpoint(args)
    try:
        return host, port, resolve_secret(secret=args.control_secret, secret_file=args.control_secret_file,
                                          host=host, port=port, coordinator=launch_rank == 0)
    except (ValueError, PermissionError) as e:
        parser.error(f"control channel: {e}")


def smoke_job(backend, steps: int) -> None:
    """Train one adapter on synthetic next-token data, sample from it, save and reload: JSON lines."""
    import numpy as np
    from tqdm import trange

    from tx import types

    backend.create_model("smoke", types.LoraConfig(rank=8, seed=0))
    vocab = backend.impl.model.config.vocab_size
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, vocab, (8, 33)).tolist()
    batch = types.PreparedModelPassBatch(
        all_input_ids=[s[:-1] for s in seqs], all_targets=[s[1:] for s in seqs],
        all_token_weights=[[1.0] * 32] * 8, all_sampling_logprobs=[[]] * 8, all_advantages=[[]] * 8,
        all_model_ids=["smoke"] * 8, all_loss_fns=["cross_entropy"] * 8, all_loss_fn_configs=[None] * 8,
        request_batch_slices=[("train", "smoke", 0, 8)])
    for step in trange(steps, desc="smoke training", disable=None):
        start = time.perf_counter()
        out = backend.forward_backward(batch)["train"]
        metrics = backend.optim_step("smoke", types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-2))).metrics
        elapsed = time.perf_counter() - start
        print(json.dumps({"step": step, "loss_per_token": out.metrics["loss:sum"] / 256, "grad_norm": metrics["grad_norm"],
                          "tokens_per_s": round(256 / elapsed, 1), "step_time_s": round(elapsed, 4)}), flush=True)
    sample = types.PreparedSampleBatch(
        all_prompts=[seqs[0][:8]], all_sampling_params=[types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])],
        all_model_ids=["smoke"], all_checkpoint_ids=[""], all_checkpoint_paths=[""],
        request_batch_slices=[("sample", "smoke", 0, 1, True, 0)])
    seq = backend.sample(sample)["sample"].sequences[0]
    print(json.dumps({"sampled": seq.tokens, "memorised": seq.tokens == seqs[0][8:16]}), flush=True)
    from tx.runtime import compile_cache_stats

    print(json.dumps({"summary": True, "compiles": backend.metrics.compiles, "calls": backend.metrics.calls,
                      "compile_cache": compile_cache_stats()}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = backend_config(args, parser)  # first: the process fields may come from --backend-config
    validate_processes(args, parser)
    models = base_models(args, parser)
    service = service_configs(args, parser)
    for module in args.imports:  # every process: the hosts must hold the same losses (checked at connect)
        try:
            importlib.import_module(module)
        except ImportError as e:
            parser.error(f"--import {module}: {e}")
    precompile_losses = precompile_loss_fns(args, parser)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s", force=True)
    control = None
    if args.coordinator_address is not None and args.num_processes > 1:  # known now: refuse before starting
        control = control_channel(args, parser, args.process_id)  # the launch rank, before jax knows it
    initialize_distributed(args)
    if not args.no_compile_cache:
        from tx.runtime import enable_compile_cache

        enable_compile_cache(args.compile_cache or os.environ.get("JAX_COMPILATION_CACHE_DIR")
                             or service[0].data_dir / "compile-cache")

    import jax

    from tx import ranks
    from tx.distributed.auth import AuthError
    from tx.distributed.control import Coordinator, WorkerFailure
    from tx.distributed.models import load_backends, model_dir_of
    from tx.distributed.worker import run_worker

    base_model = model_dir_of(args.base_model)
    multi = jax.process_count() > 1
    if multi:  # the roles follow the launch rank (tx.ranks); on a TPU pod jax.process_index() may differ from it
        ranks.log_ranks("--auto-distributed: the process id jax.distributed.initialize() detected"
                        if args.auto_distributed else "--process-id", always=args.auto_distributed)
    if multi and control is None:
        control = control_channel(args, parser, ranks.launch_rank())
    host, port, secret = control or (None, None, None)
    if not ranks.is_coordinator():  # launch rank 0 runs the engine, not jax.process_index() 0 (tx.ranks)
        try:
            status = run_worker(host, port, secret, connect_timeout=args.connect_timeout)
        except AuthError as e:
            raise SystemExit(f"control channel: {e}")
        if status != 0:  # process 0 is gone or stopped the run: jax's exit barrier would wait for it
            logging.shutdown()
            os._exit(status)
        return status
    coordinator = None
    if multi:
        coordinator = Coordinator(args.control_bind or host, port, jax.process_count() - 1, secret,
                                  heartbeat_timeout=args.heartbeat_timeout, connect_timeout=args.connect_timeout)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the workers
    backend = None
    try:
        backends = load_backends(models, config, coordinator)
        backend = backends[args.base_model]
        if precompile_losses:
            from tx.backends.precompile import precompile

            for each in backends.values():
                precompile(each, each.impl, precompile_losses)
        if args.job == "smoke":
            smoke_job(backend, args.steps)
        else:
            from tx.api.server import serve

            service_config, api_config, engine_config = service
            serve(backend, args.base_model, base_model, service_config, engine_config, api_config,
                  fatal=(WorkerFailure,), extra={n: b for n, b in backends.items() if n != args.base_model})
    except WorkerFailure as e:
        # A host is gone or the hosts disagree: collectives cannot complete (a thread of ours may be blocked
        # in one for good), so stop the workers and exit without waiting. A restart starts from checkpoints.
        logger.error("stopping: %s", e)
        if coordinator is not None:
            coordinator.shutdown(timeout=10.0, reason=str(e))
        logging.shutdown()
        os._exit(3)
    finally:
        if backend is not None:
            backend.shutdown()
        elif coordinator is not None:
            coordinator.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
