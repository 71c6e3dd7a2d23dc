"""Pictures for the notebooks: block tables and the physical KV pool, drawn with matplotlib.

    draw_kv(manager, seqs, ax, title)   one picture: each sequence's block table (top) with an
                                        arrow from every logical block to its physical block
                                        in the pool (bottom)
    snapshot(manager, seqs)             a frozen copy of that state, to draw later
    before_after(before, after)         two snapshots side by side

How a block-table entry is drawn: "→P" names its physical block, "KV c/16" the slots whose
K and V are written (computed tokens); the bar under it is solid for those and hatched for
tokens of the sequence that fall in the block but are not computed yet (the rest of a
chunked prompt). The label on the left reads "computed/total tok".

How a pool block is drawn:
    coloured          held by one sequence (the colour of its block table)
    hatched, "rc=N"   shared: N block tables hold it (fork or prefix-cache hit)
    grey, "cached"    free (ref count 0) but still in the prefix cache: a later hit revives it
    white             free

Only public state is read: `manager.get_block_ids`, `manager.allocator.ref_count`,
`manager.prefix_cache.is_cached`. Nothing here is part of refserve: it is notebook furniture.
"""

from __future__ import annotations

import copy

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

COLORS = plt.get_cmap("tab10").colors


def holders(manager, seqs) -> dict[int, list[int]]:
    """physical block id -> indices (into seqs) of the sequences whose table holds it."""
    held: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        if manager.has_sequence(seq.seq_id):
            for block_id in manager.get_block_ids(seq.seq_id):
                held.setdefault(block_id, []).append(i)
    return held


def draw_kv(manager, seqs, ax=None, title: str = "", per_row: int = 16):
    """Draw the block tables of `seqs` and the physical pool of `manager` on `ax`."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4))
    bs = manager.block_size
    held = holders(manager, seqs)
    rows = -(-manager.num_blocks // per_row)
    live = [s for s in seqs if manager.has_sequence(s.seq_id)]
    top = rows + 1.2 + len(live)  # pool rows, a gap, one row per block table

    # The pool, block 0 at the top left.
    pool_xy = {}
    for b in range(manager.num_blocks):
        x, y = b % per_row, rows - 1 - b // per_row
        pool_xy[b] = (x + 0.5, y + 0.95)
        who = held.get(b, [])
        rc = manager.allocator.ref_count(b)
        if who:
            face, hatch = COLORS[who[0] % len(COLORS)], ("//" if rc > 1 else None)
        elif manager.prefix_cache.is_cached(b):
            face, hatch = "0.85", None
        else:
            face, hatch = "white", None
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=face, hatch=hatch,
                               edgecolor="black", alpha=0.85 if who else 1.0))
        label = f"{b}"
        if rc > 1:
            label += f"\nrc={rc}"
        elif not who and manager.prefix_cache.is_cached(b):
            label += "\ncached"
        ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=7,
                bbox={"facecolor": "white", "alpha": 0.7, "pad": 0.5, "edgecolor": "none"})
    ax.text(-0.2, rows / 2, "physical\npool", ha="right", va="center", fontsize=8)

    # One block table per live sequence, logical block 0 on the left.
    for r, seq in enumerate(live):
        i = seqs.index(seq)
        y = top - 1 - r
        table = manager.get_block_ids(seq.seq_id)
        color = COLORS[i % len(COLORS)]
        # Computed (KV written) vs total tokens: a chunked prefill holds tokens whose KV is
        # not written yet, and the picture must not show them as if it were.
        ax.text(-0.2, y + 0.5, f"seq {seq.seq_id}\n{seq.num_computed_tokens}/{seq.num_tokens} "
                "tok\ncomputed", ha="right", va="center", fontsize=7, color=color)
        for logical, block_id in enumerate(table):
            start = logical * bs
            done = min(bs, max(0, seq.num_computed_tokens - start))
            fill = min(bs, max(0, seq.num_tokens - start))
            ax.add_patch(Rectangle((logical + 0.05, y + 0.05), 0.9, 0.9, facecolor=color,
                                   alpha=0.2, edgecolor="black"))
            # The bar: solid for slots whose KV is written, hatched for tokens of the
            # sequence that fall in this block but are not computed yet.
            ax.add_patch(Rectangle((logical + 0.05, y + 0.05), 0.9 * done / bs, 0.25,
                                   facecolor=color, edgecolor="none"))
            if fill > done:
                ax.add_patch(Rectangle((logical + 0.05 + 0.9 * done / bs, y + 0.05),
                                       0.9 * (fill - done) / bs, 0.25, facecolor="none",
                                       edgecolor=color, hatch="////", linewidth=0.5))
            ax.text(logical + 0.5, y + 0.62, f"→{block_id}\nKV {done}/{bs}", ha="center",
                    va="center", fontsize=6.5)
            px, py = pool_xy[block_id]
            ax.add_patch(FancyArrowPatch((logical + 0.5, y + 0.05), (px, py),
                                         arrowstyle="->", color=COLORS[i % len(COLORS)],
                                         alpha=0.35, mutation_scale=8))
    width = max(min(per_row, manager.num_blocks),
                max((len(manager.get_block_ids(s.seq_id)) for s in live), default=0))
    ax.set_xlim(-2.2, width + 0.2)
    ax.set_ylim(-0.2, top + 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    legend = "; bars: KV written (solid), not computed yet (hatched)" if live else ""
    ax.set_title(f"{title}\n{manager.num_held_blocks} held, {manager.num_evictable_blocks} "
                 f"evictable (cached), {manager.num_free_blocks} free{legend}", fontsize=8)
    return ax


def snapshot(manager, seqs) -> tuple:
    """A deep copy of (manager, seqs): the state now, to draw after it has changed."""
    return copy.deepcopy((manager, list(seqs)))


def before_after(before: tuple, after: tuple, titles=("before", "after"), figsize=(13, 4)):
    """Two snapshots side by side (each a (manager, seqs) pair, e.g. from `snapshot`)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=figsize)
    draw_kv(*before, ax=left, title=titles[0])
    draw_kv(*after, ax=right, title=titles[1])
    fig.tight_layout()
    return fig
