"""SFT trainer: loss goes down, exact resume, checkpoint pruning, PEFT export, sweeps equal single runs,
config errors that name the field."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from tests.helpers import hf_logprobs
from tests.test_metrics import FakeWandb
from tx.models.adapters import get_adapter_weights
from tx.sft.__main__ import load_config
from tx.sft.config import SFTConfig
from tx.sft.trainer import SFTTrainer

ROOT = Path(__file__).parents[2]
DATA = {"dataset": str(ROOT / "examples/data/chat_train.jsonl"), "eval_dataset": str(ROOT / "examples/data/chat_eval.jsonl"),
        "max_length": 64}
RUNS = [{"name": "fast", "rank": 8, "learning_rate": 1e-2}, {"name": "slow", "rank": 4, "learning_rate": 3e-3, "seed": 1}]


def config(tiny_dirs, tmp_path, **overrides) -> SFTConfig:
    values = {"base_model": tiny_dirs["dense"], "data": DATA, "runs": RUNS, "batch_size": 16, "num_steps": 6,
              "pack_length": 128, "optimizer": {"scheduler": "cosine", "warmup_steps": 1}} | overrides
    return SFTConfig.model_validate(values)


def weights(trainer, run):
    meta = trainer.backend.models[run]
    return get_adapter_weights(trainer.backend.model, meta.adapter_index, meta.lora_config.rank)


@pytest.fixture(scope="module")
def full(tiny_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    cfg = config(tiny_dirs, tmp, ckpt_path=str(tmp / "ckpts"), ckpt_interval=2, max_ckpts_to_keep=2,
                 export_path=str(tmp / "export"), eval_before_train=True, metrics_file=str(tmp / "metrics.jsonl"))
    trainer = SFTTrainer(cfg)
    summary = trainer.fit()
    return trainer, summary, tmp


def test_loss_goes_down_and_outputs(full):
    trainer, summary, tmp = full
    records = [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]
    first_eval = records[0]
    steps = [r for r in records if "fast/loss" in r]
    assert len(steps) == 6 and steps[-1]["fast/loss"] < 0.5 * steps[0]["fast/loss"]
    assert summary["fast/eval_loss"] < 0.5 * first_eval["fast/eval_loss"]
    assert summary["slow/eval_loss"] < first_eval["slow/eval_loss"]
    assert trainer.backend.metrics.compiles["forward_backward"] == 1
    # checkpoints: steps 2, 4, 6 written, 2 kept, the marker names the newest
    assert sorted(p.name for p in (tmp / "ckpts").glob("global_step_*")) == ["global_step_4", "global_step_6"]
    assert (tmp / "ckpts" / "latest_ckpt_global_step.txt").read_text() == "6"


def test_exported_adapter_loads_in_peft_and_matches(full, tiny_dirs):
    trainer, _, tmp = full
    ex = trainer.eval[0]
    out = trainer.backend.forward(trainer._batch({"fast": [ex], "slow": [ex]}, normalise=False))["fast"]
    got = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32),
                                     str(tmp / "export" / "fast"))
    ids = ex.input_ids[None]
    want = hf_logprobs(peft, ids, np.ones_like(ids), ex.target_tokens[None])[0]
    assert np.abs(got - want).max() <= 1e-4


def test_resume_from_latest_equals_uninterrupted(full, tiny_dirs, tmp_path):
    trainer, _, _ = full
    cfg = config(tiny_dirs, tmp_path, ckpt_path=str(tmp_path / "ckpts"), ckpt_interval=1)
    first = SFTTrainer(cfg)
    assert first.fit(stop_after=3) == {"interrupted_at": 3}
    resumed = SFTTrainer(cfg.model_copy(update={"resume_from": "latest"}))
    resumed.fit()
    assert resumed.step == 6
    for run in ("fast", "slow"):
        want, got = weights(trainer, run), weights(resumed, run)
        for k in want:
            np.testing.assert_array_equal(got[k][0], want[k][0])
            np.testing.assert_array_equal(got[k][1], want[k][1])


def test_sweep_equals_each_run_alone(full, tiny_dirs, tmp_path):
    trainer, _, _ = full
    alone = SFTTrainer(config(tiny_dirs, tmp_path, runs=[RUNS[1]]))
    alone.fit()
    want, got = weights(alone, "slow"), weights(trainer, "slow")
    # A few Adam steps amplify float-sum reordering (batch of 2 runs vs 1) to ~1e-6, and to ~1% of one step
    # (lr 3e-3: ~3e-5) on the rare element whose gradient is near zero (Adam's g / sqrt(v) is ill-conditioned
    # there; as in test_runs_with_their_own_dataset_and_wandb): 1e-5 elsewhere, 2% of one step on 1 in 500.
    for k in want:
        for got_w, want_w in ((got[k][0], want[k][0]), (got[k][1], want[k][1])):
            far = ~np.isclose(got_w, want_w, rtol=1e-5, atol=1e-5)
            assert far.mean() <= 2e-3, (k, far.sum(), far.size)
            np.testing.assert_allclose(got_w, want_w, rtol=0, atol=6e-5)


def test_bad_configs_name_the_field(tiny_dirs, tmp_path):
    with pytest.raises(ValidationError, match="unknown_key"):
        SFTConfig.model_validate({"data": DATA, "unknown_key": 1})
    with pytest.raises(ValidationError, match="batch_size"):
        load_config(None, [f"data.dataset={DATA['dataset']}", "batch_size=0"])
    with pytest.raises(ValidationError, match="max_length"):
        SFTConfig.model_validate({"data": DATA | {"max_length": 4}})
    with pytest.raises(ValidationError, match="names must be unique"):
        SFTConfig.model_validate({"data": DATA, "runs": [{"name": "x"}, {"name": "x"}]})
    with pytest.raises(FileNotFoundError, match="data.dataset: .*missing.jsonl"):
        SFTTrainer(config(tiny_dirs, tmp_path, data=DATA | {"dataset": str(tmp_path / "missing.jsonl")}))
    with pytest.raises(ValueError, match="no example .* has trainable tokens after truncation to max_length=8"):
        SFTTrainer(config(tiny_dirs, tmp_path, data=DATA | {"max_length": 8}, pack_length=None))
    proc = subprocess.run([sys.executable, "-m", "tx.sft", f"data.dataset={DATA['dataset']}", "optimizer.scheduler=cosin"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "optimizer.scheduler" in proc.stderr


def test_cache_parquet_dummy_run_and_periodic_exports(tiny_dirs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in Path(DATA["dataset"]).read_text().splitlines()]
    alpaca = [{"instruction": r["messages"][-2]["content"], "input": "", "output": r["messages"][-1]["content"]} for r in rows]
    pq.write_table(pa.Table.from_pylist(alpaca), tmp_path / "alpaca.parquet")
    data = {"dataset": str(tmp_path / "alpaca.parquet"), "max_length": 64}
    common = dict(data=data, runs=[RUNS[0]], num_steps=2, cache_dir=str(tmp_path / "cache"),
                  export_path=str(tmp_path / "export"), hf_save_interval=1, export_merged=True)
    first = SFTTrainer(config(tiny_dirs, tmp_path, **common))
    assert first.cache_hits == 0 and len(first.train) == len(alpaca)
    first.fit()
    second = SFTTrainer(config(tiny_dirs, tmp_path, **common))
    assert second.cache_hits == 1  # tokenized once, reused
    for a, b in zip(first.train, second.train):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)
        np.testing.assert_array_equal(a.weights, b.weights)
    assert SFTTrainer(config(tiny_dirs, tmp_path, **common, force_recache=True)).cache_hits == 0
    assert (tmp_path / "export" / "global_step_1" / "fast" / "adapter_config.json").exists()
    assert (tmp_path / "export" / "global_step_2" / "fast" / "adapter_model.safetensors").exists()
    assert (tmp_path / "export" / "fast-merged" / "config.json").exists()
    dummy = SFTTrainer(config(tiny_dirs, tmp_path, dummy_run_full_ctx=True, dummy_run_max_steps=2, runs=[RUNS[0]]))
    assert dummy.fit()["steps"] == 2 and all(len(e.input_ids) == 64 for e in dummy.train)


def test_runs_with_their_own_dataset_and_wandb(tiny_dirs, tmp_path, monkeypatch):
    subset = tmp_path / "subset.jsonl"
    subset.write_text("".join(Path(DATA["dataset"]).read_text().splitlines(keepends=True)[:8]))
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    own = {"name": "own", "rank": 4, "learning_rate": 1e-2, "seed": 1}
    job = SFTTrainer(config(tiny_dirs, tmp_path, runs=[RUNS[0], own | {"dataset": str(subset)}], num_steps=3,
                            wandb_project="tx-test"))
    job.fit()
    assert fake.kwargs["project"] == "tx-test" and fake.finished
    steps = [(step, v) for step, v in fake.logged if "own/loss" in v]
    assert [s for s, _ in steps] == [1, 2, 3] and all("fast/loss" in v for _, v in steps)
    # the run with its own dataset trains exactly as a job whose dataset that is
    alone = SFTTrainer(config(tiny_dirs, tmp_path, data=DATA | {"dataset": str(subset)}, runs=[own], num_steps=3))
    alone.fit()
    # Different batch composition changes reduction order (~1e-7); Adam's normalisation amplifies that to
    # ~1e-6 in weights of size ~0.1 after 3 steps at lr 1e-2, and to ~5e-5 (0.5% of one step) on the rare
    # element whose gradient is near zero, where Adam's g / sqrt(v) is ill-conditioned.
    want, got = weights(alone, "own"), weights(job, "own")
    for k in want:
        np.testing.assert_allclose(got[k][0], want[k][0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got[k][1], want[k][1], rtol=1e-4, atol=1e-4)
    monkeypatch.delitem(sys.modules, "wandb")
    monkeypatch.setattr("builtins.__import__", _no_wandb(__import__))
    no_wandb = SFTTrainer(config(tiny_dirs, tmp_path, runs=[RUNS[0]], wandb_project="x"))  # warns, logs to stdout
    assert no_wandb.metrics.stdout


def _no_wandb(real_import):
    def guarded(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *args, **kwargs)

    return guarded
