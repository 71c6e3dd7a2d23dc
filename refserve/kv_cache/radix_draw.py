"""Draw a RadixCache with matplotlib (notebook 01 shows the tree this way).

Layout: leaves take consecutive columns left to right (depth-first order), each parent sits
above the middle of its children, and depth goes down. A box shows the node's tokens (or
their text, with `token_text`), its blocks and its lock count; protected nodes (lock_ref > 0)
and evictable ones (lock_ref 0, reclaimable) get different colours.

`tree_layout` is the pure part (positions only) and is what the tests check; matplotlib is
imported only by `draw_radix_tree`, so the core package never needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from refserve.kv_cache.radix_cache import RadixCache, RadixNode

PROTECTED_COLOR = "#f4a582"  # locked: some holder uses these blocks
EVICTABLE_COLOR = "#92c5de"  # unlocked: cached, reclaimable by evict
ROOT_COLOR = "#dddddd"


def tree_layout(cache: RadixCache) -> dict[RadixNode, tuple[float, float]]:
    """(x, y) of every node, the root included: leaves at x = 0, 1, 2, ... in depth-first
    order, a parent at the mean x of its children, y = -depth."""
    positions: dict[RadixNode, tuple[float, float]] = {}
    next_column = [0]

    def place(node: RadixNode, depth: int) -> float:
        # Recursion is fine here: a drawable tree is a few dozen levels deep at most.
        if node.is_leaf:
            x = float(next_column[0])
            next_column[0] += 1
        else:
            xs = [place(child, depth + 1) for child in node.children.values()]
            x = sum(xs) / len(xs)
        positions[node] = (x, -float(depth))
        return x

    place(cache.root, 0)
    return positions


def draw_radix_tree(cache: RadixCache, token_text: Callable[[Sequence[int]], str] | None = None,
                    ax=None, max_chars: int = 24):
    """A matplotlib Figure of the tree. `token_text` turns a node's token ids into a label
    (e.g. a tokenizer's decode); without it the ids are shown. Labels longer than max_chars
    are cut. Draws into `ax` when given, else into a new figure sized to the tree."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    positions = tree_layout(cache)
    width = max(x for x, _ in positions.values()) + 1
    depth = -min(y for _, y in positions.values()) + 1
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(16, 2.4 * width + 1), 1.3 * depth + 1))
    else:
        fig = ax.figure
    for node, (x, y) in positions.items():
        for child in node.children.values():
            cx, cy = positions[child]
            ax.plot([x, cx], [y, cy], color="#777777", linewidth=1, zorder=1)
    for node, (x, y) in positions.items():
        if node is cache.root:
            label, color = "root", ROOT_COLOR
        else:
            text = token_text(list(node.key)) if token_text else " ".join(map(str, node.key))
            text = text if len(text) <= max_chars else text[:max_chars - 1] + "…"
            label = f"{text!r}\nblocks {node.blocks}\nlock {node.lock_ref}"
            color = PROTECTED_COLOR if node.lock_ref > 0 else EVICTABLE_COLOR
        ax.text(x, y, label, ha="center", va="center", fontsize=8, zorder=2,
                bbox={"boxstyle": "round", "facecolor": color, "edgecolor": "#444444"})
    ax.set_xlim(-0.7, width - 0.3)
    ax.set_ylim(-depth + 0.4, 0.6)
    ax.axis("off")
    ax.legend(handles=[Patch(color=PROTECTED_COLOR, label="protected (locked)"),
                       Patch(color=EVICTABLE_COLOR, label="evictable (lock 0)")],
              loc="lower right", fontsize=8, frameon=False)
    ax.set_title(f"radix tree, block_size {cache.block_size}: {cache.num_cached_blocks} "
                 f"blocks cached ({cache.num_evictable_blocks} evictable, "
                 f"{cache.num_protected_blocks} protected)", fontsize=9)
    return fig
