"""tx.rl's checkpoints and exports, in the shared step-directory layout (`tx.training.step_dirs`).

A checkpoint `<trainer.ckpt_path>/global_step_N/` holds every adapter the job trains (each run's policy, and its
critic if it has one) under its model id, and `trainer_state.json`: the global step, the data batches used (more
than the steps when dynamic sampling drew extra), each run's KL coefficient, the policy's own state per adapter
and the config. Exports are PEFT adapters, `<path>/<run>/`.
"""

from __future__ import annotations

from pathlib import Path

from tx.rl.config import RLConfig
from tx.rl.policy import LocalPolicy, RemotePolicy
from tx.rl.runs import Run
from tx.training import step_dirs


def model_ids(runs: list[Run]) -> list[str]:
    """Every adapter the job trains: each run's policy, and its critic if it has one."""
    return [m for r in runs for m in (r.name, r.critic) if m]


def save(policy: LocalPolicy | RemotePolicy, cfg: RLConfig, runs: list[Run], global_step: int,
         batches_used: int) -> Path:
    """Checkpoint every adapter at `global_step`; older ones beyond `trainer.max_ckpts_to_keep` go (-1: keep all)."""
    t = cfg.trainer
    root = Path(t.ckpt_path).expanduser()
    directory = step_dirs.step_dir(root, global_step)
    states = {model_id: policy.save(model_id, directory / model_id) for model_id in model_ids(runs)}
    return step_dirs.commit(root, global_step, {
        "global_step": global_step, "batches_used": batches_used,
        "kl_coef": {r.name: r.kl_ctrl.value for r in runs}, "policy_state": states,
        "config": cfg.model_dump()}, keep=t.max_ckpts_to_keep)


def resume(policy: LocalPolicy | RemotePolicy, cfg: RLConfig, runs: list[Run]) -> tuple[int, int] | None:
    """Load the checkpoint `trainer.resume_mode` names ('latest': the newest under ckpt_path, 'from_path':
    `resume_path`) into the adapters and the runs' KL controllers; returns (global_step, batches_used), or None
    when there is none to resume (resume_mode 'none', or nothing saved yet)."""
    t = cfg.trainer
    if t.resume_mode in (None, "none"):
        return None
    target = "latest" if t.resume_mode == "latest" else Path(t.resume_path).expanduser()
    directory = step_dirs.resume_dir(Path(t.ckpt_path).expanduser(), target)
    if directory is None:
        return None
    state = step_dirs.read_state(directory)
    for model_id in model_ids(runs):
        policy.load(model_id, directory / model_id, state.get("policy_state", {}).get(model_id, {}))
    for run in runs:
        run.kl_ctrl.value = state["kl_coef"][run.name]
    return state["global_step"], state.get("batches_used", state["global_step"])


def export(policy: LocalPolicy | RemotePolicy, runs: list[Run], base_model: str, path: Path) -> None:
    """Each run as a PEFT adapter at <path>/<run>/ (<path>/policy/ for a single run)."""
    for run in runs:
        policy.export(run.name, base_model, path / run.name)


def export_dir(cfg: RLConfig, global_step: int) -> Path:
    """Where the periodic export (`trainer.hf_save_interval`) of `global_step` goes."""
    return step_dirs.step_dir(Path(cfg.trainer.export_path).expanduser(), global_step)
