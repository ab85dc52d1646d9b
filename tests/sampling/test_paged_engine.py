"""The paged sampling engine against transformers `generate` and the tests' oracle (tests/sampling/oracle.py:
the model's plain forward over the whole sequence at every step) on the same weights: greedy tokens, seeded
samples, log-probs, stops, top-k log-probs; prompt sharing (one prefill per request), continuous batching
through a small pool and few slots, bounded programs."""

import logging
import re

import jax
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import tx
from tests.helpers import aligned_zeros, make_batch
from tests.sampling import oracle
from tests.sampling.test_sample import PROMPTS, SP, sample_batch
from tx import types
from tx.models.adapters import get_adapter_weights, set_adapter_weights

BASE = dict(max_lora_adapters=3, max_lora_rank=4, max_seq_len=96, max_num_samples=8)
PAGED = dict(kv_page_size=4, kv_block=8, prefill_chunk=8, prefill_rows=2,
             decode_steps_per_call=4, max_num_seqs=8)


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    """(adapter "a"'s random weights, the paged backend on the dense tiny model whose adapter "a" holds them);
    the oracle samples the backend's own model."""
    paged = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED))
    paged.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    slot = paged.models["a"].adapter_index
    rng = np.random.default_rng(0)
    weights = {name: (a, rng.standard_normal(b.shape).astype(np.float32) * 0.3)
               for name, (a, b) in get_adapter_weights(paged.model, slot, 4).items()}
    set_adapter_weights(paged.model, slot, weights, alpha=8, rank=4)
    return weights, paged


def requests_mixed():
    greedy = [SP(max_tokens=m, temperature=0.0, stop=[]) for m in (10, 6, 12, 3)]
    out = [(f"g{m}{i}", m, [(p, g)], False, 0) for m in ("", "a") for i, (p, g) in enumerate(zip(PROMPTS, greedy))]
    out.append(("s", "a", [(PROMPTS[2], SP(max_tokens=9, temperature=1.0, seed=5, stop=[]))] * 5, False, 0))
    out.append(("k", "", [(PROMPTS[0], SP(max_tokens=7, temperature=0.8, top_k=20, top_p=0.9, seed=1))] * 2, False, 0))
    return out


def test_paged_equals_oracle_and_transformers(tiny_dirs, engines):
    _, paged = engines
    requests = requests_mixed()
    want, got = oracle.sample(paged, sample_batch(requests)), paged.sample(sample_batch(requests))
    for request_id, *_ in requests:
        a, b = want[request_id].sequences, got[request_id].sequences
        assert [s.tokens for s in a] == [s.tokens for s in b], request_id
        assert [s.stop_reason for s in a] == [s.stop_reason for s in b], request_id
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)
    for i, prompt in enumerate(PROMPTS):  # the base rows, independently of the oracle
        n = len(got[f"g{i}"].sequences[0].tokens)
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert got[f"g{i}"].sequences[0].tokens == ids
    assert len({tuple(s.tokens) for s in got["s"].sequences}) == 5  # seed + i per sample
    # one prefill of the whole prompt per request (the 5 samples of "s" and 2 of "k" share their prompt's), and
    # requests repeating an earlier prompt with the same weights read its full pages from the prefix cache
    stats = paged.sampler.paged.stats
    per_request = sum(len(p) for p in PROMPTS) * 2 + len(PROMPTS[2]) + len(PROMPTS[0])
    assert stats["prefill_tokens"] + stats["prefill_tokens_cached"] == per_request
    assert stats["prefill_tokens_cached"] >= 8  # "s" repeats "ga2"'s 8-token prefix: 2 full pages
    # (the base rows "g2" and "k" repeat prompts too, but shared weights never reuse another request's pages)


def test_a_prompts_last_token_goes_through_the_model_once(tiny_dirs, engines):
    """The prefill writes the whole prompt and keeps its last token's final hidden state, from which each row
    chooses its first token: a call whose rows all start there runs no layers in its first step, so a request
    of `max_tokens` n on an idle engine costs n - 1 decode forward steps, however many samples it has. Its
    tokens are transformers' greedy ones (base weights) and the oracle's (adapter "a", seeded samples)."""
    _, paged = engines
    stats = paged.sampler.paged.stats
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["dense"], dtype=torch.float32)
    prompt = [9, 8, 7, 6, 5, 4, 3]
    for n in (1, 6):
        before = stats["decode_forwards"]
        got = paged.sample(sample_batch([("g", "", [(prompt, SP(max_tokens=n, temperature=0.0, stop=[]))] * 3,
                                          False, 0)]))
        assert stats["decode_forwards"] - before == n - 1
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert [s.tokens for s in got["g"].sequences] == [ids] * 3
    seeded = sample_batch([("s", "a", [(prompt, SP(max_tokens=5, temperature=1.0, seed=3, stop=[]))] * 3, False, 0)])
    before = stats["decode_forwards"]
    got = paged.sample(seeded)
    assert stats["decode_forwards"] - before == 4
    for x, y in zip(got["s"].sequences, oracle.sample(paged, seeded)["s"].sequences):
        assert x.tokens == y.tokens
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)


def test_small_pool_and_few_slots_wait_and_give_the_same_tokens(tiny_dirs, engines):
    """A pool of the minimum size and 2 slots: rows wait for pages and slots, join as others leave, and
    sample what they sample with room to spare; stops, stop strings and top-k sample log-probs included."""
    _, ample = engines
    tight = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **(PAGED | dict(max_num_seqs=2,
                                                                                          kv_cache_pages=51))))
    tight.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    slot = ample.models["a"].adapter_index
    set_adapter_weights(tight.model, slot, get_adapter_weights(ample.model, slot, 4), alpha=8, rank=4)
    requests = requests_mixed() + [
        ("stop", "a", [(PROMPTS[1], SP(max_tokens=40, temperature=1.0, seed=3, stop=[17, 99]))] * 3, False, 0),
        ("long", "", [(list(range(3, 80)), SP(max_tokens=16, temperature=0.0, stop=[]))], False, 0)]
    batch = sample_batch(requests)
    batch.all_sampling_params = list(batch.all_sampling_params)
    want, got = ample.sample(batch), tight.sample(batch)
    for request_id, *_ in requests:
        assert [s.tokens for s in want[request_id].sequences] == [s.tokens for s in got[request_id].sequences]
    assert tight.sampler.paged.stats["peak_pages"] <= 50


def test_the_kv_pools_pages_are_resident_only_where_rows_wrote(tiny_dirs, engines, caplog, monkeypatch):
    """On CPU the engine hands its zero-filled KV pools' pages back to the system as it makes them (a pool is
    sized for every slot at full length): a pool of 20,000 pages that served the mixed requests holds a few
    percent of its bytes resident, and samples the oracle's tokens, even where numpy's zeros come 64-byte
    aligned (a pool wrapped from them could not be donated: the first call would copy it whole). After an
    optim_step the pages cached with the old weights are reused first: the same requests again (no cache hits
    now) write no new pages."""
    from tests.helpers import resident_bytes

    _, ample = engines
    big = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **(PAGED | dict(kv_cache_pages=20_000))))
    big.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    slot = ample.models["a"].adapter_index
    set_adapter_weights(big.model, slot, get_adapter_weights(ample.model, slot, 4), alpha=8, rank=4)
    batch = sample_batch(requests_mixed())

    def sample_and_check() -> int:
        want, got = oracle.sample(big, batch), big.sample(batch)
        for request_id in want:
            assert [s.tokens for s in want[request_id].sequences] == [s.tokens for s in got[request_id].sequences]
        return sum(resident_bytes(pool) for pool in pools())

    def pools() -> list:
        return [pool for stack in big.sampler.paged.device.pools for pool in stack]

    with caplog.at_level(logging.INFO, logger="tx.sampling.paged_calls"), monkeypatch.context() as patch:
        patch.setattr(np, "zeros", aligned_zeros)
        resident = sample_and_check()
    made = sum(pool.nbytes for pool in pools())
    assert made == 2 * 20_000 * 2 * 4 * 2 * 16 * 4  # K and V: pages x 2 layers x 4 positions x 2 kv heads x 16
    assert 0 < resident < made / 50
    assert "paged KV pools: 20000 pages" in caplog.text and "resident only once written" in caplog.text
    cached = big.sampler.paged.kv.pool.stats.hit_pages
    prompt = PROMPTS[0]
    big.forward_backward(make_batch([("r", "a", [{"input_ids": prompt, "targets": prompt[1:] + [1],
                                                  "weights": [1.0] * len(prompt)}], "cross_entropy", None)]))
    big.optim_step("a", types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-2)))
    assert big.metrics.sampling["pages_uncached"] > 0
    assert sample_and_check() <= resident
    # the second round's rows hit only pages the round itself wrote ("s" shares "ga2"'s prefix), as the first's did
    assert big.sampler.paged.kv.pool.stats.hit_pages == 2 * cached


def test_bucketed_block_counts_give_the_same_tokens_in_few_programs(tiny_dirs, engines, monkeypatch):
    """`paged_kv_blocks="bucketed"` (GPUs' default): the host picks each call's attention block count, a power
    of two; the same requests sample the same tokens and log-probs as the device-found count (the extra blocks
    are masked no-ops), each program's count covers its rows, and the programs grow by the buckets only."""
    _, dynamic = engines
    assert dynamic.sampler.paged.device.kv_blocks(40) is None  # "auto" on CPU: the device finds the count
    import tx.kernels.paged_attention as kernels

    traced = []  # the block count each traced attention call of the engine's programs got

    def recording(*args, **kw):  # (q, k_pool, v_pool, layer, table, q_pos, scale, kv_block, kv_blocks)
        traced.append(args[8] if len(args) > 8 else kw.get("kv_blocks"))
        return blocked(*args, **kw)

    blocked = kernels.blocked_paged_attention
    monkeypatch.setattr(kernels, "blocked_paged_attention", recording)
    config = tx.JaxBackendConfig(**BASE, **PAGED, paged_kv_blocks="bucketed")
    bucketed = tx.JaxBackend(tiny_dirs["dense"], config)
    bucketed.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    slot = dynamic.models["a"].adapter_index
    set_adapter_weights(bucketed.model, slot, get_adapter_weights(dynamic.model, slot, 4), alpha=8, rank=4)
    requests = requests_mixed() + [
        ("long", "", [(list(range(3, 80)), SP(max_tokens=14, temperature=0.0, stop=[]))], False, 0)]
    want, got = dynamic.sample(sample_batch(requests)), bucketed.sample(sample_batch(requests))
    for request_id, *_ in requests:
        assert [s.tokens for s in want[request_id].sequences] == [s.tokens for s in got[request_id].sequences]
        for x, y in zip(want[request_id].sequences, got[request_id].sequences):
            # the same arithmetic, fused by XLA into another program: a few ulp at most
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-6, atol=1e-6)
    keys = [k for k in bucketed.runtime.keys() if k[0] == "sample_decode"]
    blocks = {k[-1] for k in keys}
    # tables of 25 pages of 4 tokens span 13 blocks of 8; the long row (77 + 14 tokens) needs 12: all 13 run
    assert blocks <= {1, 2, 4, 8, 13} and 13 in blocks, keys
    # wired down to the kernel: the decode programs' attention ran each program's count; prefill's found its own
    assert set(traced) == blocks | {None}, (set(traced), blocks)
    device = bucketed.sampler.paged.device
    assert [device.kv_blocks(p) for p in (0, 7, 8, 23, 24, 64, 95)] == [1, 1, 2, 4, 4, 13, 13]
    with pytest.raises(ValueError, match="paged_kv_blocks='bucketed' applies to paged_attention_impl='blocked'"):
        tx.JaxBackendConfig(**BASE, **PAGED, paged_kv_blocks="bucketed", paged_attention_impl="reference")


def test_unrolled_and_scanned_layers_sample_the_same(tiny_dirs, engines, caplog):
    """`paged_decode_layers`: "unrolled" (auto on one CPU or NVIDIA GPU device where the layer weights fit a quarter of
    its memory) runs the layers one by one on per-layer copies of their weights, made once and kept
    (tx/sampling/layer_copies.py); "scan" slices them inside the step loop. Both sample the same tokens;
    only the unrolled engine holds copies."""
    from tx.sampling.call_shapes import decode_layers_unrolled

    _, auto = engines
    assert auto.sampler.paged.device.unrolled
    caplog.set_level(logging.INFO, logger="tx.sampling.paged_calls")
    scan = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED, paged_decode_layers="scan"))
    scan.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    slot = auto.models["a"].adapter_index
    set_adapter_weights(scan.model, slot, get_adapter_weights(auto.model, slot, 4), alpha=8, rank=4)
    requests = requests_mixed()
    got = scan.sample(sample_batch(requests))
    assert scan.sampler.paged.device.layer_copies is None and not scan.sampler.paged.device.unrolled
    unrolled = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED, paged_decode_layers="unrolled"))
    unrolled.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    set_adapter_weights(unrolled.model, slot, get_adapter_weights(auto.model, slot, 4), alpha=8, rank=4)
    want = unrolled.sample(sample_batch(requests))
    assert unrolled.sampler.paged.device.layer_copies.copied > 0
    said = [r.getMessage() for r in caplog.records if r.name == "tx.sampling.paged_calls"]
    assert any("layer scan over the stacks (paged_decode_layers='scan', cpu x1" in m for m in said), said
    assert any("layers unrolled on per-layer weight copies (paged_decode_layers='unrolled'" in m for m in said), said
    for request_id, *_ in requests:
        assert [s.tokens for s in want[request_id].sequences] == [s.tokens for s in got[request_id].sequences]
        for x, y in zip(want[request_id].sequences, got[request_id].sequences):
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-5, atol=1e-5)
    gib = 2**30
    assert decode_layers_unrolled("auto", "cpu", 1, gib, 4 * gib)
    assert not decode_layers_unrolled("auto", "cpu", 1, gib + 1, 4 * gib)
    assert not decode_layers_unrolled("auto", "cpu", 8, 1, 4 * gib)  # a mesh: the scan gathers per layer
    assert decode_layers_unrolled("auto", "cuda", 1, gib, 4 * gib)  # measured on an H100: 1.3-1.7x
    assert not decode_layers_unrolled("auto", "cuda", 1, gib + 1, 4 * gib)
    assert not any(decode_layers_unrolled("auto", p, 1, 1, 4 * gib) for p in ("tpu", "rocm"))
    assert decode_layers_unrolled("unrolled", "cuda", 8, 8 * gib, gib)
    assert not decode_layers_unrolled("scan", "cpu", 1, 1, gib)


def test_kv_block_default_is_32_tokens_on_cpu_64_elsewhere(tiny_dirs, engines, caplog):
    """`kv_block=None` (the default): 32-token attention blocks on CPU, 64 elsewhere, in whole pages, and prefill
    blocks of at least 128 on CPU with 'blocked' attention; the engine runs and logs what it resolved, and samples
    the tokens the 8-token blocks sample."""
    from tx.sampling.call_shapes import kv_block_for, prefill_kv_block

    assert [kv_block_for(None, page, "cpu") for page in (4, 16, 12, 64)] == [32, 32, 36, 64]
    assert kv_block_for(None, 16, "cuda") == kv_block_for(None, 16, "tpu") == 64
    assert kv_block_for(8, 4, "cpu") == 8  # a set value is used as it is
    assert [prefill_kv_block(32, page, "cpu", "blocked") for page in (4, 16, 12)] == [128, 128, 132]
    assert prefill_kv_block(256, 16, "cpu", "blocked") == 256  # never smaller than decode's
    assert prefill_kv_block(64, 16, "cuda", "blocked") == 64  # decode's elsewhere
    assert prefill_kv_block(32, 16, "cpu", "pallas") == 32  # and with the Pallas kernel
    _, eight = engines
    caplog.set_level(logging.INFO, logger="tx.sampling.paged_calls")
    fields = {k: v for k, v in PAGED.items() if k != "kv_block"}
    auto = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **fields))
    auto.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    slot = eight.models["a"].adapter_index
    set_adapter_weights(auto.model, slot, get_adapter_weights(eight.model, slot, 4), alpha=8, rank=4)
    requests = requests_mixed()
    want, got = eight.sample(sample_batch(requests)), auto.sample(sample_batch(requests))
    assert auto.sampler.paged.device.kv_block == 32
    assert auto.sampler.paged.device.prefill_block == 128
    said = [r.getMessage() for r in caplog.records if r.name == "tx.sampling.paged_calls"]
    assert any("attention blocks of 32 tokens (kv_block=None), 128 in prefill" in m for m in said), said
    for request_id, *_ in requests:
        assert [s.tokens for s in want[request_id].sequences] == [s.tokens for s in got[request_id].sequences]
        for x, y in zip(want[request_id].sequences, got[request_id].sequences):
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-5, atol=1e-5)


def test_unrolled_decode_follows_weight_changes(tiny_dirs, engines):
    """The kept per-layer copies follow the model: after an adapter's weights change (a weight load here; an
    optimizer step replaces them the same way) the unrolled engine samples with the new weights, as the oracle
    (the model's plain forward) does, and only the replaced (LoRA) leaves were copied again, not the base
    weights. (No prefix cache: a direct weight load does not bump the adapter's KV identity as the backend's
    own updates do.)"""
    before, engine = engines
    unrolled = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED, paged_decode_layers="unrolled",
                                                                      prefix_cache=False))
    unrolled.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    slot = engine.models["a"].adapter_index
    copies = unrolled.sampler.paged.device.layer_copies
    greedy = [(f"g{i}", "a", [(p, SP(max_tokens=8, temperature=0.0, stop=[]))], False, 0) for i, p in enumerate(PROMPTS)]
    rng = np.random.default_rng(7)
    other = {name: (rng.standard_normal(a.shape).astype(np.float32) * 0.3,
                    rng.standard_normal(b.shape).astype(np.float32) * 0.3) for name, (a, b) in before.items()}
    tokens = []
    for weights in (before, other):
        set_adapter_weights(unrolled.model, slot, weights, alpha=8, rank=4)
        made = copies.copied
        want, got = oracle.sample(unrolled, sample_batch(greedy)), unrolled.sample(sample_batch(greedy))
        for request_id, *_ in greedy:
            assert got[request_id].sequences[0].tokens == want[request_id].sequences[0].tokens, request_id
        tokens.append([got[r].sequences[0].tokens for r, *_ in greedy])
        leaves = sum(len(jax.tree.leaves(state)) for state in unrolled.model.scanned_states())
        assert 0 < copies.copied - made < leaves or made == 0, (made, copies.copied, leaves)
    assert tokens[0] != tokens[1]  # the new weights change what is sampled: stale copies could not pass


def test_the_head_copy_is_made_at_the_first_decode_of_two_rows(tiny_dirs):
    """On CPU an untied head's `[vocab, d]` copy serves decode programs of 2+ rows only: an engine that has
    decoded one row at a time holds none; the first call of two rows makes it."""
    b = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED, paged_decode_layers="unrolled"))
    b.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    copies = b.sampler.paged.device.layer_copies
    one = [("one", "a", [(PROMPTS[0], SP(max_tokens=6, temperature=0.0, stop=[]))], False, 0)]
    b.sample(sample_batch(one))
    assert copies.copied > 0 and copies.head_bytes == 0
    two = [(f"r{i}", "a", [(p, SP(max_tokens=6, temperature=0.0, stop=[]))], False, 0)
           for i, p in enumerate(PROMPTS[:2])]
    b.sample(sample_batch(two))
    head = b.model.head_kernel()
    assert head is not None and copies.head_bytes == head.nbytes


def layer_barriers(program_text: str) -> int:
    """Optimization barriers over more than two values in a lowered program: the unrolled layers' order (the
    out-in products' barriers hold two, an input and a weight)."""
    return sum(int(n) > 2 for n in re.findall(r"%\w+:(\d+) = stablehlo.optimization_barrier", program_text))


def test_prefill_calls_run_on_the_layer_copies_in_turn(tiny_dirs, engines, monkeypatch):
    """Prefill calls run unrolled on the copies decode keeps (a scan would slice every layer's weights per
    call), each layer's weights behind a barrier with the previous layer's output (no layer starts before
    the one before it has ended, so activations do not pile up across layers). The tokens are those of an
    engine that scans the stacks, and of the model's plain forward (the oracle)."""
    _, engine = engines
    slot = engine.models["a"].adapter_index
    requests = requests_mixed()
    runs = {}
    for layers in ("unrolled", "scan"):
        b = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED, paged_decode_layers=layers))
        b.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
        set_adapter_weights(b.model, slot, get_adapter_weights(engine.model, slot, 4), alpha=8, rank=4)
        device = b.sampler.paged.device
        device.runtime.programs.enabled = True
        gets = []
        if device.layer_copies is not None:
            get = device.layer_copies.get
            monkeypatch.setattr(device.layer_copies, "get",
                                lambda model, head=True, get=get: gets.append(1) or get(model, head))
        out = b.sample(sample_batch(requests))
        barriers = layer_barriers(device.runtime.programs.lowered("sample_prefill").as_text())
        runs[layers] = (out, len(gets), dict(b.metrics.calls), barriers)
    (unrolled, gets, calls, barriers), (scanned, scan_gets, _, scan_barriers) = runs["unrolled"], runs["scan"]
    assert calls["sample_prefill"] > 0
    assert gets == calls["sample_decode"] + calls["sample_prefill"], (gets, calls)
    assert scan_gets == 0
    assert barriers == engine.model.config.num_hidden_layers and scan_barriers == 0, (barriers, scan_barriers)
    want = oracle.sample(engine, sample_batch(requests))
    for request_id, *_ in requests:
        assert [s.tokens for s in unrolled[request_id].sequences] == [s.tokens for s in scanned[request_id].sequences]
        assert [s.tokens for s in unrolled[request_id].sequences] == [s.tokens for s in want[request_id].sequences]
        for x, y in zip(unrolled[request_id].sequences, scanned[request_id].sequences):
            np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=1e-5, atol=1e-5)


def test_a_lone_short_prefill_narrows_its_chunk(tiny_dirs, engines):
    """A one-row prefill call runs on a quarter or half of `prefill_chunk` (8 here) where its tokens fit: a short
    prompt alone, and the rest of a prompt whose first pages the prefix cache holds. Tokens are the oracle's."""
    from tx.sampling.call_shapes import prefill_width

    assert [prefill_width(n, 1, 8) for n in (1, 2, 3, 4, 5, 8)] == [2, 2, 4, 4, 8, 8]
    assert prefill_width(1, 2, 8) == 8 and prefill_width(1, 1, 1) == 1 and prefill_width(1, 1, 2) == 1
    _, engine = engines
    b = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED))
    b.create_model("a", types.LoraConfig(rank=4, alpha=8, seed=0))
    slot = engine.models["a"].adapter_index
    set_adapter_weights(b.model, slot, get_adapter_weights(engine.model, slot, 4), alpha=8, rank=4)
    greedy = SP(max_tokens=5, temperature=0.0, stop=[])
    long = [60 + i for i in range(12)]  # 12 prefilled tokens: 3 pages of 4
    widths = []
    for i, prompt in enumerate([[70, 71], [80, 81, 82, 83], long, long]):
        before = set(b.runtime.keys())
        tokens_before = b.sampler.paged.stats["prefill_tokens"]
        request = [(f"r{i}", "a", [(prompt, greedy)], False, 0)]
        got, want = b.sample(sample_batch(request)), oracle.sample(engine, sample_batch(request))
        assert got[f"r{i}"].sequences[0].tokens == want[f"r{i}"].sequences[0].tokens, i
        widths += [k[2] for k in set(b.runtime.keys()) - before if k[0] == "sample_prefill"]
        written = b.sampler.paged.stats["prefill_tokens"] - tokens_before
    # new programs in order: 2 and 4 tokens on a quarter and a half chunk, 12 on two rows of a full chunk; the
    # repeat finds 2 pages cached (not the last token's: its hidden state gives the first token) and writes the 4
    # tokens after them on the half chunk (no new program)
    assert widths == [2, 4, 8] and written == 4, (widths, written)


def test_topk_sample_logprobs_and_programs_stay_bounded(engines):
    _, paged = engines
    params = SP(max_tokens=6, temperature=1.0, seed=2, stop=[])
    batch = sample_batch([("t", "a", [(PROMPTS[0], params)] * 2, False, 0)])
    batch.request_options = [types.SampleOptions(topk_sample_logprobs=3)]
    want, got = oracle.sample(paged, batch)["t"], paged.sample(batch)["t"]
    for x, y in zip(want.sequences, got.sequences):
        assert [[t for t, _ in row] for row in x.topk_logprobs] == [[t for t, _ in row] for row in y.topk_logprobs]
    before = dict(paged.metrics.compiles)
    for m in (1, 5, 17, 30):  # other lengths, counts and parameters: no new program
        paged.sample(sample_batch([("v", "a", [(PROMPTS[1], SP(max_tokens=m, temperature=0.5, seed=m))] * 3,
                                    False, 0)]))
    grown = {k: v - before.get(k, 0) for k, v in paged.metrics.compiles.items() if v != before.get(k, 0)}
    assert set(grown) <= {"sample_decode"}, grown  # slot buckets only (`call_shapes.slot_count`)


def test_prefix_cache_reuses_prompts_and_conversations_until_weights_change(engines):
    """A repeated prompt reads its full pages from the cache (and samples the same tokens); a resent
    conversation (prompt + completion + a new turn) reuses the pages its first turn wrote; an optim_step
    of the adapter makes its cached pages unusable. Base-model rows (weights every tenant shares) never
    read another request's pages: a hit would tell one tenant what another sent."""
    _, paged = engines
    stats = paged.metrics.sampling  # the engine's counters, as /api/v1/metrics reports them
    prompt = list(range(40, 63))  # 23 tokens: prefix 22 = 5 full pages of 4
    params = SP(max_tokens=9, temperature=1.0, seed=11, stop=[])

    def run(model, tokens):
        before = dict(stats)
        out = paged.sample(sample_batch([("c", model, [(tokens, params)], False, 0)]))["c"]
        cost = {k: stats[k] - before.get(k, 0) for k in ("prefill_tokens", "prefill_tokens_cached")}
        assert out.prompt_cache_hit_tokens == cost["prefill_tokens_cached"]  # reported per response too
        return out.sequences[0], cost

    first, cost = run("a", prompt)
    again, cost_again = run("a", prompt)
    assert again.tokens == first.tokens
    assert cost_again == {"prefill_tokens": cost["prefill_tokens"] - 20, "prefill_tokens_cached": 20}
    turn2 = prompt + first.tokens + [5, 6, 7]
    _, cost2 = run("a", turn2)
    assert cost2["prefill_tokens_cached"] == (len(prompt) + len(first.tokens) - 1) // 4 * 4
    base, _ = run("", prompt)
    paged.forward_backward(make_batch([("r", "a", [{"input_ids": prompt, "targets": prompt[1:] + [1],
                                                    "weights": [1.0] * len(prompt)}], "cross_entropy", None)]))
    paged.optim_step("a", types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-2)))
    _, after_step = run("a", prompt)
    assert after_step["prefill_tokens_cached"] == 0  # the adapter's weights changed
    base_again, base_cost = run("", prompt)
    assert base_cost["prefill_tokens_cached"] == 0 and base_again.tokens == base.tokens


def test_config_and_pool_errors_name_the_field(tiny_dirs):
    # the static engine's settings are refused by name, whatever their value
    gone = "the static sampling engine was removed and the paged engine is the only one"
    for name, value, why in (("sample_engine", "static", gone),
                             ("sample_max_num_sequences", 2, "it sized the calls of the removed static sampling")):
        with pytest.raises(ValueError, match=f"{name}={value!r} is no longer a setting: {why}"):
            tx.JaxBackendConfig(**BASE, **{name: value})
    # the values that asked for what runs now are still accepted (old configs keep working)
    assert tx.JaxBackendConfig(**BASE, sample_engine="paged", sample_max_num_sequences=0) == tx.JaxBackendConfig(**BASE)
    with pytest.raises(ValueError, match="kv_block=10 must be a multiple of kv_page_size=4"):
        tx.JaxBackendConfig(**BASE, **(PAGED | dict(kv_block=10)))
    with pytest.raises(ValueError, match="kv_cache_pages=20 is below 51: the pool must hold one longest prompt"):
        tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **(PAGED | dict(kv_cache_pages=20))))


def test_min_p_and_repetition_penalty_equal_the_oracle(engines):
    """The paged engine's penalty (token sets of prompt + output, updated on device each step) and min-p give
    the oracle's tokens (the penalty's greedy tokens are also checked against transformers:
    tests/sampling/test_sample.py)."""
    _, paged = engines  # base-model rows: an earlier test trains the paged backend's adapter
    requests = [("rp", "", [(PROMPTS[2], SP(max_tokens=20, temperature=0.0, repetition_penalty=1.5, stop=[]))],
                 False, 0),
                ("mp", "", [(PROMPTS[0], SP(max_tokens=12, temperature=1.0, min_p=0.2, seed=7, stop=[]))] * 3, False, 0),
                ("both", "", [(PROMPTS[1], SP(max_tokens=15, temperature=0.9, min_p=0.05, repetition_penalty=0.8,
                                               seed=2, stop=[]))] * 2, False, 0),
                ("plain", "", [(PROMPTS[3], SP(max_tokens=9, temperature=0.0, stop=[]))], False, 0)]
    want, got = oracle.sample(paged, sample_batch(requests)), paged.sample(sample_batch(requests))
    for request_id, *_ in requests:
        assert [s.tokens for s in want[request_id].sequences] == [s.tokens for s in got[request_id].sequences]
        for x, y in zip(want[request_id].sequences, got[request_id].sequences):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
    plain = paged.sample(sample_batch([("rp", "", [(PROMPTS[2], SP(max_tokens=20, temperature=0.0, stop=[]))],
                                        False, 0)]))["rp"]
    assert plain.sequences[0].tokens != got["rp"].sequences[0].tokens  # the penalty changed the greedy path


def test_the_samples_of_one_prompt_read_its_pages_once_per_segment(tiny_dirs, engines):
    """`paged_shared_prefix` (on by default): 8 seeded samples of one 25-token prompt (page 4, 8-key blocks: 6
    full prompt pages, of which 24 keys are read once per call for all 8 rows, tx/kernels/shared_prefix.py)
    next to a greedy row of another prompt: tokens and log-probs equal the oracle's, which runs each row's
    plain forward, and are the same bits as a backend's with the shared read off."""
    _, paged = engines  # base-model rows: an earlier test trains the paged backend's adapter
    assert paged.config.paged_shared_prefix
    off = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED, paged_shared_prefix=False))
    prompt = (list(PROMPTS[0]) * 8)[:25]
    requests = [("g", "", [(prompt, SP(max_tokens=12, temperature=1.0, seed=9, stop=[]))] * 8, False, 0),
                ("o", "", [(PROMPTS[1][::-1], SP(max_tokens=7, temperature=0.0, stop=[]))], False, 0)]
    before = paged.metrics.sampling["shared_prefix_rows"]  # new prompts: neither backend has their pages cached
    want, got = oracle.sample(paged, sample_batch(requests)), paged.sample(sample_batch(requests))
    plain = off.sample(sample_batch(requests))
    assert off.metrics.sampling["shared_prefix_rows"] == 0
    for request_id in ("g", "o"):
        a, b, c = want[request_id].sequences, got[request_id].sequences, plain[request_id].sequences
        assert [s.tokens for s in a] == [s.tokens for s in b] == [s.tokens for s in c], request_id
        for x, y, z in zip(a, b, c):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
            assert y.logprobs == z.logprobs  # the same bits with the shared read off
    assert len({tuple(s.tokens) for s in got["g"].sequences}) == 8
    assert paged.metrics.sampling["shared_prefix_rows"] - before >= 8  # every call reads them shared


def test_a_large_calls_token_choice_in_groups_of_slots_is_the_same_bits(tiny_dirs, engines, monkeypatch):
    """On CPU a decode call whose `[slots, vocab]` choice arrays exceed `CHOICE_GROUP_ENTRIES` chooses over groups
    of slots in turn (tx/kernels/row_groups.py): every parameter the choice takes (greedy, temperature, top-k /
    top-p, min-p, the repetition penalty, top-k log-probs) gives the bits of the choice made at once (the
    `engines` backend: the tiny model's calls are below the threshold) and the oracle's tokens."""
    from tx.sampling import paged_step

    _, at_once = engines  # base-model rows: an earlier test trains its adapter
    groups = []

    def recorded(fn, args, k):
        groups.append((args[0].shape[0], k))
        return map_row_groups(fn, args, k)

    map_row_groups = paged_step.map_row_groups
    monkeypatch.setattr(paged_step, "map_row_groups", recorded)
    monkeypatch.setattr(paged_step, "CHOICE_GROUP_ENTRIES", {"cpu": 1})  # a group per slot
    grouped = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED))
    requests = [("g", "", [(PROMPTS[0], SP(max_tokens=9, temperature=0.0, stop=[]))], False, 0),
                ("s", "", [(PROMPTS[2], SP(max_tokens=9, temperature=1.0, seed=5, stop=[]))] * 2, False, 0),
                ("k", "", [(PROMPTS[1], SP(max_tokens=7, temperature=0.8, top_k=20, top_p=0.9, seed=1))] * 2, False, 0),
                ("mp", "", [(PROMPTS[3], SP(max_tokens=8, temperature=0.9, min_p=0.05, repetition_penalty=0.8,
                                             seed=2, stop=[]))] * 2, False, 0)]
    batch = sample_batch(requests)
    batch.request_options = [types.SampleOptions(topk_sample_logprobs=3)] * len(requests)
    want, got = at_once.sample(batch), grouped.sample(batch)
    assert groups and all(k == slots for slots, k in groups) and max(groups)[1] > 1, groups  # a group per slot
    oracle_out = oracle.sample(at_once, batch)
    for request_id, *_ in requests:
        for x, y, z in zip(want[request_id].sequences, got[request_id].sequences, oracle_out[request_id].sequences):
            assert x.tokens == y.tokens == z.tokens
            assert x.logprobs == y.logprobs
            assert x.topk_logprobs == y.topk_logprobs and len(y.topk_logprobs) == len(y.tokens)


def test_decode_attention_in_row_groups_samples_the_oracles_tokens(tiny_dirs, engines, monkeypatch):
    """On CPU a decode call of more than `DECODE_ROW_GROUP` slots attends over groups of rows in turn
    (tx/kernels/paged_blocks.py; 2 here, where the tiny model's calls are of 1-16 slots): 8 seeded samples of
    one prompt (their shared pages read per segment) beside greedy rows of other prompts give the oracle's
    tokens and log-probs (1e-4) and the tokens of the `engines` backend, which attends at once."""
    from tx.kernels import paged_attention, paged_blocks

    _, at_once = engines  # base-model rows: an earlier test trains its adapter
    groups = []

    def recorded(rows, platform):
        groups.append(row_groups(rows, platform))
        return groups[-1]

    row_groups = paged_attention.decode_row_groups
    monkeypatch.setattr(paged_attention, "decode_row_groups", recorded)
    monkeypatch.setattr(paged_blocks, "DECODE_ROW_GROUP", 2)
    grouped = tx.JaxBackend(tiny_dirs["dense"], tx.JaxBackendConfig(**BASE, **PAGED))
    prompt = (list(PROMPTS[0]) * 8)[:25]
    requests = [("g", "", [(prompt, SP(max_tokens=12, temperature=1.0, seed=4, stop=[]))] * 8, False, 0),
                ("o", "", [(PROMPTS[1][::-1], SP(max_tokens=7, temperature=0.0, stop=[]))], False, 0),
                ("p", "", [(PROMPTS[3], SP(max_tokens=10, temperature=0.0, stop=[]))], False, 0)]
    batch = sample_batch(requests)
    got, want, plain = grouped.sample(batch), oracle.sample(at_once, batch), at_once.sample(batch)
    assert max(groups) >= 4, groups  # the 8-16 slot calls ran in groups of 2 rows
    assert grouped.metrics.sampling["shared_prefix_rows"] > 0
    for request_id, *_ in requests:
        for x, y, z in zip(want[request_id].sequences, got[request_id].sequences, plain[request_id].sequences):
            assert x.tokens == y.tokens == z.tokens, request_id
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
