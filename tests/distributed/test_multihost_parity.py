"""Two real processes on 127.0.0.1 (4 CPU devices each, gloo) against one process with 8 devices: the same
results for every backend method with LoRA on Qwen3 dense, for the calls that run the model with LoRA on
DeepSeek-V3 (whose MoE layers carry the expert parallelism: experts over ep, routing and the expert all-reduce
per device), and for full training (dense). Llama 3 is
not run here: what it changes (RoPE scaling, no q/k norms) is per-device arithmetic that the dense run's
collectives and the one-process mesh tests of tests/models/test_llama.py already cover."""

import pytest

from tests.distributed.test_multihost import _close, run_pair, run_single


# tiny checkpoints of tests/conftest.py; DeepSeek-V3 runs the calls that run the model (the driver's model_parity):
# checkpoints, sampler saves and slot reuse move the same adapter arrays whatever the model
@pytest.mark.parametrize("name,scenario", [("dense", "parity"), ("deepseek_v3", "model_parity")])
def test_two_processes_equal_one_process(tiny_dirs, family_dirs, tmp_path, name, scenario):
    """LoRA on a (2, 2, 2) mesh over two processes == one process with 8 devices: forward_backward, optim_step,
    forward, sample, and for the dense model every other backend method (checkpoint save/load, sampler save,
    delete/recreate)."""
    model_dir = {**tiny_dirs, **family_dirs}[name]
    multi, worker_rc, _ = run_pair(scenario, model_dir, tmp_path)
    single = run_single(scenario, model_dir, tmp_path)
    assert {"fb", "optim", "forward", "sample"} <= multi.keys()
    _close(multi, single)
    assert worker_rc == 0  # clean shutdown from process 0


def test_full_training_two_processes_equal_one_process(tiny_dirs, tmp_path):
    """training_mode='full' (fp32) on a (2, 2, 2) mesh over two processes == one process with 8 devices:
    steps, forward, sampling, a checkpoint saved by both hosts and loaded back, a sampler save."""
    multi, worker_rc, _ = run_pair("full_parity", tiny_dirs["dense"], tmp_path)
    single = run_single("full_parity", tiny_dirs["dense"], tmp_path)
    _close(multi, single)
    assert multi["restored"] == multi["forward"] and multi["step2_again"] == multi["step2"]  # exact resume
    assert worker_rc == 0
