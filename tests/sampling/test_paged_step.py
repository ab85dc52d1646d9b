"""`paged_step.ends_with_a_sequence` (the decode loop's stop-string check) against a plain Python reference."""

import numpy as np

from tx.sampling.paged_step import ends_with_a_sequence


def test_ends_with_a_sequence_matches_python():
    """Random windows (some still short: -1 on the left) and random sequence lists (some rows without any),
    drawn from a 5-token alphabet so that matches happen."""
    rng = np.random.default_rng(0)
    s, x, width = 64, 3, 4
    recent = rng.integers(0, 5, (s, width)).astype(np.int32)
    for j in range(0, s, 7):  # a row with fewer tokens so far
        recent[j, : rng.integers(1, width + 1)] = -1
    seqs = np.full((s, x, width), -1, np.int32)
    per_row = []
    for j in range(s):
        row = [rng.integers(0, 5, rng.integers(1, 3)).tolist() for _ in range(rng.integers(0, x + 1))]
        per_row.append(row)
        for i, seq in enumerate(row):
            seqs[j, i, width - len(seq):] = seq
    got = np.asarray(ends_with_a_sequence(recent, seqs))
    tail = [[t for t in recent[j].tolist() if t >= 0] for j in range(s)]
    want = [any(tail[j][-len(seq):] == seq and len(tail[j]) >= len(seq) for seq in per_row[j]) for j in range(s)]
    assert got.tolist() == want
    assert 0 < sum(want) < s
