"""BlockTable: the append rule and slot arithmetic."""

import pytest

from refserve.kv_cache import BlockTable
from refserve.kv_cache.block_table import blocks_for_tokens, slot_mapping


def test_1000_tokens_at_block_size_16():
    assert blocks_for_tokens(1000, 16) == 63, "62 full blocks and one holding 8 of 16"
    assert BlockTable(16).num_new_blocks(1000) == 63, "an empty table needs all 63"


def test_append_rule_16th_token_no_new_block_17th_takes_one():
    table = BlockTable(16, [5])  # one block, holding up to 16 tokens
    assert table.num_new_blocks(15) == 0, "15 tokens fit the one block held"
    assert table.num_new_blocks(16) == 0, "the 16th token fills the block exactly: no new block"
    assert table.num_new_blocks(17) == 1, "the 17th token needs exactly one more block"
    assert table.num_new_blocks(32) == 1, "32 tokens: 2 blocks, 1 held"
    assert table.num_new_blocks(33) == 2, "33 tokens: 3 blocks, 1 held"
    assert BlockTable(16).num_new_blocks(1) == 1, "an empty table: 1 token needs 1 block"
    assert BlockTable(16).num_new_blocks(0) == 0, "an empty table: 0 tokens need none"


def test_append_rule_never_negative_when_the_table_holds_spare_blocks():
    """A table may hold more blocks than a shorter count needs (asked before a chunk, or
    after rejected drafts): it needs no new block, never a negative number of them."""
    table = BlockTable(4, [1, 2, 3])
    for n in (5, 0, 12):
        assert table.num_new_blocks(n) == 0, f"{n} tokens fit the 3 blocks of 4 held"
    assert table.num_new_blocks(13) == 1, "13 tokens: 4 blocks, 3 held"


def test_slot_formula():
    ids = [7, 2, 9]
    for position in range(12):
        expected = ids[position // 4] * 4 + position % 4
        assert slot_mapping(ids, position, 4) == expected, \
            f"slot of position {position} in table {ids}: table[p // 4] * 4 + p % 4"
    assert slot_mapping(ids, range(3, 9), 4).tolist() == [31, 8, 9, 10, 11, 36], \
        "slots of positions 3..8, as an array"
    assert slot_mapping(ids, [], 4).tolist() == [], "no positions, no slots"


def test_a_position_without_a_block_has_no_slot():
    with pytest.raises(IndexError):
        slot_mapping([7], 4, 4)
    with pytest.raises(IndexError):
        slot_mapping([7], range(2, 5), 4)


def test_replace_truncate_and_copy():
    table = BlockTable(4, [7, 2, 9])
    assert table.replace(1, 11) == 2
    assert table.block_ids == [7, 11, 9]
    copy = table.copy()
    copy.append(3)
    assert len(table) == 3, "the original keeps its 3 blocks"
    assert len(copy) == 4, "the copy has its own appended block"
    assert copy.truncate(1) == [11, 9, 3], "truncate(1) returns the blocks it drops"
    assert copy.block_ids == [7], "truncate(1) keeps one block"
    assert table.block_ids == [7, 11, 9]
    ids = table.block_ids
    ids.append(5)                       # a copy: the table is unchanged
    assert len(table) == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "16"])
def test_bad_block_size(bad):
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(bad)
    with pytest.raises(ValueError, match="block_size"):
        blocks_for_tokens(3, bad)


def test_kv_cache_demo_prints_what_warmup_quotes(capsys):
    """WARMUP quotes `python -m refserve.kv_cache.demo <part>`: here the slot arithmetic of
    table [7, 2, 9] (the block table alone; the manager's part, which forks and copies on
    write, is tests/test_prefix_cache.py's)."""
    from pathlib import Path

    from refserve.kv_cache import demo

    warmup = (Path(__file__).parents[1] / "WARMUP.md").read_text()
    for part in demo.PARTS:
        assert f"python -m refserve.kv_cache.demo {part}" in warmup or part == "prefix_cache", \
            f"WARMUP does not show the demo's part {part}"
    assert demo.main(["block_table"]) == 0
    text = capsys.readouterr().out
    assert "position 4: logical block 1, slot 8" in text, text
    assert demo.main(["nope"]) == 2
    assert "unknown part(s) ['nope']" in capsys.readouterr().err
