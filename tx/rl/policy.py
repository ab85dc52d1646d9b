"""Where the trainer's adapters live: the tx backend in this process (`LocalPolicy`), or a running
`python -m tx.run` server driven through the official `tinker` SDK (`RemotePolicy`, `--base-url`).

Both offer the few calls an RL step makes — sample with an adapter's current weights, score sequences with the
base model, one forward_backward of several runs' mini-batches, an AdamW step, checkpoints and exports — with
the same numbers in and out, so the trainer above them is one piece of code (and the same first step gives the
same loss and gradient norm in both; tested).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tx import types


@dataclass(frozen=True)
class SampleRequest:
    model_id: str  # a run's name
    prompt_ids: list[int]
    num_samples: int
    params: types.SamplingParams


@dataclass
class PassResult:
    loss_sum: float
    outputs: list[dict[str, np.ndarray]]  # per datum: "logprobs", "entropy", ... over its targets


Datum = dict[str, Any]  # {"input_ids", "targets", "weights", "logprobs", "advantages", "extra": {key: [t]},
#                          "temperature" (in-process only: log-probs of softmax(logits / T))}


class LocalPolicy:
    """The tx JAX backend in this process: one backend call per trainer call, every run's rows in it."""

    def __init__(self, base_model: str, config, frozen_reference: bool = False):
        """`config.training_mode="full"` (rank 0) trains every base weight (FullBackend, one model); then the
        reference policy needs `frozen_reference`: a second, untrained copy of the base weights (a LoRA-mode
        backend with the smallest slots), which costs one more set of base weights in the policy's compute dtype
        (`mixed_precision.param_dtype`, bf16 by default: 2 bytes a parameter) and its own compiled forward."""
        from tx.backends.full import backend_class

        self.backend = backend_class(config)(base_model, config)
        self.model_dir = self.backend.model_dir
        self.full = config.training_mode == "full"
        self.reference = self.backend
        if frozen_reference:
            from tx.backends.jax import JaxBackend

            # in the policy's compute dtype, so before the first update the two give the same log-probs (KL 0)
            dtype = {"bf16": "bfloat16", "fp32": "float32"}[self.backend.precision.param_dtype]
            self.reference = JaxBackend(base_model, config.model_copy(update={
                "training_mode": "lora", "mixed_precision": None, "max_lora_adapters": 2, "max_lora_rank": 1,
                "dtype": dtype}))

    def create(self, name: str, lora: types.LoraConfig) -> None:
        self.backend.create_model(name, lora)

    def sample(self, requests: list[SampleRequest]) -> list[list[types.GeneratedSequence]]:
        prompts, sampling, model_ids, slices = [], [], [], []
        for r, req in enumerate(requests):
            start = len(prompts)
            prompts += [req.prompt_ids] * req.num_samples
            sampling += [req.params] * req.num_samples
            model_ids += [req.model_id] * req.num_samples
            slices.append((f"rollout-{r}", req.model_id, start, len(prompts), False, 0))
        out = self.backend.sample(types.PreparedSampleBatch(
            all_prompts=prompts, all_sampling_params=sampling, all_model_ids=model_ids,
            all_checkpoint_ids=[""] * len(prompts), all_checkpoint_paths=[""] * len(prompts),
            request_batch_slices=slices))
        return [_ok(out[s[0]], "sampling").sequences for s in slices]

    def base_logprobs(self, sequences: list[list[int]], temperatures: list[float] | None = None) -> list[np.ndarray]:
        """log p_base(token i + 1 | tokens <= i) of each sequence (at its temperature), from the base model
        (slot 0) in one forward."""
        datums = [{"input_ids": s[:-1], "targets": s[1:], "temperature": t}
                  for s, t in zip(sequences, temperatures or [1.0] * len(sequences))]
        out = _ok(self.reference.forward(prepared_batch({"ref": ("", datums, "cross_entropy", None)}))["ref"],
                  "reference forward")
        return [o["logprobs"].to_numpy().astype(np.float64) for o in out.loss_fn_outputs]

    def forward_backward(self, requests: dict[str, tuple[list[Datum], str, dict]]) -> dict[str, PassResult]:
        """One pass with gradients over every model's datums ({model id: (datums, loss, loss config)})."""
        return self._pass(requests, self.backend.forward_backward, "forward_backward")

    def forward(self, requests: dict[str, tuple[list[Datum], str, dict]]) -> dict[str, PassResult]:
        """The same without gradients (e.g. a critic's values before its update)."""
        return self._pass(requests, self.backend.forward, "forward")

    def _pass(self, requests, call, what: str) -> dict[str, PassResult]:
        out = call(prepared_batch(
            {name: (name, datums, loss, config) for name, (datums, loss, config) in requests.items()}))
        results = {}
        for name in requests:
            r = _ok(out[name], f"{name}: {what}")
            results[name] = PassResult(r.metrics["loss:sum"], [{k: v.to_numpy() for k, v in o.items()}
                                                                for o in r.loss_fn_outputs])
        return results

    def optim_step(self, name: str, adam: types.AdamParams) -> float:
        return self.backend.optim_step(name, types.OptimStepInput(adam_params=adam)).metrics["grad_norm"]

    def save(self, name: str, directory: Path) -> dict:
        self.backend.save_checkpoint(directory, name)
        return {}

    def load(self, name: str, directory: Path, state: dict) -> None:
        self.backend.load_checkpoint(directory, name)

    def export(self, name: str, base_model: str, directory: Path) -> None:
        """The run's PEFT adapter at `directory`; with full training, the whole model as an HF directory."""
        from tx.checkpoints import peft_format
        from tx.checkpoints.full import export_hf_model

        if self.full:
            export_hf_model(directory, self.backend.model, self.model_dir)
            return
        meta = self.backend.models[name]
        peft_format.export_adapter(self.backend.model, meta.adapter_index, meta.lora_config.rank,
                                   meta.lora_config.alpha, base_model, directory)


class RemotePolicy:
    """A `python -m tx.run` server (started with `--import tx.rl`), through the `tinker` SDK. A run's adapter is a
    LoRA training client; sampling goes through a sampling client of its latest weights (re-made after each
    optim_step), reference log-probs through the base model's `compute_logprobs`. Checkpoints are the server's
    (`save_state`; their tinker:// paths go in the local checkpoint); exports are sampler weights on the server,
    their paths written to `<export dir>/<run>.json`. API key: the SDK's `TINKER_API_KEY`."""

    def __init__(self, base_url: str, base_model: str, api_key: str | None = None):
        import tinker

        self.tinker = tinker
        self.service = tinker.ServiceClient(base_url=base_url, **({"api_key": api_key} if api_key else {}))
        self.base_model = base_model
        self.clients: dict[str, Any] = {}
        self.samplers: dict[str, Any] = {}
        self._base_sampler = None
        self.model_dir = None

    def create(self, name: str, lora: types.LoraConfig) -> None:
        from tx.api.config import TINKER_LORA_ALPHA

        if lora.alpha != TINKER_LORA_ALPHA:
            raise ValueError(f"trainer.policy.model.lora.alpha={lora.alpha}: a Tinker server scales every adapter with "
                             f"alpha={TINKER_LORA_ALPHA}; set that alpha to train through --base-url")
        self.clients[name] = self.service.create_lora_training_client(
            base_model=self.base_model, rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp,
            train_attn=lora.train_attn, train_unembed=lora.train_unembed).result()

    def _sampler(self, name: str):
        if name not in self.samplers:  # the adapter's current weights, as of its last optim_step
            self.samplers[name] = self.clients[name].save_weights_and_get_sampling_client().result()
        return self.samplers[name]

    def sample(self, requests: list[SampleRequest]) -> list[list[types.GeneratedSequence]]:
        T = self.tinker.types
        futures = []
        for req in requests:
            p = req.params
            if p.min_p != 0.0 or p.repetition_penalty != 1.0:
                raise ValueError("generator.sampling_params.min_p / repetition_penalty are not in Tinker's sampling "
                                 f"API (min_p={p.min_p}, repetition_penalty={p.repetition_penalty}); leave them at "
                                 "0 / 1 to train through --base-url")
            futures.append(self._sampler(req.model_id).sample(
                T.ModelInput.from_ints(req.prompt_ids), num_samples=req.num_samples,
                sampling_params=T.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                                                 top_p=p.top_p, seed=p.seed, stop=p.stop)))
        return [[types.GeneratedSequence(tokens=list(s.tokens), logprobs=list(s.logprobs or []),
                                         stop_reason="length" if s.stop_reason == "length" else "stop")
                 for s in f.result().sequences] for f in futures]

    def base_logprobs(self, sequences: list[list[int]], temperatures: list[float] | None = None) -> list[np.ndarray]:
        if any(t != 1.0 for t in temperatures or []):
            raise ValueError("trainer.algorithm.temperature != 1 is not in Tinker's API; train in-process for it")
        if self._base_sampler is None:
            self._base_sampler = self.service.create_sampling_client(base_model=self.base_model).result()
        T = self.tinker.types
        futures = [self._base_sampler.compute_logprobs(T.ModelInput.from_ints(s)) for s in sequences]
        return [np.asarray(f.result()[1:], np.float64) for f in futures]  # the first token has no log-prob

    def forward_backward(self, requests: dict[str, tuple[list[Datum], str, dict]]) -> dict[str, PassResult]:
        return self._pass(requests, "forward_backward")

    def forward(self, requests: dict[str, tuple[list[Datum], str, dict]]) -> dict[str, PassResult]:
        return self._pass(requests, "forward")

    def _pass(self, requests, what: str) -> dict[str, PassResult]:
        T = self.tinker.types
        futures = {}
        for name, (datums, loss, config) in requests.items():
            f32 = lambda v: T.TensorData.from_numpy(np.asarray(v, np.float32))  # noqa: E731
            data = [T.Datum(model_input=T.ModelInput.from_ints(d["input_ids"]), loss_fn_inputs={
                "target_tokens": list(d["targets"]), **{k: f32(d[k]) for k in ("weights", "logprobs", "advantages")
                                                        if k in d},
                **{k: f32(v) for k, v in d.get("extra", {}).items()}}) for d in datums]
            futures[name] = getattr(self.clients[name], what)(data, loss, config)
        out = {}
        for name, f in futures.items():
            r = f.result()
            out[name] = PassResult(r.metrics["loss:sum"], [{k: np.asarray(v.data, np.float64) for k, v in o.items()}
                                                           for o in r.loss_fn_outputs])
        return out

    def optim_step(self, name: str, adam: types.AdamParams) -> float:
        r = self.clients[name].optim_step(self.tinker.types.AdamParams(**adam.model_dump())).result()
        self.samplers.pop(name, None)
        return float(r.metrics["grad_norm"])

    def save(self, name: str, directory: Path) -> dict:
        path = self.clients[name].save_state(f"rl-{directory.parent.name}-{name}").result().path
        return {"tinker_path": path}

    def load(self, name: str, directory: Path, state: dict) -> None:
        self.clients[name].load_state_with_optimizer(state["tinker_path"]).result()
        self.samplers.pop(name, None)

    def export(self, name: str, base_model: str, directory: Path) -> None:
        path = self.clients[name].save_weights_for_sampler(f"rl-export-{directory.parent.name}-{name}").result().path
        directory.parent.mkdir(parents=True, exist_ok=True)
        (directory.parent / f"{name}.json").write_text(json.dumps({"sampler_weights": path, "base_model": base_model}))


def _ok(result, what: str):
    if isinstance(result, types.ErrorResponse):
        raise RuntimeError(f"{what} failed: {result.error}")
    return result


def prepared_batch(requests: dict[str, tuple[str, list[Datum], str, dict | None]]) -> types.PreparedModelPassBatch:
    """One PreparedModelPassBatch of requests {request id: (model id, datums, loss, loss config)}."""
    fields: dict[str, list] = {k: [] for k in ("all_input_ids", "all_targets", "all_token_weights",
                                                "all_sampling_logprobs", "all_advantages", "all_model_ids",
                                                "all_loss_fns", "all_loss_fn_configs")}
    datums_all = [d for _, datums, _, _ in requests.values() for d in datums]
    extra_keys = sorted({k for d in datums_all for k in d.get("extra", {})})
    slices = []
    for request_id, (model_id, datums, loss, config) in requests.items():
        start = len(fields["all_input_ids"])
        for d in datums:
            fields["all_input_ids"].append(d["input_ids"])
            fields["all_targets"].append(d["targets"])
            fields["all_token_weights"].append(d.get("weights", []))
            fields["all_sampling_logprobs"].append(d.get("logprobs", []))
            fields["all_advantages"].append(d.get("advantages", []))
            fields["all_model_ids"].append(model_id)
            fields["all_loss_fns"].append(loss)
            fields["all_loss_fn_configs"].append(config)
        slices.append((request_id, model_id, start, len(fields["all_input_ids"])))
    extra = {k: [d.get("extra", {}).get(k, []) for d in datums_all] for k in extra_keys}
    temperatures = [float(d.get("temperature", 1.0)) for d in datums_all]
    return types.PreparedModelPassBatch(**fields, all_extra_inputs=extra or None, request_batch_slices=slices,
                                        all_temperatures=temperatures if any(t != 1.0 for t in temperatures) else None)
