"""tx.training.data: rows of a JSON-lines file with an HF split slice, and the seeded per-epoch order both
trainers draw their batches from (checked against numpy's permutation directly)."""

import json

import numpy as np
import pytest

from tx.training.data import batch_indices, load_rows, split_slice


def test_load_rows_applies_the_split_slice(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(10)) + "\n")
    assert [r["i"] for r in load_rows(str(path))] == list(range(10))
    assert [r["i"] for r in load_rows(str(path), "train[2:5]")] == [2, 3, 4]
    assert [r["i"] for r in load_rows(str(path), "validation[80%:]")] == [8, 9]  # a local file has one split
    assert split_slice("train[:100]") == ("train", "[:100]")
    with pytest.raises(ValueError, match="is not a split name"):
        split_slice("train[a:b]")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        load_rows(str(tmp_path / "empty.jsonl"))


def test_batch_indices_are_a_seeded_permutation_per_epoch():
    rows, size, per_epoch = 10, 3, 3  # floor: the last row of each epoch's order is left out (RL)
    for epoch in range(2):
        order = np.random.default_rng([7, epoch]).permutation(rows)
        for within in range(per_epoch):
            got = batch_indices(7, epoch * per_epoch + within, rows, size, per_epoch)
            np.testing.assert_array_equal(got, order[within * size:(within + 1) * size])
    epoch0 = np.concatenate([batch_indices(7, s, rows, size, 4) for s in range(4)])  # ceil (SFT): a short last batch
    assert sorted(epoch0.tolist()) == list(range(rows)) and len(batch_indices(7, 3, rows, size, 4)) == 1
    assert not np.array_equal(batch_indices(7, 0, rows, size, 4), batch_indices(7, 4, rows, size, 4))  # new epoch
    np.testing.assert_array_equal(batch_indices(7, 5, rows, size, 4), batch_indices(7, 5, rows, size, 4))
