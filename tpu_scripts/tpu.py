"""Create, set up, launch and inspect tx on a Cloud TPU VM or pod slice with gcloud.

    python tpu_scripts/tpu.py create --name tx-pod --zone us-east5-b --type v6e-16
    python tpu_scripts/tpu.py setup  --name tx-pod --zone us-east5-b --repo https://github.com/you/tx.git
    python tpu_scripts/tpu.py launch --name tx-pod --zone us-east5-b -- --base-model Qwen/Qwen3-8B --tensor-parallel-size 4
    python tpu_scripts/tpu.py logs   --name tx-pod --zone us-east5-b
    python tpu_scripts/tpu.py stop | delete ...

Every subcommand prints the gcloud commands it runs; `--dry-run` only prints them. `launch` starts
`python -m tx.run --auto-distributed` on all workers at once (`--worker=all`), each logging to
~/tx-logs/worker.log on its host; jax.distributed discovers the hosts and process ids on Cloud TPU.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

# accelerator prefix -> runtime (software) version for TPU VMs
RUNTIMES = {"v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5", "v6e": "v2-alpha-tpuv6e", "v4": "tpu-ubuntu2204-base"}
LOG_DIR = "~/tx-logs"


def runtime_for(accelerator: str) -> str:
    prefix = accelerator.rsplit("-", 1)[0]
    if prefix not in RUNTIMES or not accelerator.rsplit("-", 1)[-1].isdigit():
        raise SystemExit(f"unknown accelerator type {accelerator!r}; expected one of "
                         f"{', '.join(p + '-N' for p in RUNTIMES)} (e.g. v6e-16)")
    return RUNTIMES[prefix]


def _base(args) -> list[str]:
    cmd = ["--zone", args.zone]
    if args.project:
        cmd += ["--project", args.project]
    return cmd


def ssh(args, command: str, worker: str = "all") -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name, *_base(args), f"--worker={worker}",
            "--command", command]


def commands(args) -> list[list[str]]:
    if args.action == "create":
        version = args.version or runtime_for(args.type)
        cmd = ["gcloud", "compute", "tpus", "tpu-vm", "create", args.name, *_base(args),
               f"--accelerator-type={args.type}", f"--version={version}"]
        return [cmd + (["--spot"] if args.spot else [])]
    if args.action == "setup":
        install = " && ".join([
            "set -e",
            f"(test -d tx || git clone {shlex.quote(args.repo)} tx)",
            f"cd tx && git fetch && git checkout {shlex.quote(args.ref)}",
            "python3 -m venv ~/tx-venv && . ~/tx-venv/bin/activate",
            "pip install --upgrade pip",
            "pip install -e '.[tpu]'",
            f"mkdir -p {LOG_DIR}",
        ])
        return [ssh(args, install)]
    if args.action == "launch":
        tx_args = " ".join(shlex.quote(a) for a in args.tx_args)
        run = (f". ~/tx-venv/bin/activate && cd tx && mkdir -p {LOG_DIR} && "
               f"nohup python -m tx.run --auto-distributed {tx_args} > {LOG_DIR}/worker.log 2>&1 &")
        return [ssh(args, run)]
    if args.action == "logs":
        return [ssh(args, f"tail -n {args.lines} {LOG_DIR}/worker.log", worker=args.worker)]
    if args.action == "stop":
        return [ssh(args, "pkill -TERM -f 'tx.run' || true")]
    if args.action == "delete":
        return [["gcloud", "compute", "tpus", "tpu-vm", "delete", args.name, *_base(args), "--quiet"]]
    raise SystemExit(f"unknown action {args.action}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tpu_scripts/tpu.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="action", required=True)
    for action in ("create", "setup", "launch", "logs", "stop", "delete"):
        s = sub.add_parser(action)
        s.add_argument("--name", required=True, help="TPU VM / pod slice name")
        s.add_argument("--zone", required=True, help="e.g. us-east5-b")
        s.add_argument("--project", help="GCP project (default: gcloud's)")
        s.add_argument("--dry-run", action="store_true", help="print the gcloud commands without running them")
        if action == "create":
            s.add_argument("--type", required=True, help="accelerator type: v5litepod-N, v5p-N, v6e-N, v4-N")
            s.add_argument("--version", help="TPU runtime version (default: the one for the accelerator type)")
            s.add_argument("--spot", action="store_true", help="spot capacity")
        if action == "setup":
            s.add_argument("--repo", required=True, help="git URL of tx")
            s.add_argument("--ref", default="main", help="branch, tag or commit")
        if action == "launch":
            s.add_argument("tx_args", nargs=argparse.REMAINDER, help="arguments for python -m tx.run (after --)")
        if action == "logs":
            s.add_argument("--worker", default="0", help="worker index, or 'all'")
            s.add_argument("--lines", type=int, default=100)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "launch" and args.tx_args[:1] == ["--"]:
        args.tx_args = args.tx_args[1:]
    for cmd in commands(args):
        print(shlex.join(cmd), flush=True)
        if not args.dry_run:
            result = subprocess.run(cmd)
            if result.returncode:
                return result.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
