"""No layer reads a device array back to the host.

On a GPU, `int(a)`, `bool(a)` (an `if` or an `assert` on an array), `a.item()`, `a.tolist()`,
iterating `a`, indexing a scalar out of it, or `np.asarray(a)` each copy from the device and
wait for the whole queue. One per layer is thirty stalls a step. The runner computes what the
kernels need once, on the host, in `prepare`, and `forward` must never ask the device.

The test backend is the NumPy backend with every device array wrapped in `DeviceArray`, an
ndarray subclass that records each of those conversions (results of NumPy ops on it stay
DeviceArrays, like CuPy arrays do). `forward` on a tiny random model, over a batch mixing
decodes, a prefill chunk, a padding row and a speculative verify, must record none; the
only download allowed is the logits, through `to_numpy`.
"""

from types import SimpleNamespace

import numpy as np
from model_utils import row

from refserve.backends.numpy_backend import NumpyBackend
from refserve.models.loader import load_model
from refserve.static_runner import StaticBatchRunner


class DeviceArray(np.ndarray):
    """An ndarray that logs every conversion to a host value while `log` is a list."""

    log: list | None = None

    @classmethod
    def _record(cls, what: str) -> None:
        if cls.log is not None:
            cls.log.append(what)

    def __array_wrap__(self, array, context=None, return_scalar=False):
        # Keep 0-d results as (device) arrays, as CuPy does, instead of NumPy scalars.
        return np.ndarray.__array_wrap__(self, array, context, False).view(DeviceArray)

    def __int__(self):
        self._record("int()")
        return int(self.view(np.ndarray))

    def __float__(self):
        self._record("float()")
        return float(self.view(np.ndarray))

    def __bool__(self):
        self._record("bool()")
        return bool(self.view(np.ndarray))

    def __index__(self):
        self._record("__index__")
        return self.view(np.ndarray).__index__()

    def item(self, *args):
        self._record("item()")
        return self.view(np.ndarray).item(*args)

    def tolist(self):
        self._record("tolist()")
        return self.view(np.ndarray).tolist()

    def __iter__(self):
        self._record("iter()")
        return iter(self.view(np.ndarray))

    def __getitem__(self, key):
        out = super().__getitem__(key)
        if not isinstance(out, np.ndarray):
            self._record("scalar indexing")
        return out


def _count_asarray(monkeypatch):
    """np.asarray / np.array on a DeviceArray is a download on a GPU: record it."""
    for name in ("asarray", "array", "ascontiguousarray"):
        original = getattr(np, name)

        def wrapped(a, *args, __original=original, __name=name, **kwargs):
            if isinstance(a, DeviceArray):
                DeviceArray._record(f"np.{__name}")
                # Keep it a DeviceArray so the reads that follow are recorded too.
                return __original(a, *args, **kwargs).view(DeviceArray)
            return __original(a, *args, **kwargs)

        monkeypatch.setattr(np, name, wrapped)


class CountingBackend(NumpyBackend):
    """NumpyBackend whose 'device' arrays are DeviceArrays; counts uploads and downloads."""

    name = "counting"

    def __init__(self):
        super().__init__()
        self.downloads = 0

    def to_device(self, array):
        return np.ascontiguousarray(array).view(DeviceArray)

    def to_numpy(self, array):
        self.downloads += 1
        return array.view(np.ndarray).copy()

    def allocate_kv_cache(self, *args, **kwargs):
        return [(k.view(DeviceArray), v.view(DeviceArray))
                for k, v in super().allocate_kv_cache(*args, **kwargs)]


def mixed_step(rng):
    """Rows in scheduler order: a prefill chunk, two decodes, a padding row, a verify."""
    seqs = [rng.integers(3, 97, size=n).tolist() for n in (30, 21, 40, 12, 26)]
    bs, tables, nxt = 4, [], 0
    for s in seqs:
        n = -(-(len(s) + 4) // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    rows = [
        row(seqs[0], 8, 16, tables[0], num_logits=0),        # chunk in the middle of a prompt
        row(seqs[1], 20, 1, tables[1]),                      # decode
        row(seqs[2], 39, 1, tables[2]),                      # decode
        row(seqs[4], 22, 4, tables[4], num_logits=4),        # verify: 3 drafts + 1
    ]
    padding = [row(seqs[3], 11, 1, tables[3], num_logits=0)]  # static batching's
    return SimpleNamespace(scheduled=rows, padding=padding, block_copies=[(0, nxt)]), nxt + 1


def test_forward_reads_nothing_back_from_the_device(tiny_llama, monkeypatch):
    backend = CountingBackend()
    model = load_model(tiny_llama, backend)
    out, num_blocks = mixed_step(np.random.default_rng(0))
    runner = StaticBatchRunner(model, backend, num_blocks=num_blocks, block_size=4)
    inputs = runner.prepare(out)
    runner.copy_blocks(out.block_copies)
    _count_asarray(monkeypatch)
    DeviceArray.log = []
    try:
        logits = runner.forward(inputs)
        log = DeviceArray.log
    finally:
        DeviceArray.log = None
    assert log == [], f"device->host reads during forward: {log}"
    assert backend.downloads == 1                      # the logits, once
    assert type(logits) is np.ndarray and logits.dtype == np.float32
    assert logits.shape == (1 + 1 + 4, 97)


def test_the_counter_sees_host_reads(monkeypatch):
    """Negative control: each kind of read the forward must avoid is recorded."""
    _count_asarray(monkeypatch)
    a = np.arange(6).view(DeviceArray)
    DeviceArray.log = []
    try:
        int(a.max())
        if a[0:1] == 0:                                  # bool() of a 1-element array
            pass
        a[2]                                             # noqa: B018 (a scalar read)
        np.asarray(a)
        list(a)
        a.tolist()
        np.flatnonzero(a == 1)                           # stays on the device: not recorded
        log = DeviceArray.log
    finally:
        DeviceArray.log = None
    assert log == ["int()", "bool()", "scalar indexing", "np.asarray", "iter()", "tolist()"]
