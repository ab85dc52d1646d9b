"""Local stand-ins for the hub data sets and model that tinker-cookbook's recipes load by hub id.

A recipe run from `run_dir` with the HF libraries offline resolves `Qwen/Qwen3-8B` to the tiny model (a
symlink) and `openai/gsm8k`, `Anthropic/hh-rlhf` to the small JSON-lines sets written here; SDFT reads an
Arrow set given by path. The server, started in the same directory with base model `Qwen/Qwen3-8B`,
loads the same tiny model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MODEL = "Qwen/Qwen3-8B"

# GSM8K-style rows: the reward is 1 when the sampled `\boxed{}` holds the number after `####`.
GSM8K = [
    ("Tom has 1 apple and gets 2 more. How many apples?", "1 + 2 = 3\n#### 3"),
    ("A box holds 2 pens and 2 pencils. How many things?", "2 + 2 = 4\n#### 4"),
    ("Sam reads 1 page, then 2 more. How many pages?", "1 + 2 = 3\n#### 3"),
    ("Ann walks 3 miles, then 1 mile. How many miles?", "3 + 1 = 4\n#### 4"),
]
HH = [
    ("Say hi.", "Hi there!", "Go away."),
    ("Name a fruit.", "An apple.", "A rock."),
    ("What is 2 + 2?", "4.", "5."),
    ("Be kind.", "Of course, happy to help.", "No."),
]
SDFT = [
    ("Call the weather tool for Paris.", "weather(city='Paris')"),
    ("Look up the time in Tokyo.", "time(city='Tokyo')"),
    ("Convert 3 km to miles.", "convert(3, 'km', 'mi')"),
    ("Find a recipe for soup.", "recipes(query='soup')"),
    ("Translate hello to French.", "translate('hello', 'fr')"),
    ("Get the stock price of ACME.", "stock('ACME')"),
    ("Send an email to Bob.", "email(to='Bob')"),
    ("Search news about rain.", "news(query='rain')"),
    ("Play a song by Queen.", "music(artist='Queen')"),
    ("Set a timer for 5 minutes.", "timer(minutes=5)"),
]


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_run_dir(run: Path, tiny_dir: str) -> None:
    (run / "Qwen").mkdir(parents=True)
    (run / MODEL).symlink_to(Path(tiny_dir).resolve(), target_is_directory=True)

    gsm = run / "openai" / "gsm8k"
    rows = [{"question": q, "answer": a} for q, a in GSM8K]
    _jsonl(gsm / "main" / "train.jsonl", rows)
    _jsonl(gsm / "main" / "test.jsonl", rows[:2])
    # the config name `main` that the recipes pass to load_dataset is declared in the card's YAML header
    (gsm / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
        "  - split: test\n    path: main/test.jsonl\n---\n")

    def hh(q: str, a: str) -> str:
        return f"\n\nHuman: {q}\n\nAssistant: {a}"

    pairs = [{"chosen": hh(q, good), "rejected": hh(q, bad)} for q, good, bad in HH]
    _jsonl(run / "Anthropic" / "hh-rlhf" / "train.jsonl", pairs * 2)
    _jsonl(run / "Anthropic" / "hh-rlhf" / "test.jsonl", pairs[:2])

    import datasets  # the cookbook's dependency; imported late so that collecting this module stays cheap

    datasets.Dataset.from_dict({"prompt": [q for q, _ in SDFT], "golden_response": [a for _, a in SDFT]}) \
        .save_to_disk(str(run / "toolalpaca"))


def recipe_env(base_url: str, api_key: str, hf_home: Path) -> dict[str, str]:
    env = {**os.environ, "TINKER_API_KEY": api_key, "TINKER_BASE_URL": base_url, "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(hf_home),
           "TINKER_TELEMETRY": "0", "WANDB_MODE": "disabled"}
    for var in ("XLA_FLAGS", "JAX_PLATFORMS"):  # set by conftest for the test process; recipes have no use for them
        env.pop(var, None)
    return env
