"""The logical-axis rules: names resolve to mesh axes first-free-rule-wins, weights vs activations, the
compute layout, fallbacks, and the config field that carries the table."""

import jax
import pytest
from jax.sharding import PartitionSpec as P
from pydantic import ValidationError

from tx.backends.config import JaxBackendConfig
from tx.log import forget_warnings
from tx.models.logical import DEFAULT_RULES, LogicalSharding, check_rules
from tx.models.sharding import make_mesh


@pytest.fixture
def mesh222():
    return make_mesh(2, 2, 2)


def test_one_table_lays_out_weights_and_activations(mesh222):
    shard = LogicalSharding(mesh222, DEFAULT_RULES, heads=(8, 4))
    assert shard.spec(("embed", "mlp")) == P("fsdp", "tp")  # ZeRO-3 x Megatron
    assert shard.spec(("batch", "length", "embed")) == P("fsdp", None, None)  # batch took fsdp first
    assert shard.spec(("batch", "length", "heads", "head_dim")) == P("fsdp", None, "tp", None)
    assert shard.spec(("layers", "expert", "embed", "mlp")) == P(None, "ep", "fsdp", "tp")
    assert shard.spec(("adapter", "embed", "rank")) == P(None, "fsdp", None)
    # the compute layout of a weight: as if the batch had taken fsdp (gathered over it, still split over tp)
    assert shard.spec(("embed", "mlp"), taken=shard.batch_axes) == P(None, "tp")
    assert shard.batch_axes == ("fsdp",)
    assert shard.gathers(jax.ShapeDtypeStruct((64, 32), "float32"), ("embed", "mlp"))
    assert not shard.gathers(jax.ShapeDtypeStruct((64, 32), "float32"), ("mlp", None))


def test_a_name_may_fall_back_to_a_later_rule(mesh222):
    rules = check_rules([("batch", "fsdp"), ("batch", "ep"), ("embed", "fsdp")])
    shard = LogicalSharding(mesh222, rules)
    assert shard.spec(("batch", "embed")) == P("fsdp", None)
    assert shard.spec(("embed", "batch")) == P("fsdp", "ep")  # embed took fsdp, so batch takes its next rule


def test_non_divisible_dims_are_replicated_and_keep_their_claim(mesh222, caplog):
    forget_warnings()
    shard = LogicalSharding(make_mesh(8, 1, 1), DEFAULT_RULES)
    # one decode row cannot split over fsdp=8: it stays whole, and embed does not take fsdp instead
    assert shard.spec(("batch", "length", "embed"), (1, 1, 64)) == P(None, None, None)
    assert shard.spec(("embed", "mlp"), (12, 64), what="w") == P(None, "tp")  # tp has size 1 here
    assert "replicating dim of size 12 of w" in caplog.text


def test_heads_split_together_or_not_at_all(mesh222, caplog):
    forget_warnings()
    tp8 = make_mesh(1, 1, 8)
    assert LogicalSharding(tp8, DEFAULT_RULES, heads=(16, 8)).spec(("embed", "kv_heads")) == P("fsdp", "tp")
    shard = LogicalSharding(tp8, DEFAULT_RULES, heads=(16, 4))  # 4 kv heads do not divide tp=8
    assert shard.spec(("embed", "heads")) == P("fsdp", None)
    assert "num_key_value_heads=4 do not both divide 8" in caplog.text
    assert LogicalSharding(tp8, DEFAULT_RULES, heads=(16, 8), shard_heads=False).spec(("heads",)) == P(None)


def test_constrain_and_local_are_identities_without_a_mesh():
    x = jax.numpy.ones((2, 3))
    assert LogicalSharding().constrain(x, ("batch", "embed")) is x
    one = LogicalSharding(make_mesh(devices=jax.devices()[:1]))
    assert one.constrain(x, ("batch", "embed")) is x
    fn = lambda a: a  # noqa: E731
    assert one.local(fn, [("batch", "embed")], ("batch", "embed")) is fn


def test_the_rules_are_a_validated_config_field():
    assert JaxBackendConfig().logical_axis_rules == DEFAULT_RULES
    custom = JaxBackendConfig(logical_axis_rules=[["batch", "fsdp"], ["mlp", None]])
    assert custom.logical_axis_rules == (("batch", "fsdp"), ("mlp", None))
    with pytest.raises(ValidationError, match="logical axis 'hidden' is not one of"):
        JaxBackendConfig(logical_axis_rules=[["hidden", "fsdp"]])
    with pytest.raises(ValidationError, match="mesh axis 'data' \\(for 'batch'\\)"):
        JaxBackendConfig(logical_axis_rules=[["batch", "data"]])
    with pytest.raises(ValidationError, match="logical_axis_rules"):
        JaxBackendConfig(logical_axis_rules=[["batch"]])
