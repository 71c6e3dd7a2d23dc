"""BlockTable: the append rule and slot arithmetic."""

import pytest

from refserve.kv_cache import BlockTable
from refserve.kv_cache.block_table import blocks_for_tokens


def test_1000_tokens_at_block_size_16():
    assert blocks_for_tokens(1000, 16) == 63
    assert BlockTable(16).num_new_blocks(1000) == 63
    assert 1000 - 62 * 16 == 8  # the last block holds 8 of 16


def test_append_rule_16th_token_no_new_block_17th_takes_one():
    table = BlockTable(16, [5])  # one block, holding up to 16 tokens
    assert table.num_new_blocks(15) == 0
    assert table.num_new_blocks(16) == 0  # the 16th token fills the block exactly
    assert table.num_new_blocks(17) == 1  # the 17th needs exactly one more
    assert table.num_new_blocks(32) == 1
    assert table.num_new_blocks(33) == 2
    assert BlockTable(16).num_new_blocks(1) == 1
    assert BlockTable(16).num_new_blocks(0) == 0


def test_append_rule_never_negative_when_the_table_holds_spare_blocks():
    """A table may hold more blocks than a shorter count needs (asked before a chunk, or
    after rejected drafts): it needs no new block, never a negative number of them."""
    table = BlockTable(4, [1, 2, 3])
    assert table.num_new_blocks(5) == 0
    assert table.num_new_blocks(0) == 0
    assert table.num_new_blocks(12) == 0
    assert table.num_new_blocks(13) == 1


def test_slot_formula():
    table = BlockTable(4, [7, 2, 9])
    for position in range(12):
        expected = table[position // 4] * 4 + position % 4
        assert table.slot(position) == expected
    assert table.slot(5) == 9
    assert table.slots(3, 9) == [31, 8, 9, 10, 11, 36]
    assert table.slots(4, 4) == []
    assert table.slots(0, 12) == [table.slot(p) for p in range(12)]


def test_slot_out_of_range():
    table = BlockTable(4, [7])
    with pytest.raises(IndexError):
        table.slot(4)
    with pytest.raises(IndexError):
        table.slots(2, 5)
    with pytest.raises(ValueError):
        table.slots(3, 2)


def test_logical_blocks_of_range_and_replace():
    table = BlockTable(4, [7, 2, 9])
    assert list(table.logical_blocks_of_range(3, 5)) == [0, 1]
    assert list(table.logical_blocks_of_range(4, 8)) == [1]
    assert list(table.logical_blocks_of_range(8, 8)) == []
    assert table.replace(1, 11) == 2
    assert table.block_ids == [7, 11, 9]
    copy = table.copy()
    copy.append(3)
    assert len(table) == 3 and len(copy) == 4


def test_bad_block_size():
    with pytest.raises(ValueError):
        BlockTable(0)


def test_kv_cache_demo_prints_what_warmup_quotes(capsys):
    """WARMUP quotes `python -m refserve.kv_cache.demo <part>`: the slot arithmetic of table
    [7, 2, 9], and the one copy-on-write a forked sequence's write into a shared block makes."""
    from pathlib import Path

    from refserve.kv_cache import demo

    warmup = (Path(__file__).parents[1] / "WARMUP.md").read_text()
    for part in demo.PARTS:
        assert f"python -m refserve.kv_cache.demo {part}" in warmup or part == "prefix_cache"
    assert demo.main(["block_table", "kv_cache_manager"]) == 0
    text = capsys.readouterr().out
    assert "position 4: logical block 1, slot 8" in text
    assert "c writes position 10 -> copies [(2, 4)]" in text and "2: [0, 1, 4]" in text
    assert demo.main(["nope"]) == 2
    assert "unknown part(s) ['nope']" in capsys.readouterr().err
