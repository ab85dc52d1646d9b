"""`--extra-base-model` parsing and validation, and how the API resolves a request's base model."""

from __future__ import annotations

import pytest

from tx.api.common import ApiError
from tx.api.config import ServedModel
from tx.api.served import ServedModels
from tx.run import base_models, build_parser


def parse(*argv: str):
    parser = build_parser()
    return base_models(parser.parse_args(list(argv)), parser)


def test_extra_base_models_are_repeatable_and_ordered():
    models = parse("--base-model", "org/a", "--extra-base-model", "org/b", "--extra-base-model", "tiny")
    assert models.names() == ["org/a", "org/b", "tiny"]
    assert parse().names() == ["tiny"]


@pytest.mark.parametrize("argv, words", [
    (("--base-model", "org/a", "--extra-base-model", "org/a"), "'org/a' is given twice"),
    (("--extra-base-model", "tiny"), "'tiny' is given twice"),
    (("--extra-base-model", " "), "base model name ' ' is blank"),
])
def test_bad_base_model_lists_are_refused_naming_the_value(argv, words, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert words in capsys.readouterr().err


def served(name: str, *aliases: str) -> ServedModel:
    return ServedModel(model_name=name, aliases=[name, *aliases], tokenizer_id=name, arch="Qwen3ForCausalLM",
                       max_context_length=128, max_lora_rank=8, max_num_samples=4)


def test_served_models_resolve_by_alias_and_refuse_what_is_not_served():
    a, b = served("org/a", "/models/a"), served("org/b", "/models/b")
    models = ServedModels([a, b])
    assert models.find(None) is a and models.find("/models/b") is b and models.find("org/b") is b
    with pytest.raises(ApiError, match=r"base_model 'org/c' is not served here; this server serves 'org/a', 'org/b'"):
        models.find("org/c")
    assert models.matching(None, b, "path x") is b and models.matching("/models/b", b, "path x") is b
    with pytest.raises(ApiError, match=r"base_model 'org/a' does not match path x, which was trained on base model "
                                       r"'org/b'"):
        models.matching("org/a", b, "path x")
    with pytest.raises(ApiError, match=r"path y was trained on base model 'org/gone', which this server no longer"):
        models.trained_on("org/gone", "path y")
