"""tx.sft reads SkyRL's SFTConfig names: same config as the native spelling, dotted overrides, unknown keys
named, placement-only fields refused by name, rank 0 = full training, and a SkyRL-format LoRA run end to end."""

import json
import subprocess
import re
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from tests.helpers import one_device_env
from tx.sft.__main__ import load_config
from tx.sft.config import SFTConfig
from tx.sft.data import load_rows, to_messages
from tx.sft.seed_config import SeedFieldIgnored
from tx.sft.trainer import SFTTrainer

ROOT = Path(__file__).parents[2]
TRAIN, EVAL = str(ROOT / "examples/data/chat_train.jsonl"), str(ROOT / "examples/data/chat_eval.jsonl")

# A SkyRL SFT config (SFTConfig field names and nesting), every value away from its default.
SEED = {
    "model": {"path": "tiny", "lora": {"rank": 8, "alpha": 16, "target_modules": "all-linear"}},
    "optimizer_config": {"lr": 1e-3, "adam_betas": [0.8, 0.99], "weight_decay": 0.05, "max_grad_norm": 0.5,
                         "num_warmup_steps": 2, "scheduler": "cosine"},
    "dataset_name": TRAIN, "dataset_split": "train[:32]", "messages_key": "conversation", "tools_key": "fns",
    "system_key": "sys", "eval_dataset_name": EVAL, "eval_dataset_split": "test", "eval_interval": 3,
    "eval_before_train": True, "max_length": 64, "num_steps": 7, "batch_size": 8,
    "micro_train_batch_size_per_gpu": 4, "use_sequence_packing": True, "max_tokens_per_microbatch": 128,
    "train_on_what": "all_assistant_messages", "ckpt_path": "/ckpt", "ckpt_interval": 2, "max_ckpts_to_keep": 3,
    "resume_from": "latest", "hf_save_interval": 4, "export_path": "/exp", "seed": 7, "logger": "wandb",
    "project_name": "proj", "run_name": "r1", "tags": ["a", "b"], "cache_dir": "/cache", "force_recache": True,
    "dummy_run_max_steps": 2,
}
# The same job written in tx's own names (by hand, from the SkyRL field docs).
NATIVE = {
    "base_model": "tiny",
    "runs": [{"name": "policy", "rank": 8, "alpha": 16.0, "seed": 7, "learning_rate": 1e-3, "weight_decay": 0.05,
              "train_attn": True, "train_mlp": True, "train_unembed": False}],  # PEFT all-linear: not lm_head
    "optimizer": {"beta1": 0.8, "beta2": 0.99, "grad_clip_norm": 0.5, "scheduler": "cosine", "warmup_steps": 2},
    "data": {"dataset": TRAIN, "split": "train[:32]", "messages_key": "conversation", "tools_key": "fns",
             "system_key": "sys", "max_length": 64, "train_on_what": "all_assistant_messages", "eval_dataset": EVAL,
             "eval_split": "test"},
    "batch_size": 8, "num_steps": 7, "seed": 7, "packing": True, "pack_length": 128,
    "micro_batch_rows_per_device": 4,
    "eval_interval": 3, "eval_before_train": True, "ckpt_path": "/ckpt", "ckpt_interval": 2, "max_ckpts_to_keep": 3,
    "resume_from": "latest", "export_path": "/exp", "hf_save_interval": 4, "cache_dir": "/cache",
    "force_recache": True, "dummy_run_max_steps": 2, "wandb_project": "proj", "wandb_run_name": "r1",
    "wandb_tags": ["a", "b"],
}


def write(tmp_path, values, name="seed.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values))
    return str(path)


def test_seed_yaml_equals_native_config(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is placement-only: no warning may fire
        seed = load_config(write(tmp_path, SEED), [])
    native = load_config(write(tmp_path, NATIVE, "native.yaml"), [])
    assert seed.model_dump() == native.model_dump() == SFTConfig.model_validate(NATIVE).model_dump()
    assert seed.training_mode == "lora"
    # forcing the format gives the same; the SkyRL defaults are SkyRL's (rank 0, lr 1e-6, betas 0.9/0.999, ...)
    assert load_config(write(tmp_path, SEED), [], fmt="seed") == seed
    default = load_config(None, [f"dataset_name={TRAIN}"])
    assert (default.base_model, default.batch_size, default.seed, default.runs[0].learning_rate) == ("Qwen/Qwen3-0.6B", 4, 42, 1e-6)
    assert (default.optimizer.beta2, default.runs[0].weight_decay, default.data.max_length) == (0.999, 0.01, None)
    assert (default.data.split, default.micro_batch_rows_per_device, default.packing, default.ckpt_path) == (
        "train[:100]", 2, False, None)


def test_dotted_overrides(tmp_path):
    path = write(tmp_path, SEED)
    cfg = load_config(path, ["model.lora.rank=16", "model.lora.target_modules=[q_proj, k_proj, v_proj, o_proj, lm_head]",
                             "optimizer_config.lr=3e-4", "optimizer_config.adam_betas=[0.9, 0.95]", "batch_size=2",
                             "tx.micro_batch_tokens=4096", "tx.data.max_length=96", "max_tokens_per_microbatch=192"])
    run = cfg.runs[0]
    assert (run.rank, run.learning_rate, run.train_attn, run.train_mlp, run.train_unembed) == (16, 3e-4, True, False, True)
    assert (cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.batch_size) == (0.9, 0.95, 2)
    assert (cfg.micro_batch_tokens, cfg.data.max_length, cfg.pack_length) == (4096, 96, 192)  # tx: section merged last
    # overrides alone make a SkyRL-format config too
    cfg = load_config(None, ["model.path=tiny", f"dataset_name={TRAIN}", "model.lora.rank=4", "num_steps=3"])
    assert (cfg.base_model, cfg.runs[0].rank, cfg.num_steps, cfg.data.dataset) == ("tiny", 4, 3, TRAIN)
    with pytest.raises(ValueError, match="Cannot specify both num_epochs and num_steps"):
        load_config(path, ["num_epochs=2", "num_steps=3"])
    with pytest.raises(ValueError, match="model.path is not a section"):
        load_config(path, ["model.path.x=1"])
    with pytest.raises(ValueError, match=r"'\+' prefix"):
        load_config(path, ["+model.extra=1"])


@pytest.mark.parametrize("override,named", [
    ("bogus_key=1", "bogus_key"),
    ("model.lora.rnk=8", "model.lora.rnk"),
    ("optimizer_config.learning_rate=1e-4", "optimizer_config.learning_rate"),
    ("placement.num_gpu=2", "placement.num_gpu"),
    ("optimizer_config.scheduler=polynomial", "optimizer_config.scheduler"),
    ("optimizer_config.adam_betas=[0.9, 1.5]", "optimizer_config.adam_betas"),
    ("batch_size=0", "batch_size"),
])
def test_unknown_keys_and_bad_values_name_the_key(tmp_path, override, named):
    with pytest.raises(ValidationError) as info:
        load_config(write(tmp_path, SEED), [override])
    assert named in str(info.value).replace("\n  ", ".")  # pydantic prints the location dotted


def test_mixed_formats_and_unhonourable_values_are_errors(tmp_path):
    path = write(tmp_path, SEED)
    with pytest.raises(ValueError, match=r"mixes SkyRL SFTConfig keys \[.*'model'.*\] with tx SFTConfig keys \['runs'\]"):
        load_config(path, ["runs=[]"])
    for override, message in [
        ("model.lora.dropout=0.1", "model.lora.dropout = 0.1"),
        ("model.lora.init_method=xavier", "model.lora.init_method = 'xavier'"),
        ("model_config_kwargs={rope_theta: 1.0}", "model_config_kwargs"),
        ("logger=tensorboard", r"logger: \['tensorboard'\]"),
        ("model.lora.target_modules=[q_proj, v_proj]", r"adapt only \['q_proj', 'v_proj'\]"),
        ("model.lora.target_modules=[qkv]", r"target_modules: \['qkv'\]"),
        ("model.lora.exclude_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]", "no layer"),
        ("export_path=''", None),  # hf_save_interval falls back to ckpt_path/hf_exports: fine
    ]:
        if message is None:
            assert load_config(path, [override]).export_path == "/ckpt/hf_exports"
            continue
        with pytest.raises(ValueError, match=message):
            load_config(path, [override])


def test_placement_fields_are_refused_by_name_with_the_reason(tmp_path):
    placement = ["placement.num_nodes=2", "placement.num_gpus_per_node=8", "megatron_config.tensor_model_parallel_size=4",
                 "fsdp_config.cpu_offload=true", "fsdp_config.mixed_precision.param_dtype=fp32", "strategy=fsdp",
                 "sequence_parallel_size=2", "use_torch_compile=true", "record_memory=true",
                 "enable_ray_gpu_monitor=false", "num_workers=0", "remove_microbatch_padding=false",
                 "optimizer_config.offload_after_step=false", "model.lora.lora_sync_path=/x"]
    for override in placement:  # one policy with tx.rl: refused, naming the field and why
        with pytest.raises(ValueError, match=rf"^{re.escape(override.split('=')[0])}: not applicable to tx \(.+\); "
                                             "remove it$"):
            load_config(write(tmp_path, SEED), [override])
    with pytest.raises(ValueError, match="only one of use_sample_packing"):
        load_config(write(tmp_path, SEED), ["use_sample_packing=true", "remove_microbatch_padding=true"])


def test_rank_zero_is_full_training_with_the_seed_precision(tmp_path):
    no_rank = {k: v for k, v in SEED.items() if k != "model"} | {"model": {"path": "tiny"}}
    cfg = load_config(write(tmp_path, no_rank), [])  # SkyRL's default rank is 0
    assert (cfg.runs[0].rank, cfg.training_mode, cfg.mixed_precision) == (0, "full", None)
    assert load_config(write(tmp_path, SEED), ["model.lora.rank=0"]).training_mode == "full"
    with warnings.catch_warnings():
        warnings.simplefilter("error", SeedFieldIgnored)  # honoured with rank 0, so not warned about
        fp32 = load_config(write(tmp_path, no_rank), ["fsdp_config.mixed_precision.param_dtype=fp32"])
    assert fp32.mixed_precision.param_dtype == "fp32"
    with pytest.raises(ValueError, match="param_dtype"):
        load_config(write(tmp_path, no_rank), ["fsdp_config.mixed_precision.param_dtype=fp16"])
    # native spelling: rank 0 alone is the same intent; in a sweep it is refused
    native = NATIVE | {"runs": [{"name": "all", "rank": 0}]}
    assert SFTConfig.model_validate(native).training_mode == "full"
    with pytest.raises(ValidationError, match=r"\['all'\] have rank 0 .* full training owns the base weights"):
        SFTConfig.model_validate(NATIVE | {"runs": [{"name": "all", "rank": 0}, {"name": "lora", "rank": 8}]})
    with pytest.raises(ValidationError, match="mixed_precision applies to full training"):
        SFTConfig.model_validate(NATIVE | {"mixed_precision": {"param_dtype": "fp32"}})
    with pytest.raises(ValidationError, match="export_merged: a rank-0 run's export"):
        SFTConfig.model_validate(native | {"export_merged": True})


def test_seed_full_training_trains_and_exports_an_hf_model(tiny_dirs, tmp_path):
    """`python -m tx.sft` on the bundled SkyRL-format example with rank 0 (SkyRL's default): every weight
    trains, the loss falls, the step is checkpointed, and the export is an HF model transformers loads
    without missing keys whose loss on the training data is below the base model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    overrides = [f"model.path={tiny_dirs['dense']}", "model.lora.rank=0", "num_steps=3", "optimizer_config.lr=1e-3",
                 "optimizer_config.num_warmup_steps=0", f"ckpt_path={tmp_path / 'ckpts'}",
                 f"export_path={tmp_path / 'export'}", "eval_dataset_name=null"]
    proc = subprocess.run([sys.executable, "-m", "tx.sft", "--config", "examples/sft_seed_tiny.yaml", *overrides],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=300, env=one_device_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    losses = [r["policy/loss"] for r in records if "policy/loss" in r]
    assert len(losses) == 3 and losses[2] < losses[0]
    assert (tmp_path / "ckpts" / "global_step_3" / "policy" / "LATEST").exists()
    trained, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "policy", dtype=torch.float32,
                                                         output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)
    moved = [(a - b).abs().max().item() for a, b in zip(trained.parameters(), base.parameters())]
    assert min(moved) > 0  # every tensor was trained (norm weights included)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs["dense"])
    example = json.loads(Path(TRAIN).read_text().splitlines()[0])["messages"]
    ids = torch.tensor([tokenizer.apply_chat_template(example, tokenize=True, return_dict=True)["input_ids"]])
    with torch.no_grad():
        assert trained(ids, labels=ids).loss < base(ids, labels=ids).loss


def test_split_slices_system_prompt_and_json_tools():
    lines = [json.loads(x) for x in Path(TRAIN).read_text().splitlines()]
    assert load_rows(TRAIN, "train[:10]") == lines[:10]
    assert load_rows(TRAIN, "validation[25%:]") == lines[16:]  # a local file has one split: only the slice counts
    assert load_rows(TRAIN, "train[-3:]") == lines[-3:]
    with pytest.raises(ValueError, match="data.split"):
        load_rows(TRAIN, "train[a:b]")
    data = SFTConfig.model_validate(NATIVE).data.model_copy(update={"messages_key": "messages", "tools_key": "tools"})
    has_system = {"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}], "sys": "extra",
                  "tools": '[{"name": "f"}]'}
    messages, tools = to_messages(has_system, data)
    assert [m["content"] for m in messages] == ["own", "q"] and tools == [{"name": "f"}]
    messages, _ = to_messages({"messages": [{"role": "user", "content": "q"}], "sys": "extra"}, data)
    assert [m["content"] for m in messages] == ["extra", "q"]


def test_seed_lora_config_trains_end_to_end(tiny_dirs, tmp_path):
    """The bundled SkyRL-format example (rank 8), 3 steps, through the CLI with SkyRL-style overrides."""
    overrides = [f"model.path={tiny_dirs['dense']}", "num_steps=3", f"ckpt_path={tmp_path / 'ckpts'}",
                 f"export_path={tmp_path / 'export'}", "eval_dataset_name=null"]  # no eval: one compile less
    proc = subprocess.run([sys.executable, "-m", "tx.sft", "--progress", "--config", "examples/sft_seed_tiny.yaml",
                           *overrides], check=False, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=one_device_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    losses = [r["policy/loss"] for r in records if "policy/loss" in r]
    assert len(losses) == 3 and losses[2] < losses[0]
    assert records[-1]["summary"] and records[-1]["steps"] == 3
    # --progress: the bar on stderr (not a terminal here), the JSON lines alone on stdout
    assert "sft: 100%" in proc.stderr and "3/3" in proc.stderr and "tok/s=" in proc.stderr, proc.stderr[-2000:]
    assert all(line.startswith("{") for line in proc.stdout.splitlines() if line.strip()), proc.stdout[-2000:]
    # SkyRL's layout: <ckpt_path>/global_step_N/policy, exports under <export_path>/policy
    assert (tmp_path / "ckpts" / "global_step_3" / "policy").is_dir()
    assert (tmp_path / "ckpts" / "latest_ckpt_global_step.txt").read_text() == "3"
    adapter = json.loads((tmp_path / "export" / "policy" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["lora_alpha"] == 16
    assert "lm_head" not in adapter["target_modules"] and "q_proj" in adapter["target_modules"]  # all-linear


def test_no_max_length_means_no_truncation(tiny_dirs, tmp_path):
    """SkyRL's default max_length (None): examples keep their full length, past tx's own default of 2048."""
    from transformers import AutoTokenizer

    rows = [json.loads(x) for x in Path(TRAIN).read_text().splitlines()[:4]]
    rows.append({"messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": " word" * 2500}]})
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"model.path={tiny_dirs['dense']}", f"dataset_name={data}", "model.lora.rank=4",
                             "disable_cache=true", "num_steps=1"])
    assert cfg.data.max_length is None and cfg.pack_length is None
    trainer = SFTTrainer(cfg)
    tok = AutoTokenizer.from_pretrained(tiny_dirs["dense"])
    full = [len(tok(tok.apply_chat_template(r["messages"], tokenize=False), add_special_tokens=False).input_ids) - 1
            for r in rows]
    assert [len(e.input_ids) for e in trainer.train] == full and max(full) > 2500
    assert trainer.backend.max_seq_len == trainer.backend.model.config.max_position_embeddings
