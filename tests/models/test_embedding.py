"""The token embedding and the LM head (tx/models/layers/embedding.py) against numpy: untied, tied, the
`[vocab, d]` copy decode reads on CPU, and each row's own adapter's LoRA delta, at one token a row (decode's
one-dot path) and at several (the block-by-block path)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from tx.models.config import LoraSlots
from tx.models.layers.embedding import Embedding, LMHead

D, VOCAB, SLOTS, RANK = 16, 40, 3, 4


def random_head(tied: bool, seed: int = 0) -> tuple[LMHead, dict]:
    rng = np.random.default_rng(seed)
    head = LMHead(D, VOCAB, tied=tied, dtype=np.float32, slots=LoraSlots(max_lora_adapters=SLOTS, max_lora_rank=RANK),
                  rngs=nnx.Rngs(seed))
    ref = {"a": rng.standard_normal((SLOTS, D, RANK)).astype(np.float32) * 0.3,
           "b": rng.standard_normal((SLOTS, RANK, VOCAB)).astype(np.float32) * 0.3,
           "scale": np.array([0.0, 2.0, 0.5], np.float32)}
    head.lora_a[...], head.lora_b[...], head.lora_scale[...] = ref["a"], ref["b"], ref["scale"]
    return head, ref


def numpy_logits(h_btd, w_dv, ref, adapter_b):
    base = np.einsum("btd,dv->btv", h_btd.astype(np.float64), w_dv)
    delta = np.stack([ref["scale"][a] * h_btd[i].astype(np.float64) @ ref["a"][a] @ ref["b"][a]
                      for i, a in enumerate(adapter_b)])
    return base + delta


@pytest.mark.parametrize("rows,tokens", [(2, 1), (5, 3)])
@pytest.mark.parametrize("tied", [False, True])
def test_head_logits_with_each_rows_adapter_equal_numpy(rows, tokens, tied):
    head, ref = random_head(tied)
    rng = np.random.default_rng(1)
    embedding_vd = rng.standard_normal((VOCAB, D)).astype(np.float32)
    h_btd = rng.standard_normal((rows, tokens, D)).astype(np.float32)
    adapter_b = np.arange(rows) % SLOTS
    w_dv = embedding_vd.T if tied else np.asarray(head.kernel[...])
    want = numpy_logits(h_btd, w_dv, ref, adapter_b)
    got = np.asarray(head(h_btd, embedding_vd, adapter_b))
    assert got.dtype == np.float32 and got.shape == (rows, tokens, VOCAB)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(head(h_btd, embedding_vd, None)),
                               np.einsum("btd,dv->btv", h_btd, w_dv), rtol=1e-5, atol=1e-5)  # no adapters
    if not tied:  # decode's `[vocab, d]` copy of the kernel gives the same logits
        copy_vd = np.ascontiguousarray(w_dv.T)
        np.testing.assert_allclose(np.asarray(head(h_btd, embedding_vd, adapter_b, copy_vd)), want, rtol=1e-5,
                                   atol=1e-5)


def test_tied_head_holds_no_kernel_and_embedding_takes_rows():
    assert random_head(tied=True)[0].kernel is None
    emb = Embedding(VOCAB, D, dtype=np.float32, rngs=nnx.Rngs(0))
    ids_bt = np.array([[0, 7, 39], [3, 3, 1]])
    np.testing.assert_array_equal(np.asarray(emb(ids_bt)), np.asarray(emb.embedding[...])[ids_bt])
