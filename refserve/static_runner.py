"""The model runner of static batching: it also computes the step's padding rows.

A static batch keeps a finished member in its seat until the whole batch ends
(scheduler/static.py). That seat still costs a row of every forward: the member's last cached
token is recomputed at its own position, over its own context, and the result is thrown away.
Its K/V are written nowhere (slot -1): the block holding that position may be shared through
the prefix cache, and a recomputed K/V need not equal the stored one bit for bit.

So the padding is real work, priced exactly as a decode row, and the continuous engine's
runner (model_runner.py) never reads about it.
"""

from __future__ import annotations

from refserve.model_runner import ModelInputs, ModelRunner, attention_metadata


class StaticBatchRunner(ModelRunner):
    """A ModelRunner whose `prepare` adds `out.padding` as decode rows that write nothing."""

    def prepare(self, out, rows=None) -> ModelInputs:
        """The continuous runner's `prepare` of `out.scheduled + out.padding` (or of `rows`,
        as given), the padding rows' slots set to -1."""
        if rows is not None or not out.padding:
            return super().prepare(out, rows)
        inputs = super().prepare(out, out.scheduled + out.padding)
        # Flat row f is row_order[f] of the list above: the padding rows are its tail.
        first_padding = len(out.scheduled)
        for flat, i in enumerate(inputs.row_order.tolist()):
            if i >= first_padding:
                inputs.slot_mapping[inputs.query_start_loc[flat]] = -1
        inputs.attn = attention_metadata(inputs.slot_mapping, inputs.query_start_loc,
                                         inputs.context_lens, inputs.block_tables,
                                         self.backend.to_device)
        return inputs
