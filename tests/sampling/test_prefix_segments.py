"""The host's plan of which decode rows read which shared pages (tx/sampling/prefix_segments.py)."""

import numpy as np

from tx.sampling.prefix_segments import SHARED_PREFIX_ROWS, plan_segments, segment_rows


def test_segment_rows_divide_each_devices_slots():
    assert segment_rows(512, 1) == SHARED_PREFIX_ROWS == 4
    assert (segment_rows(8, 1), segment_rows(48, 2), segment_rows(6, 2), segment_rows(2, 1)) == (4, 4, 1, 2)
    assert (segment_rows(8, 1, 16), segment_rows(48, 2, 16), segment_rows(512, 1, 16)) == (8, 8, 16)


def test_groups_become_segments_of_their_common_whole_blocks():
    """Page 4, 8-key blocks, 8 slots (one segment of 8). Rows 0-2 share pages 1-3 (12 keys, position 13 or
    more: one whole block), rows 3-4 pages 5-8 (16 keys: two blocks; at positions 25-26, 4 blocks in all),
    row 5 shares nothing, slot 6 runs no row. One place, two candidate segments: the one that saves more
    keys takes it."""
    tables = [[1, 2, 3, 10], [1, 2, 3, 11], [1, 2, 3, 12], [5, 6, 7, 8, 13, 15, 17], [5, 6, 7, 8, 14, 16, 18],
              [20, 21], None]
    positions = [14, 13, 15, 26, 25, 6, 0]
    plan = plan_segments(tables, positions, 8, 1, 7, 4, 8, most=8)
    assert plan["table_nw"].shape == (1, 7)  # one segment of 8 rows: the largest saving wins the one place
    # rows 0-2: 3 rows x 8 keys = 24; rows 3-4: 2 rows x 16 keys = 32 -> rows 3-4 read their 16 shared keys
    assert plan["len_s"].tolist() == [0, 0, 0, 16, 16, 0, 0, 0]
    assert plan["table_nw"][0].tolist() == [5, 6, 7, 8, 0, 0, 0]
    assert sorted(plan["order_s"].tolist()) == list(range(8))
    np.testing.assert_array_equal(plan["order_s"][plan["place_s"]], np.arange(8))
    assert plan["order_s"][:2].tolist() == [3, 4]  # the segment's rows first, in its places


def test_positions_cap_the_shared_keys_and_single_rows_read_nothing():
    # two rows share 4 pages (16 keys) but one sits at position 9: only the first block (8 keys) is read shared
    plan = plan_segments([[1, 2, 3, 4, 7], [1, 2, 3, 4, 8], [9]], [17, 9, 2], 4, 1, 5, 4, 8)
    assert plan["len_s"].tolist() == [8, 8, 0, 0]
    alone = plan_segments([[1, 2, 3, 4, 7]], [17], 2, 1, 5, 4, 8)
    assert not alone["len_s"].any()


def test_no_segments_where_they_would_lengthen_the_loops():
    """Page 4, 8-key blocks. Two rows share 16 keys (2 blocks) at positions 17-18 (3 blocks each): read shared,
    the loops run 2 + 1 blocks, as many as without. A row that shares nothing at position 30 (4 blocks) would
    make it 2 + 4 against 4: no segment then (cap 0), every row reads its own table."""
    tables = [[1, 2, 3, 4, 7], [1, 2, 3, 4, 8]]
    assert plan_segments(tables, [17, 18], 2, 1, 8, 4, 8)["len_s"].tolist() == [16, 16]
    plan = plan_segments(tables + [[20 + i for i in range(8)]], [17, 18, 30], 4, 1, 8, 4, 8)
    assert not plan["len_s"].any() and plan["order_s"].tolist() == [0, 1, 2, 3]
    # a row that shares nothing but reaches no further than the others' own keys: the segment stays
    plan = plan_segments(tables + [[20, 21]], [17, 18, 6], 4, 1, 8, 4, 8)
    assert plan["len_s"].tolist() == [16, 16, 0, 0]


def test_segments_are_capped_to_the_blocks_that_shorten_the_loops():
    """Two groups at positions 40-46 (6 blocks each): A shares 32 keys (4 blocks), B 16 (2). All read shared:
    4 + (6 - 2) = 8 blocks; capped at 2: 2 + 4 = 6, as many as without (6) and the most keys gathered once."""
    a = [[1 + i for i in range(8)] + [100 + j, 110 + j, 120 + j] for j in range(2)]
    b = [[20 + i for i in range(4)] + [130 + j, 140 + j, 150 + j, 160 + j, 170 + j, 180 + j, 190 + j, 200 + j]
         for j in range(2)]
    plan = plan_segments(a + b, [40, 41, 45, 46], 32, 1, 12, 4, 8, most=16)  # 32 slots: two places of 16 rows
    assert plan["len_s"][:4].tolist() == [16, 16, 16, 16] and not plan["len_s"][4:].any()
    assert sorted(plan["table_nw"][:, :5].tolist()) == [[1, 2, 3, 4, 0], [20, 21, 22, 23, 0]]


def test_large_groups_split_and_devices_plan_their_own_rows():
    """20 rows of one prompt over 2 devices of 16 slots: each device's rows (0-15, 16-19) form their own
    segment, its indices local to the device."""
    tables = [[1, 2, 3, 100 + j] for j in range(20)]
    plan = plan_segments(tables, [15] * 20, 32, 2, 4, 4, 8, most=16)
    assert plan["table_nw"].tolist() == [[1, 2, 0, 0], [1, 2, 0, 0]]
    assert plan["len_s"].tolist() == [8] * 20 + [0] * 12
    assert plan["order_s"][16:20].tolist() == list(range(4))  # device 1's rows 16-19, as local 0-3
    for half in (plan["order_s"][:16], plan["order_s"][16:]):
        assert sorted(half.tolist()) == list(range(16))
    # one device, 40 rows of one prompt, 16-row segments: three of 13, 13, 14 rows
    plan = plan_segments([[1, 2, 3, 200 + j] for j in range(40)], [15] * 40, 64, 1, 4, 4, 8, most=16)
    assert np.count_nonzero(plan["len_s"]) == 40 and plan["table_nw"][:, 0].tolist() == [1, 1, 1, 0]


def test_groups_of_any_size_split_evenly_into_segments_of_up_to_four():
    """The default, 4 rows a segment: a group of 16 takes 4 places, a group of 5 two (3 + 2 rows: no row of
    it alone, reading nothing shared), a group of 2 one; 32 slots have 8 places."""
    sizes, tables, positions = (16, 5, 2), [], []
    for g, size in enumerate(sizes):
        tables += [[10 * g + 1, 10 * g + 2, 500 + len(tables) + j] for j in range(size)]
        positions += [9] * size
    plan = plan_segments(tables, positions, 32, 1, 3, 4, 8)
    assert plan["table_nw"].shape == (8, 3)
    assert plan["len_s"].tolist() == [8] * 23 + [0] * 9
    seg_rows = np.asarray(plan["order_s"]).reshape(8, 4)
    firsts = sorted(int(plan["table_nw"][k, 0]) for k in range(7))
    assert firsts == [1, 1, 1, 1, 11, 11, 21] and not plan["table_nw"][7].any()
    sizes_of_five = sorted(sum(1 for j in seg_rows[k] if 16 <= j < 21) for k in range(8)
                           if plan["table_nw"][k, 0] == 11)
    assert sizes_of_five == [2, 3]
