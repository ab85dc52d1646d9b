"""Tinker ids and checkpoint paths: what parse_tinker_path and check_name accept and refuse."""

from __future__ import annotations

import pytest

from tx.engine import paths
from tx.engine.ops import UserError


def test_parse_accepts_a_training_checkpoint_path():
    assert paths.parse_tinker_path("tinker://sess-abc:train:0/weights/000020") == ("sess-abc:train:0", "weights", "000020")


def test_parse_accepts_a_sampler_checkpoint_path():
    assert paths.parse_tinker_path("tinker://s_1:train:42/sampler_weights/final.v2-x") == (
        "s_1:train:42", "sampler_weights", "final.v2-x")


def test_parse_round_trips_tinker_path():
    made = paths.tinker_path(paths.model_id_of("sess-abc", 7), "weights", "step_10")
    assert made == "tinker://sess-abc:train:7/weights/step_10"
    assert paths.parse_tinker_path(made) == ("sess-abc:train:7", "weights", "step_10")


@pytest.mark.parametrize("path, why", [
    ("http://sess-abc:train:0/weights/000020", "not a tinker://"),
    ("tinker:/sess-abc:train:0/weights/000020", "not a tinker://"),
    ("TINKER://sess-abc:train:0/weights/000020", "not a tinker://"),
    ("sess-abc:train:0/weights/000020", "not a tinker://"),
    ("", "not a tinker://"),
    ("tinker://sess-abc:train:0/weights", "must be tinker://"),
    ("tinker://sess-abc:train:0", "must be tinker://"),
    ("tinker://", "must be tinker://"),
    ("tinker://sess-abc:train:0/weights/a/b", "must be tinker://"),
    ("tinker://sess-abc:train:0/weights/000020/", "must be tinker://"),
    ("tinker://sess-abc:train:0//weights/000020", "must be tinker://"),
    ("tinker://sess-abc:train:0/checkpoints/000020", "kind 'checkpoints'"),
    ("tinker://sess-abc:train:0/Weights/000020", "kind 'Weights'"),
    ("tinker://sess-abc:train:0/weights/..", "not a valid checkpoint name"),
    ("tinker://sess-abc:train:0/weights/.hidden", "not a valid checkpoint name"),
    ("tinker://sess-abc:train:0/weights/", "not a valid checkpoint name"),
    ("tinker://sess-abc:train:0/weights/" + "a" * 129, "not a valid checkpoint name"),
    ("tinker://sess-abc:sample:0/weights/000020", "not a model id"),
    ("tinker://sess-abc:train:x/weights/000020", "not a model id"),
    ("tinker://sess abc:train:0/weights/000020", "not a model id"),
    ("tinker://../weights/000020", "not a model id"),
    ("tinker://:train:0/weights/000020", "not a model id"),
])
def test_parse_rejects(path, why):
    with pytest.raises(UserError, match="^path ") as e:
        paths.parse_tinker_path(path)
    message = str(e.value)
    assert why in message
    # the message quotes what was wrong: the whole path, or for a bad name the name itself
    quoted = repr(path.rsplit("/", 1)[-1]) if why == "not a valid checkpoint name" else repr(path)
    assert quoted in message


def test_parse_rejects_non_strings():
    with pytest.raises(UserError, match="not a tinker://"):
        paths.parse_tinker_path(None)  # type: ignore[arg-type]


def test_parse_names_the_field():
    with pytest.raises(UserError, match=r"^tinker_path 'tinker://x' "):
        paths.parse_tinker_path("tinker://x", "tinker_path")
    with pytest.raises(UserError, match=r"^tinker_path '\.\.' is not a valid checkpoint name"):
        paths.parse_tinker_path("tinker://sess-abc:train:0/weights/..", "tinker_path")


@pytest.mark.parametrize("name", ["a", "0", "000020", "step-10_final.v2", "A" * 128, "a.b.c", "x-"])
def test_check_name_accepts(name):
    assert paths.check_name(name) == name


@pytest.mark.parametrize("name", [
    "", ".", "..", ".hidden", "-lead", "_lead", "a/b", "/abs", "a/../b", "a..b", "..a", "a..",
    "a" * 129, "a b", "a\\b", "ä", "a:b", "a\x00b", "a\nb",
])
def test_check_name_rejects(name):
    with pytest.raises(UserError, match="is not a valid checkpoint name"):
        paths.check_name(name)


@pytest.mark.parametrize("name", ["ckpt\n", "a" * 128 + "\n"])
def test_check_name_rejects_a_trailing_newline(name):
    # `$` in the pattern also matches just before a final "\n", so this needs fullmatch (or \Z).
    with pytest.raises(UserError, match="is not a valid checkpoint name"):
        paths.check_name(name)


def test_parse_rejects_a_trailing_newline_in_the_name_or_model_id():
    with pytest.raises(UserError):
        paths.parse_tinker_path("tinker://sess-abc:train:0/weights/000020\n")
    with pytest.raises(UserError):
        paths.parse_tinker_path("tinker://sess-abc:train:0\n/weights/000020")


def test_check_name_rejects_non_strings():
    with pytest.raises(UserError, match="^path 5 "):
        paths.check_name(5)  # type: ignore[arg-type]


def test_check_name_message_names_field_and_value():
    with pytest.raises(UserError) as e:
        paths.check_name("../etc", "save_path")
    message = str(e.value)
    assert message.startswith("save_path '../etc' is not a valid checkpoint name")
    assert "[A-Za-z0-9._-]" in message and "'..'" in message
    with pytest.raises(UserError, match=r"^path 'a/b' "):
        paths.check_name("a/b")  # the default field


def test_ids():
    assert paths.model_id_of("sess-abc", 3) == "sess-abc:train:3"
    assert paths.sampling_session_id_of("sess-abc", 3) == "sess-abc:sample:3"


def test_location_keeps_checkpoints_of_a_model_apart(tmp_path):
    train = paths.location(str(tmp_path), "sess-abc:train:0", "weights", "n1")
    sampler = paths.location(str(tmp_path), "sess-abc:train:0", "sampler_weights", "n1")
    assert train == str(tmp_path / "sess-abc:train:0" / "weights" / "n1")
    assert sampler == str(tmp_path / "sess-abc:train:0" / "sampler_weights" / "n1.tar.gz")
