"""tx.training.overrides: `key=value` overrides (dotted keys, YAML values) on a YAML file's mapping, their errors,
and the deep merge the seed configs' `tx:` sections and RL runs use."""

import pytest

from tx.training.overrides import apply_overrides, deep_merge, load_values


def test_overrides_set_nested_keys_with_yaml_values():
    values = {"trainer": {"epochs": 1, "policy": {"optimizer_config": {"lr": 1e-6}}}}
    top = apply_overrides(values, ["trainer.policy.optimizer_config.lr=0.0001", "trainer.algorithm.use_kl_loss=false",
                                   "runs=[{name: a}]", "name=x=y"])
    assert values == {"trainer": {"epochs": 1, "policy": {"optimizer_config": {"lr": 0.0001}},
                                  "algorithm": {"use_kl_loss": False}},
                      "runs": [{"name": "a"}], "name": "x=y"}
    assert top == {"trainer", "runs", "name"}


@pytest.mark.parametrize("item, message", [
    ("trainer.epochs", "must look like key=value"),
    ("=3", "must look like key=value"),
    ("+trainer.x=1", r"the '\+' prefix is not supported"),
    ("a.b.c=1", "a.b is not a section"),
])
def test_bad_overrides_name_the_item(item, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides({"a": {"b": 3}}, [item])


def test_load_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("batch_size: 4\ndata: {dataset: d.jsonl}\n")
    assert load_values(str(path), ["data.max_length=64"]) == ({"batch_size": 4, "data": {"dataset": "d.jsonl",
                                                                                          "max_length": 64}}, {"data"})
    assert load_values(None, []) == ({}, set())
    (tmp_path / "empty.yaml").write_text("")
    assert load_values(str(tmp_path / "empty.yaml"), ["a=1"]) == ({"a": 1}, {"a"})
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected a mapping of config fields, got list"):
        load_values(str(tmp_path / "list.yaml"), [])


def test_deep_merge():
    base = {"a": {"x": 1, "y": {"z": 2}}, "b": [1], "c": 3}
    assert deep_merge(base, {"a": {"y": {"w": 4}}, "b": [2], "d": {"e": 5}}) == \
        {"a": {"x": 1, "y": {"z": 2, "w": 4}}, "b": [2], "c": 3, "d": {"e": 5}}
    assert base == {"a": {"x": 1, "y": {"z": 2}}, "b": [1], "c": 3}  # the inputs are not changed
    assert deep_merge({"a": 1}, {"a": {"b": 2}}) == {"a": {"b": 2}}  # a mapping replaces a value
