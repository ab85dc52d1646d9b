"""The sampling package's contract with the backends (tx/sampling/source.py): both backends are weights
sources, their config has every field the engine reads, and the engine is built from the protocol alone."""

import typing

import tx
from tx.sampling.source import SamplingSettings, WeightsSource


def test_the_backend_config_has_every_setting_the_sampler_reads():
    wanted = typing.get_type_hints(SamplingSettings)
    fields = tx.JaxBackendConfig.model_fields
    assert set(wanted) <= set(fields), set(wanted) - set(fields)
    for name, kind in wanted.items():
        assert isinstance(getattr(tx.JaxBackendConfig(), name), kind), name


def test_both_backends_are_weights_sources(tiny_dirs):
    for backend in (tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(max_seq_len=64)),
                    tx.FullBackend(tiny_dirs["dense"], tx.JaxBackendConfig(training_mode="full", max_seq_len=64))):
        assert isinstance(backend, WeightsSource), type(backend).__name__
        assert backend.sampler.source is backend and backend.sampler.config is backend.config
        assert backend.sampler.runtime is backend.runtime  # its programs are counted with the backend's
