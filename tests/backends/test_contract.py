"""The backend contract (tx/backends/base.py): both training modes satisfy the `Backend` / `LocalBackend`
Protocols with matching signatures, and tx's callers (engine, distributed wrapper and worker, precompile, run,
API) call nothing on a backend that the Protocols do not state."""

import ast
import inspect
import re
import typing
from pathlib import Path

import pytest

import tx
from tx.backends.base import Backend, LocalBackend
from tx.backends.full import backend_class
from tx.backends.full_state import FullWeightsState
from tx.backends.lora_state import LoraSlotsState
from tx.backends.state import TrainingState
from tx.distributed.backend import BROADCAST, DistributedBackend

TX = Path(tx.__file__).resolve().parent


def members(protocol: type) -> set[str]:
    return set(typing._get_protocol_attrs(protocol))  # what runtime_checkable's isinstance checks


def protocol_methods(protocol: type) -> dict[str, inspect.Signature]:
    out = {}
    for klass in protocol.__mro__:
        for name, value in vars(klass).items():
            if name in members(protocol) and inspect.isfunction(value) and name not in out:
                out[name] = inspect.signature(value)
    return out


def signature_mismatch(wanted: inspect.Signature, got: inspect.Signature) -> str | None:
    """None when `got` takes the Protocol's parameters by the same names, kinds and defaults."""
    want_params, got_params = list(wanted.parameters.values()), list(got.parameters.values())
    if [(p.name, p.kind) for p in want_params] != [(p.name, p.kind) for p in got_params[: len(want_params)]]:
        return f"parameters {[p.name for p in got_params]} != {[p.name for p in want_params]}"
    for w, g in zip(want_params, got_params):
        if w.default is not inspect.Parameter.empty and w.default != g.default:
            return f"{w.name}: default {g.default!r} != {w.default!r}"
    extra = [p.name for p in got_params[len(want_params):] if p.default is inspect.Parameter.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return f"extra required parameters {extra}" if extra else None


@pytest.mark.parametrize("cls,protocol", [(tx.JaxBackend, LocalBackend), (tx.FullBackend, LocalBackend),
                                          (DistributedBackend, Backend)])
def test_every_protocol_method_exists_with_its_signature(cls, protocol):
    bad = {}
    for name, wanted in protocol_methods(protocol).items():
        impl = inspect.getattr_static(cls, name, None)
        if impl is None:
            bad[name] = "missing"
        elif isinstance(impl, property):
            bad[name] = "a property where the Protocol has a method"
        elif (why := signature_mismatch(wanted, inspect.signature(getattr(cls, name)))) is not None:
            bad[name] = why
    for name in members(protocol) - set(protocol_methods(protocol)):  # properties / attributes
        impl = inspect.getattr_static(cls, name, None)
        if impl is not None and inspect.isfunction(impl):
            bad[name] = "a method where the Protocol has an attribute"
    assert not bad, bad


def test_real_backends_of_both_modes_are_instances(tiny_dirs):
    lora = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(max_seq_len=64))
    full = tx.FullBackend(tiny_dirs["dense"], tx.JaxBackendConfig(training_mode="full", max_seq_len=64))
    for backend in (lora, full):
        assert isinstance(backend, LocalBackend), type(backend).__name__
        missing = [m for m in members(LocalBackend) if not hasattr(backend, m)]
        assert not missing, missing
    assert (lora.training_mode, full.training_mode) == ("lora", "full")
    wrapped = DistributedBackend(tiny_dirs["dense"], tx.JaxBackendConfig(max_seq_len=64))
    assert isinstance(wrapped, Backend) and isinstance(wrapped.impl, LocalBackend)
    assert not isinstance(object(), Backend)


# ---- what the callers call: attribute reads on an expression that is a backend ----

OWN = {"shutdown", "impl"}  # DistributedBackend's own, beyond the Protocol (run.py stops the workers)

# module -> [(receiver expressions, as ast.unparse writes them, that are a backend), names allowed on them]
SCOPES = {
    "engine/engine.py": [(r"backend|self\.backend|self\.backends\[.+\]|self\._backend_of\(.*\)", "Backend")],
    "engine/single_ops.py": [(r"backend|self\._backend_of\(.*\)|self\._served\(.*\)|self\._created_on\(.*\)",
                              "Backend")],
    "engine/sampling.py": [(r"self\._served\(.*\)|self\._backend_of\(.*\)", "Backend")],
    "distributed/backend.py": [(r"self\.impl", "Backend")],
    "distributed/worker.py": [(r"backend|backends\[.+\]", "LocalBackend")],
    "distributed/checks.py": [(r"backend", "LocalBackend")],
    "distributed/models.py": [(r"impl|backend\.impl", "LocalBackend")],
    "backends/precompile.py": [(r"backend", "Backend"), (r"impl", "LocalBackend")],
    "run.py": [(r"backend", "Backend+own"), (r"backend\.impl", "LocalBackend")],
    "api/server.py": [(r"(backend|b)\.impl", "LocalBackend")],
    "api/admin_routes.py": [(r"engine\.backend|b", "Backend")],
}
ALLOWED = {"Backend": members(Backend), "LocalBackend": members(LocalBackend), "Backend+own": members(Backend) | OWN}


def calls_on(source: str, receiver: str) -> tuple[set[str], set[str]]:
    """(names read on a receiver matching `receiver`, receivers of a `getattr(receiver, name)` with a
    computed name)."""
    pattern = re.compile(rf"(?:{receiver})")
    names, dynamic = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and pattern.fullmatch(ast.unparse(node.value)):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and pattern.fullmatch(ast.unparse(node.args[0]))):
            if isinstance(node.args[1], ast.Constant):
                names.add(node.args[1].value)
            else:
                dynamic.add(ast.unparse(node.args[1]))
    return names, dynamic


def test_the_call_finder_finds_calls():
    src = "backend.create_model(1)\nx = self.backends['a'].forward\ngetattr(backend, kind)()\nother.delete_model()"
    assert calls_on(src, r"backend|self\.backends\[.+\]") == ({"create_model", "forward"}, {"kind"})


@pytest.mark.parametrize("module", sorted(SCOPES))
def test_callers_call_nothing_outside_the_protocol(module):
    source = (TX / module).read_text()
    for receiver, allowed in SCOPES[module]:
        names, dynamic = calls_on(source, receiver)
        assert names or dynamic, f"{module}: no call on {receiver!r} found (renamed? update SCOPES)"
        outside = names - ALLOWED[allowed]
        assert not outside, f"{module} calls {sorted(outside)} on a backend, outside the {allowed} Protocol"
        # a computed name: the engine's pass kinds, or the broadcast methods (distributed/backend.py, worker.py)
        assert dynamic <= {"kind", "method"}, dynamic


def test_computed_calls_stay_inside_the_protocol():
    assert set(BROADCAST) <= members(Backend), set(BROADCAST) - members(Backend)
    assert {"forward", "forward_backward"} <= members(Backend)  # the engine's pass kinds


# ---- one backend class, composed with a training state ----


def test_full_backend_overrides_nothing():
    """FullBackend only picks the full-weights state (and adds the full state's inspection methods): every
    behaviour of both modes is the one JaxBackend's, composed with its state."""
    overridden = [name for name, value in vars(tx.FullBackend).items() if name in dir(tx.JaxBackend)
                  and (callable(value) or isinstance(value, (property, staticmethod, classmethod)))]
    assert not overridden, overridden
    assert backend_class(tx.JaxBackendConfig(training_mode="full")) is tx.FullBackend


def test_both_training_states_satisfy_the_strategy_protocol(tiny_dirs):
    lora = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(max_seq_len=64))
    full = tx.FullBackend(tiny_dirs["dense"], tx.JaxBackendConfig(training_mode="full", max_seq_len=64))
    assert (type(lora.state), type(full.state)) == (LoraSlotsState, FullWeightsState)
    for state in (lora.state, full.state):
        assert isinstance(state, TrainingState), type(state).__name__
    for cls in (LoraSlotsState, FullWeightsState):
        bad = {name: why for name, wanted in protocol_methods(TrainingState).items()
               if (why := signature_mismatch(wanted, inspect.signature(getattr(cls, name)))) is not None}
        assert not bad, (cls.__name__, bad)
