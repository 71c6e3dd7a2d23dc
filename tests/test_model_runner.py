"""ModelRunner.prepare: the flat batch, by hand (decodes first, PAD_BLOCK padding, logits rows
in scheduler order, draft tokens read from the row's draft_token_ids), and forward's row order."""

from types import SimpleNamespace

import numpy as np
import pytest
from model_utils import prefill_logits, row, run_step, save_numpy_llama

from refserve.backends.attention_metadata import PAD_BLOCK
from refserve.backends.numpy_backend import NumpyBackend
from refserve.model_runner import ModelRunner, build_attention_metadata
from refserve.models.loader import load_model
from refserve.static_runner import StaticBatchRunner


def fake_runner(block_size=4, runner=ModelRunner):
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=2,
                             vocab_size=10)
    return runner(SimpleNamespace(config=config), NumpyBackend(), num_blocks=16,
                  block_size=block_size)


def test_prepare_by_hand():
    chunk = row(list(range(100, 110)), 2, 6, [7, 3], num_logits=0)       # positions 2..7
    decode = row(list(range(200, 206)), 5, 1, [9, 1])                    # position 5
    verify = row([300, 301, 302], 2, 3, [4, 6], num_logits=3,            # 302 + 2 drafts
                 draft_token_ids=[303, 304])
    padding = row([400, 401, 402], 2, 1, [5], num_logits=0)
    # Static batching's runner adds the padding rows (the continuous runner never sees them).
    inputs = fake_runner(runner=StaticBatchRunner).prepare(
        SimpleNamespace(scheduled=[chunk, decode, verify], padding=[padding]))
    # Decodes first (the decode, then the padding row), then chunk and verify, in order.
    assert inputs.row_order.tolist() == [1, 3, 0, 2], "row_order: decodes first"
    # Rows in that order: decode, padding, chunk (positions 2..7), verify (302 + 2 drafts).
    assert inputs.input_ids.tolist() == [205, 402, 102, 103, 104, 105, 106, 107, 302, 303,
                                         304], "input_ids: each row's query tokens"
    assert inputs.positions.tolist() == [5, 2, 2, 3, 4, 5, 6, 7, 2, 3, 4], \
        "positions: each query token's place in its sequence"
    # slot = table[p // 4] * 4 + p % 4; the padding row writes nothing.
    assert inputs.slot_mapping.tolist() == [1 * 4 + 1, -1,
                                            7 * 4 + 2, 7 * 4 + 3, 3 * 4, 3 * 4 + 1, 3 * 4 + 2,
                                            3 * 4 + 3, 4 * 4 + 2, 4 * 4 + 3, 6 * 4], \
        "slot_mapping: slot = table[p // 4] * 4 + p % 4"
    assert inputs.query_start_loc.tolist() == [0, 1, 2, 8, 11], "query_start_loc"
    assert inputs.context_lens.tolist() == [6, 3, 8, 5], \
        "context_lens: the keys each row sees once this step's tokens are written"
    assert inputs.block_tables.tolist() == [[9, 1], [5, PAD_BLOCK], [7, 3], [4, 6]], \
        "block_tables"
    # Logits rows in scheduler order: the decode's token, then the verify's three.
    assert inputs.logits_indices.tolist() == [0, 8, 9, 10], "logits_indices"
    a = inputs.attn
    assert (a.num_seqs, a.num_decodes, a.max_decode_context_len) == (4, 2, 6), \
        "(num_seqs, num_decodes, max_decode_context_len)"
    assert a.query_start_loc_cpu is inputs.query_start_loc
    text = str(inputs)
    assert "num_decodes 2" in text and "slot_mapping" in text and "[9, 1]" in text


class CopyingBackend(NumpyBackend):
    """A backend whose device arrays are copies, as a GPU's are."""

    def to_device(self, array):
        return np.array(array)


def test_static_padding_writes_nothing_on_the_device_too():
    """The padding row's slot -1 must reach the metadata the kernels read, not only the host
    array; and rows given to the static runner are prepared as the continuous runner does."""
    decode = row(list(range(200, 206)), 5, 1, [9, 1])
    padding = row([400, 401, 402], 2, 1, [5], num_logits=0)
    runner = fake_runner(runner=StaticBatchRunner)
    runner.backend = CopyingBackend()
    inputs = runner.prepare(SimpleNamespace(scheduled=[decode], padding=[padding]))
    assert inputs.attn.slot_mapping is not inputs.slot_mapping
    assert inputs.attn.slot_mapping.tolist() == [1 * 4 + 1, -1]
    given = runner.prepare(SimpleNamespace(scheduled=[], padding=[padding]), rows=[decode])
    assert given.slot_mapping.tolist() == [1 * 4 + 1]


def test_a_position_without_a_block_is_refused_not_invented():
    """A draft position with no block would be a scheduler bug: prepare fails loudly, even
    when another row's longer table pads this row's with PAD_BLOCK."""
    other = row(list(range(20)), 19, 1, [1, 2, 3, 4, 5])
    short = row([1, 2, 3, 4], 3, 2, [4], num_logits=2, draft_token_ids=[5])  # 4: no block
    with pytest.raises(IndexError):
        fake_runner().prepare(SimpleNamespace(scheduled=[other, short]))


def test_attention_metadata_checks_the_layout():
    ok = dict(slot_mapping=np.zeros(3), query_start_loc=[0, 1, 3], context_lens=[4, 5],
              block_tables=np.zeros((2, 2)))
    build_attention_metadata(**ok)
    with pytest.raises(ValueError, match="decode rows .* must come first"):
        build_attention_metadata(**{**ok, "query_start_loc": [0, 2, 3]})
    with pytest.raises(ValueError, match="1 <= q_len <= context_len"):
        build_attention_metadata(**{**ok, "context_lens": [4, 1]})
    with pytest.raises(ValueError, match="query_start_loc"):
        build_attention_metadata(**{**ok, "query_start_loc": [0, 1, 2]})


def test_verify_logits_equal_prefill_logits_and_come_back_in_row_order(tmp_path):
    """A verify row's k+1 logits are the logits of those positions (what a prefill of the
    same tokens gives), and a batch [verify, decode] returns them verify-first even though
    the decode runs first inside."""
    model = load_model(save_numpy_llama(tmp_path / "tiny"), NumpyBackend())
    rng = np.random.default_rng(5)
    a, b = rng.integers(3, 97, size=20).tolist(), rng.integers(3, 97, size=9).tolist()
    expect_a, _ = prefill_logits(model, a, block_size=4)
    expect_b, _ = prefill_logits(model, b, block_size=4)
    runner = ModelRunner(model, model.backend, num_blocks=16, block_size=4)
    table_a, table_b = list(range(0, 5)), list(range(5, 8))
    run_step(runner, [row(a, 0, 16, table_a, num_logits=0), row(b, 0, 8, table_b, 0)])
    verify = row(a[:17], 16, 4, table_a, num_logits=4,      # 1 real token + 3 drafts
                 draft_token_ids=a[17:])
    logits = run_step(runner, [verify, row(b, 8, 1, table_b)])
    np.testing.assert_allclose(logits[:4], expect_a[16:20], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[4], expect_b[8], rtol=1e-5, atol=1e-5)
