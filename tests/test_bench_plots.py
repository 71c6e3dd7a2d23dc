"""The bench's charts are readable: the machine banner fits the figure, the memory chart's
n = 1 panel is not squashed under the naive line, and the capacity chart's predicted line is
not hidden under the measured one. Drawn from recorded results (no benchmark is run)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from refserve.bench import capacity, memory  # noqa: E402
from refserve.bench.common import pyplot, save_figure  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "docs" / "bench"
GPU = "NVIDIA H200 (139 GiB, compute capability 9.0, driver 570.124.06, 16 SMs in a MIG slice)"


def recorded(name: str) -> dict:
    return json.loads((BENCH / f"{name}.json").read_text())


def last_figure():
    plt = pyplot()
    fig = plt.figure(plt.get_fignums()[-1])
    return plt, fig


@pytest.mark.parametrize("width", [4.0, 6.0, 11.0])
def test_the_machine_banner_fits_the_figure(tmp_path, width):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(width, 3))
    ax.plot([0, 1], [0, 1])
    result = recorded("capacity")
    result["machine"]["gpu"] = GPU
    save_figure(fig, result, tmp_path / "x.png")
    box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (box, fig.bbox)
    assert GPU.split()[1] in fig._suptitle.get_text()       # wrapped, not cut
    # ... and the banner sits above the axes, not on them.
    assert box.y0 >= ax.get_tightbbox(fig.canvas.get_renderer()).y1 - 1
    plt.close(fig)


def test_memory_chart_gives_n1_a_log_panel_and_a_linear_zoom(tmp_path):
    memory.plot(recorded("memory"), tmp_path / "memory.png")
    plt, fig = last_figure()
    log, zoom, four = fig.axes
    assert log.get_yscale() == "log" and zoom.get_yscale() == "linear"
    labels = [line.get_label() for line in zoom.lines]
    assert "paged blocks" in labels and "used" in labels
    assert not any(label.startswith("naive") for label in labels)   # the zoom's y range
    plt.close(fig)


def test_capacity_chart_draws_predicted_above_measured_and_labels_both(tmp_path):
    capacity.plot(recorded("capacity"), tmp_path / "capacity.png")
    plt, fig = last_figure()
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.lines}
    predicted, measured = lines["predicted (capacity math)"], lines["measured (engine)"]
    assert predicted.get_zorder() > measured.get_zorder()
    assert predicted.get_markerfacecolor() == "none"         # hollow: measured shows through
    assert predicted.get_markersize() > measured.get_markersize()
    texts = [t.get_text() for t in ax.texts]
    assert len(texts) == len(recorded("capacity")["rows"])
    assert all(t.startswith("predicted ") and ", measured " in t for t in texts)
    plt.close(fig)
