"""RLConfig: the seed's SkyRLTrainConfig names and nesting, for every field that applies to tx.

Defaults are the seed's. Unknown keys are errors naming the dotted path; fields that only steer Ray
placement, Megatron, PyTorch FSDP, vLLM engines or critic/reference placement are refused with the reason
(`NOT_APPLICABLE`), since a config that sets them expects an effect tx cannot give. Settings the seed has
no name for live under `tx:` (e.g. `tx.metrics_file`, `tx.max_num_seqs`).

The seed's post-init rules hold: `generator.max_input_length` defaults to `trainer.max_prompt_length`,
`trainer.algorithm.temperature` to the sampling temperature, `trainer.algorithm.max_seq_len` to
`max_input_length + max_generate_length`, and `generator.eval_sampling_params` to greedy sampling with the
training `max_generate_length`. Batch sizes count prompts (`train_batch_size`, `policy_mini_batch_size`,
`eval_batch_size`) or sequences (`micro_train_batch_size_per_gpu`), as in SkyRL.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from tx.rl.algorithms import OffPolicyCorrection
from tx.training.mesh import MeshFields
from tx.training.overrides import deep_merge
from tx.training.seed_config import OptimizerConfig, SeedModel, SkyRLLoraConfig


# dotted path -> why tx refuses it (the field only makes sense for a Ray / PyTorch / vLLM deployment)
NOT_APPLICABLE = {
    "trainer.placement": "Ray GPU placement: tx is one SPMD program; sampling and training share every device",
    "trainer.sequence_parallel_backend": "PyTorch Ulysses sequence parallelism: tx shards over its own mesh",
    "trainer.strategy": "chooses a PyTorch engine (fsdp / fsdp2 / megatron); tx has one JAX engine",
    "trainer.policy.fsdp_config": "PyTorch FSDP wrapping: tx shards over its (fsdp, ep, tp) mesh",
    "trainer.policy.megatron_config": "Megatron parallelism: tx shards over its (fsdp, ep, tp) mesh",
    "trainer.policy.sequence_parallel_size": "Ulysses sequence parallelism: tx shards over its own mesh",
    "trainer.policy.use_torch_compile": "tx is always jit-compiled",
    "trainer.policy.record_memory": "CUDA memory snapshots (use benchmarks/bench_memory.py)",
    "trainer.policy.model_config_kwargs": "tx reads the model config from the checkpoint",
    "trainer.policy.model.lora.lora_sync_path": "weight sync to vLLM: tx samples the very arrays it trains",
    "trainer.policy.optimizer_config.offload_after_step": "optimizer CPU offload between colocated Ray workers",
    "trainer.ref": "the reference policy of a LoRA run is the base model itself (adapter slot 0): no second "
                   "model, no placement",
    "trainer.critic.fsdp_config": "PyTorch FSDP wrapping: tx shards over its (fsdp, ep, tp) mesh",
    "trainer.critic.sequence_parallel_size": "Ulysses sequence parallelism: tx shards over its own mesh",
    "trainer.critic.model_config_kwargs": "the critic is an adapter on the policy's base model",
    "trainer.critic.optimizer_config.offload_after_step": "optimizer CPU offload between colocated Ray workers",
    "trainer.fully_async": "SkyRL's fully-async trainer: tx.rl runs sampling and training in one program, in turn",
    "trainer.gradient_checkpointing_use_reentrant": "a PyTorch checkpointing option",
    "trainer.flash_attn": "tx picks its own attention kernel",
    "trainer.log_path": "Ray infrastructure logs",
    "trainer.rope_scaling": "tx reads RoPE settings from the checkpoint",
    "trainer.rope_theta": "tx reads RoPE settings from the checkpoint",
    "trainer.use_sample_packing": "tx packs rows by length under its token budget itself",
    "trainer.micro_forward_batch_size_per_gpu": "tx needs no separate no-grad pass for the old log-probs: its "
                                                "sampler's log-probs are forward's",
    "trainer.update_ref_every_epoch": "the reference is the base model (slot 0) and is never updated",
    "trainer.dump_data_batch": "PyTorch pickles of the training batch",
    "generator.inference_engine": "vLLM engine settings: tx samples in-process with its own paged engine",
    "generator.batched": "vLLM offline batching: tx's sampler always batches",
    "generator.rope_scaling": "tx reads RoPE settings from the checkpoint",
    "generator.rope_theta": "tx reads RoPE settings from the checkpoint",
    "generator.step_wise_trajectories": "tx trains each trajectory as one sequence",
    "generator.use_conversation_multi_turn": "tx always keeps each turn a separate chat message",
    "generator.append_eos_token_after_stop_str_in_multi_turn": "tx keeps the sampled tokens as they are",
    "generator.chat_template": "tx uses the tokenizer's chat template (chat_template_kwargs still apply)",
}


class ModelConfig(SeedModel):
    path: str | None = Field("Qwen/Qwen2.5-1.5B-Instruct", description="HF directory or hub id; 'tiny' = built-in")
    lora: SkyRLLoraConfig = SkyRLLoraConfig()


class PolicyConfig(SeedModel):
    model: ModelConfig = ModelConfig()
    optimizer_config: OptimizerConfig = OptimizerConfig()


class CriticConfig(SeedModel):
    """`gae`'s critic: in tx a LoRA adapter with a scalar value head on the policy's base model (path None or
    the policy's path), trained beside the policy in the same program."""

    class Model(ModelConfig):
        path: str | None = Field(None, description="None (or the policy's path): the policy's base model")

    model: Model = Model()
    optimizer_config: OptimizerConfig = OptimizerConfig(lr=5e-6)


class KLCtrlConfig(SeedModel):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_target: float = Field(0.1, gt=0)
    horizon: int = Field(10000, gt=0)


class SAPOConfig(SeedModel):
    tau_pos: float = Field(1.0, gt=0)
    tau_neg: float = Field(1.05, gt=0)


class DynamicSamplingConfig(SeedModel):
    type: Literal["filter", "replace"] | None = None
    max_sample_batches: int = 30
    min_replace_ratio: float = Field(0.3, ge=0, le=1)


class ClipCovConfig(SeedModel):
    clip_ratio: float = Field(0.0002, ge=0, le=1)
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0


class KLCovConfig(SeedModel):
    kl_cov_frac: float = Field(0.2, ge=0, le=1)
    ppo_kl_coef: float = 1.0


class CISPOConfig(SeedModel):
    """The seed's defaults (0, 5): the IS weight is clipped to [1, 6]. SkyRL 0.4.0 changed them to (1.0, 4.0), i.e.
    [0, 5] (ScaleRL's bounds); set those to match it."""

    cispo_eps_clip_low: float = Field(0.0, ge=0)
    cispo_eps_clip_high: float = Field(5.0, ge=0)
    cispo_anchor: Literal["old", "rollout"] = Field(
        "old", description="SkyRL 0.4.0: the IS ratio's denominator, the old (pre-update) log-probs or the sampler's "
        "('rollout': itself an off-policy correction, so off_policy_correction.tis_ratio_type must be None)")


class DPPOConfig(SeedModel):
    """SkyRL 0.4.0's `dppo` policy loss: -ratio * A, the token dropped where the policy moved too far from the
    sampler in the advantage's direction (total variation or binary KL of the token's probability)."""

    dppo_type: Literal["binary_tv", "binary_kl"] = "binary_tv"
    delta_low: float = Field(0.2, ge=0)
    delta_high: float = Field(0.2, ge=0)


class AlgorithmConfig(SeedModel):
    advantage_estimator: str = "grpo"
    kl_ctrl: KLCtrlConfig = KLCtrlConfig()
    kl_estimator_type: Literal["k1", "k2", "k3", "abs"] = "k3"
    use_kl_in_reward: bool = False
    use_kl_loss: bool = True
    kl_loss_coef: float = Field(0.001, ge=0)
    use_entropy_loss: bool = False
    entropy_loss_coef: float = Field(0.01, ge=0)
    temperature: float | None = Field(None, gt=0)
    advantage_batch_normalize: bool = False
    value_head_prefix: str = "value_head"
    policy_loss_type: str = "regular"
    loss_reduction: Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean",
                            "token_mean_legacy"] = "token_mean"
    loss_reduction_placement: Literal["loss", "advantages"] = Field(
        "loss", description="tx: where loss_reduction acts. 'loss' (the seed's, SkyRL 0.1): per-token weights on the "
        "policy loss, from the mask after off-policy correction; 'advantages' (SkyRL >= 0.4, its PR #1296): each "
        "mini-batch's advantages are scaled by the reduction's factor from the mask before the correction, and the "
        "loss is a plain masked sum. Equal for losses linear in A, except where the correction drops tokens; "
        "clip_cov / kl_cov select their tokens on the scaled advantages and kl_cov's penalty is then unreduced")
    grpo_norm_by_std: bool = True
    zero_variance_filter: bool = False
    lambd: float = 1.0
    gamma: float = 1.0
    eps_clip_low: float = Field(0.2, ge=0)
    eps_clip_high: float = Field(0.2, ge=0)
    clip_ratio_c: float = Field(3.0, gt=1)
    tis_imp_ratio_cap: float = -1.0
    use_tis: bool = False
    off_policy_correction: OffPolicyCorrection = OffPolicyCorrection()  # the seed's fields, validated
    sapo: SAPOConfig = SAPOConfig()
    value_clip: float = 0.2
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    clip_cov: ClipCovConfig = ClipCovConfig()
    kl_cov: KLCovConfig = KLCovConfig()
    cispo: CISPOConfig = CISPOConfig()
    dppo: DPPOConfig = DPPOConfig()
    max_seq_len: int | None = Field(None, ge=1)


    def policy_loss_params(self) -> dict[str, float]:
        """The parameters `policy_loss_type` reads, from their seed fields (`POLICY_LOSS_PARAM_FIELDS`), as floats
        (choice fields as their index); a parameter without a config field keeps the loss's default."""
        from tx.rl import algorithms

        spec = algorithms.policy_loss(self.policy_loss_type)
        params = {}
        for key in spec.params:
            node: Any = self
            for part in algorithms.POLICY_LOSS_PARAM_FIELDS.get(key, key).split("."):
                node = getattr(node, part, None)
            params[key] = algorithms.policy_loss_param_value(key, node) if node is not None else spec.params[key]
        return params

    def correction(self) -> OffPolicyCorrection:
        """`off_policy_correction`, with the seed's deprecated `use_tis` / `tis_imp_ratio_cap` as token TIS."""
        c = self.off_policy_correction
        if self.use_tis and c.tis_ratio_type is None:
            return replace(c, tis_ratio_type="token", token_tis_ratio_clip_high=self.tis_imp_ratio_cap)
        return c


class TrainerConfig(SeedModel):
    policy: PolicyConfig = PolicyConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    critic: CriticConfig = CriticConfig()
    critic_mini_batch_size: int = Field(256, ge=1)
    bf16: bool = Field(True, description="rank 0: the weights compute in bf16 with float32 masters (else float32); "
                       "LoRA: False computes the base in float32, True keeps the checkpoint's dtype")
    gradient_checkpointing: bool = True
    seed: int = 42
    resume_mode: Literal["none", "latest", "from_path"] | None = "latest"
    resume_path: str | None = None
    ckpt_path: str = "~/ckpts/"
    max_ckpts_to_keep: int = -1
    ckpt_interval: int = 10
    hf_save_interval: int = -1
    export_path: str = "~/exports/"
    epochs: int = Field(1, ge=1)
    update_epochs_per_batch: int = Field(1, ge=1)
    train_batch_size: int = Field(1024, ge=1)
    policy_mini_batch_size: int = Field(256, ge=1)
    micro_train_batch_size_per_gpu: int = Field(1, ge=1)
    eval_batch_size: int = Field(1024, ge=1)
    eval_before_train: bool = True
    eval_interval: int = 5
    max_prompt_length: int = Field(512, ge=1)
    disable_fast_tokenizer: bool = False
    project_name: str = "skyrl"
    run_name: str = "test_run"
    logger: Literal["wandb", "console"] = "wandb"
    dump_eval_results: bool = True


class SamplingParams(SeedModel):
    max_generate_length: int = Field(1024, ge=1)
    repetition_penalty: float = Field(1.0, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    min_p: float = Field(0.0, ge=0, le=1)
    top_k: int = Field(-1, ge=-1)
    logprobs: int | None = Field(1, ge=0, le=1)
    stop: list[str] | None = None
    additional_kwargs: dict[str, Any] | None = None


class GeneratorConfig(SeedModel):
    n_samples_per_prompt: int = Field(5, ge=1)
    max_turns: int = Field(1, ge=1)
    max_input_length: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] = {}
    sampling_params: SamplingParams = SamplingParams()
    eval_sampling_params: SamplingParams | None = None
    eval_n_samples_per_prompt: int = Field(1, ge=1)
    zero_reward_on_non_stop: bool = False
    apply_overlong_filtering: bool = False


class EnvironmentConfig(SeedModel):
    env_class: str = "gsm8k"
    imports: list[str] = Field([], description="tx: modules that register user envs / policy losses / "
                               "advantage estimators (imported on every host)")
    skyrl_gym: dict[str, Any] = Field({}, description="max_env_workers, and per-env config by env class name")


class DataConfig(SeedModel):
    train_data: list[str] = ["~/data/gsm8k/train.parquet"]
    val_data: list[str] = ["~/data/gsm8k/validation.parquet"]


class TxSettings(MeshFields, SeedModel):
    """Settings the seed has no name for (also the mesh: `fsdp_size`, `ep_size`, `tp_size`; default every device)."""

    MESH_PREFIX: ClassVar[str] = "tx."

    metrics_file: str | None = Field(None, description="metrics as JSON lines, one per step / eval")
    max_lora_adapters: int | None = Field(None, ge=2, description="default: runs + 1")
    micro_batch_tokens: int | None = Field(None, ge=0, description="padded tokens per training jit call "
                                           "(default: the backend's)")
    max_num_seqs: int | None = Field(None, ge=1, description="decode slots of the sampling engine")
    loss_chunk_size: int = Field(1024, ge=1)
    base_url: str | None = Field(None, description="train on a running `python -m tx.run --import tx.rl` server "
                                 "through the tinker SDK (key: TINKER_API_KEY) instead of in this process")


# what a run of a multi-run job may set for itself; everything else (data, batch sizes, generator, model) is the
# job's, so that the runs' rollouts and passes share device batches
RUN_FIELDS = ("trainer.seed", "trainer.policy.optimizer_config", "trainer.policy.model.lora.rank",
              "trainer.policy.model.lora.alpha", "trainer.algorithm", "trainer.critic.optimizer_config",
              "trainer.critic.model.lora.rank", "trainer.critic.model.lora.alpha")


class RunConfig(SeedModel):
    """One experiment of a multi-run job: its own adapter, optimizer, metrics, checkpoints and exports."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="model id, metric prefix and directory name")
    trainer: dict[str, Any] = Field({}, description=f"overrides of the job's trainer fields, among {RUN_FIELDS}")


class RLConfig(SeedModel):
    data: DataConfig = DataConfig()
    trainer: TrainerConfig = TrainerConfig()
    generator: GeneratorConfig = GeneratorConfig()
    environment: EnvironmentConfig = EnvironmentConfig()
    runs: list[RunConfig] = Field([], description="tx: several RL runs on one base model in one program (empty: "
                                  "one run, named 'policy')")
    tx: TxSettings = TxSettings()

    def run_configs(self) -> dict[str, RLConfig]:
        """Each run's effective config: the job's, with the run's trainer overrides merged in."""
        if not self.runs:
            return {"policy": self}
        base = self.model_dump(exclude={"runs"}, exclude_unset=True)
        out = {}
        for run in self.runs:
            for path in _paths(run.trainer, "trainer."):
                if not any(path == f or path.startswith(f + ".") for f in RUN_FIELDS):
                    raise ValueError(f"runs[{run.name!r}].{path}: a run may only set {', '.join(RUN_FIELDS)}; "
                                     "the rest is shared by every run of the job")
            out[run.name] = RLConfig.model_validate({**base, "trainer": deep_merge(base.get("trainer", {}), run.trainer)})
        return out

    @model_validator(mode="before")
    @classmethod
    def _refuse_not_applicable(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for path, reason in NOT_APPLICABLE.items():
                node: Any = values
                for part in path.split("."):
                    node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
                if node is not _MISSING:
                    raise ValueError(f"{path}: not applicable to tx ({reason}); remove it")
        return values

    @model_validator(mode="after")
    def _post_init(self) -> RLConfig:
        t, g, a = self.trainer, self.generator, self.trainer.algorithm
        # the seed's post-init rules
        if g.max_input_length is None:
            g.max_input_length = t.max_prompt_length
        if a.temperature is None:
            a.temperature = g.sampling_params.temperature or 1.0
        if a.max_seq_len is None:
            a.max_seq_len = g.max_input_length + g.sampling_params.max_generate_length
        if g.eval_sampling_params is None:
            g.eval_sampling_params = SamplingParams(temperature=0.0,
                                                    max_generate_length=g.sampling_params.max_generate_length)
        self._check()
        names = [r.name for r in self.runs]
        if len(set(names)) != len(names):
            raise ValueError(f"runs: names must be unique, got {names}")
        configs = self.run_configs()  # every run's overrides validate
        full = [name for name, c in configs.items() if c.trainer.policy.model.lora.rank == 0]
        if full:
            why = ("trainer.policy.model.lora.rank=0 (full training: every base weight trains, one model at a "
                   "time)")
            if len(configs) > 1:
                raise ValueError(f"{why}: a job of several runs needs LoRA (set a rank >= 1 for {full})")
            if self.tx.base_url:
                raise ValueError(f"{why}: Tinker's API trains LoRA adapters; train in-process or set a rank")
            if configs[full[0]].trainer.algorithm.advantage_estimator == "gae":
                raise ValueError(f"{why}: gae's critic is a LoRA adapter beside the policy; use a rank >= 1 "
                                 "or another advantage_estimator")
        return self

    def _check(self) -> None:
        from tx.rl import algorithms

        t, g, a = self.trainer, self.generator, self.trainer.algorithm
        if t.policy.model.path is None:
            raise ValueError("trainer.policy.model.path: required (an HF directory or hub id, or 'tiny')")
        if t.train_batch_size < t.policy_mini_batch_size or t.train_batch_size % t.policy_mini_batch_size:
            raise ValueError(f"trainer.train_batch_size={t.train_batch_size} must be a multiple of (and at least) "
                             f"trainer.policy_mini_batch_size={t.policy_mini_batch_size} (both count prompts)")
        if t.max_ckpts_to_keep == 0:
            raise ValueError("trainer.max_ckpts_to_keep=0 would delete every checkpoint; use -1 to keep all")
        if t.resume_mode == "from_path" and not t.resume_path:
            raise ValueError("trainer.resume_mode='from_path' needs trainer.resume_path (a global_step_N directory)")
        if g.max_turns == 1 and g.max_input_length != t.max_prompt_length:
            raise ValueError(f"generator.max_input_length={g.max_input_length} must equal trainer.max_prompt_length="
                             f"{t.max_prompt_length} when generator.max_turns=1")
        if g.max_input_length < t.max_prompt_length:
            raise ValueError(f"generator.max_input_length={g.max_input_length} is below trainer.max_prompt_length="
                             f"{t.max_prompt_length}")
        if a.use_kl_loss and a.use_kl_in_reward:
            raise ValueError("trainer.algorithm: use_kl_loss and use_kl_in_reward are mutually exclusive")
        if a.advantage_estimator not in algorithms.advantage_estimator_names():
            raise ValueError(f"trainer.algorithm.advantage_estimator={a.advantage_estimator!r} is not registered "
                             f"({', '.join(algorithms.advantage_estimator_names())}; register your own in a module "
                             "listed in environment.imports)")
        if a.advantage_estimator == "gae":
            if t.critic.model.path not in (None, t.policy.model.path):
                raise ValueError(f"trainer.critic.model.path={t.critic.model.path!r}: tx.rl's critic is an adapter "
                                 "with a value head on the policy's base model; leave it unset")
            if t.critic.model.lora.rank < 1:
                raise ValueError("trainer.critic.model.lora.rank=0: tx.rl's critic is a LoRA adapter with a value "
                                 "head; set a rank >= 1 (and alpha, target_modules)")
            if t.train_batch_size % t.critic_mini_batch_size:
                raise ValueError(f"trainer.train_batch_size={t.train_batch_size} must be a multiple of "
                                 f"trainer.critic_mini_batch_size={t.critic_mini_batch_size} (both count prompts)")
        elif t.critic.model.path is not None:
            raise ValueError(f"trainer.critic.model.path is set but advantage_estimator="
                             f"{a.advantage_estimator!r} reads no critic (only 'gae' does)")
        if a.policy_loss_type not in algorithms.policy_loss_names():
            raise ValueError(f"trainer.algorithm.policy_loss_type={a.policy_loss_type!r} is not registered "
                             f"({', '.join(algorithms.policy_loss_names())})")
        algorithms.check_policy_loss_config(a.policy_loss_type, a.policy_loss_params(), a.correction().tis_ratio_type)
        if self.tx.base_url and a.temperature != 1.0:
            raise ValueError(f"trainer.algorithm.temperature={a.temperature} (default: the sampling temperature): "
                             "Tinker's forward_backward has no temperature; set 1.0 to train through tx.base_url")
        if g.sampling_params.logprobs == 0:
            raise ValueError("generator.sampling_params.logprobs=0: tx.rl trains on the sampler's log-probs (1)")


_MISSING = object()


def _paths(values: dict, prefix: str) -> list[str]:
    out = []
    for key, value in values.items():
        out += _paths(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [f"{prefix}{key}"]
    return out
