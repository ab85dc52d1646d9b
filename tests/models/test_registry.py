"""The model-family registry (tx.models.registry on tx.registry.Registry): a second registration of an
architecture is an error unless replace=True; unknown names list what is registered."""

import pytest
from flax import nnx

from tx.models.qwen3 import Qwen3ForCausalLM
from tx.models.registry import FAMILIES, model_class, register
from tx.registry import Registry


class _A(nnx.Module):
    pass


class _B(nnx.Module):
    pass


@pytest.fixture
def scratch_name():
    yield "TestOnlyForCausalLM"
    if "TestOnlyForCausalLM" in FAMILIES:
        FAMILIES.unregister("TestOnlyForCausalLM")


def test_duplicate_architecture_is_refused_unless_replace(scratch_name):
    register(scratch_name)(_A)
    register(scratch_name)(_A)  # the same class again (a module run twice): harmless
    with pytest.raises(ValueError, match=rf"architecture '{scratch_name}' is already registered \(to "
                                         rf"{__name__}\._A\); pass replace=True to replace it with {__name__}\._B"):
        register(scratch_name)(_B)
    assert model_class(scratch_name) is _A
    register(scratch_name, replace=True)(_B)
    assert model_class(scratch_name) is _B


def test_builtin_family_is_not_silently_replaced(scratch_name):
    with pytest.raises(ValueError, match="architecture 'Qwen3ForCausalLM' is already registered"):
        register(scratch_name, "Qwen3ForCausalLM")(_A)
    assert model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert scratch_name not in FAMILIES  # all or nothing: no name was taken


def test_unknown_name_lists_the_registered():
    reg = Registry("widget")
    with pytest.raises(ValueError, match=r"unknown widget 'x'; registered: \(none\)"):
        reg.get("x")
    reg.register("b", 1)
    reg.register("a", 2)
    with pytest.raises(ValueError, match="unknown widget 'x'; registered: a, b"):
        reg.get("x")
    assert list(reg) == ["a", "b"] and len(reg) == 2 and "a" in reg
