"""The generic registry every registry of tx uses (losses, policy losses, advantage estimators, envs, models)."""

import pytest

from tx.registry import Registry, UnknownName


def f():
    pass


def test_unknown_name_is_a_key_and_value_error_with_a_plain_message():
    reg: Registry = Registry("gadget")
    reg.register("b", f)
    reg.register("a", len)
    with pytest.raises(UnknownName) as info:
        reg.get("c")
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert str(info.value) == "unknown gadget 'c'; registered: a, b"  # not KeyError's quoted repr


def test_strict_refuses_the_same_object_again_and_the_default_does_not():
    lax, strict = Registry("x"), Registry("y", strict=True)
    for reg in (lax, strict):
        reg.register("f", f)
    assert lax.register("f", f) is f
    with pytest.raises(ValueError, match="y 'f' is already registered"):
        strict.register("f", f)
    assert strict.register("f", f, replace=True) is f


def test_snapshot_and_restore():
    reg: Registry = Registry("x")
    reg.register("f", f)
    saved = reg.snapshot()
    reg.register("g", len)
    reg.unregister("f")
    assert reg.names() == ["g"]
    reg.restore(saved)
    assert reg.names() == ["f"] and reg.items() == [("f", f)]
