"""The tuned CPU backend's compiled kernels (numba) against the reference's NumPy.

    exp32            within 2.5e-7 relative of exp over float32's normal range; 0 below it
    linear_kernel    within the float32 rounding bound of a dot product (Higham), every
                     model shape and row count, odd shapes, the empty product
    rms_norm, add_rms_norm, rope_write_kv, silu_mul
                     the reference model's formulas (llama.py) within float32 rounding; the
                     KV write touches exactly the slots named, none for slot -1
    fused_forward    the reference forward's logits (a tiny Llama and Qwen2 with biases:
                     prefill in chunks, then decodes), within float32 rounding
Plus how the kernels are chosen: REFSERVE_CPU_KERNELS, a machine where numba cannot load
(simulated in a subprocess: NumPy forms and one start-up line saying so), the disk cache's
folder, and the threads of the parallel loops following the thread policy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from refserve.backends import compiled

if not compiled.available():
    pytest.skip(f"compiled kernels unavailable: {compiled.unavailable_reason()}",
                allow_module_level=True)

from refserve.backends import cpu_fused  # noqa: E402  (needs numba: after the skip)
from refserve.backends.cpu_exp import SMALLEST, exp32  # noqa: E402
from refserve.backends.cpu_linear import PANEL, PackedWeight, linear_kernel, pack  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# SmolLM2-135M (hidden 576, 9 heads and 3 KV heads of 64, intermediate 1536, vocab 49152):
# q/k/v fused, o, gate/up fused, down, lm_head.
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
_weights: dict[tuple[int, int], np.ndarray] = {}


def weight(shape) -> np.ndarray:
    if shape not in _weights:
        _weights[shape] = np.random.default_rng(len(_weights)).standard_normal(
            shape, dtype=np.float32)
    return _weights[shape]


def assert_is_the_product(got, w, x):
    """|got - x·Wᵀ| <= γ_n · (|x|·|W|ᵀ) + u·|x·Wᵀ| elementwise, γ_n = n·u / (1 - n·u), u the
    float32 unit roundoff, n = in: the bound of any summation order of a float32 dot
    product (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), plus the final
    rounding. A wrong row, block edge or transpose is off by O(|x|·|W|), far above it."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    ref = x64 @ w64.T
    u, n = 2.0 ** -24, w.shape[1]
    bound = n * u / (1 - n * u) * (np.abs(x64) @ np.abs(w64).T) + u * np.abs(ref)
    assert got.shape == ref.shape
    excess = np.abs(got - ref) - bound
    assert excess.max() <= 0, f"off by up to {excess.max()} above the rounding bound"


# ------------------------------------------------------------------------------ exp32

def test_exp32_is_exp_within_float32_rounding_over_the_normal_range():
    from numba import njit

    @njit
    def many(x, out):
        for i in range(x.shape[0]):
            out[i] = exp32(x[i])

    x = np.linspace(-87.33, 88.72, 1_000_001, dtype=np.float32)
    x = np.concatenate([x, np.float32([0, -0.0, 1e-8, -1e-8, 0.3465, -0.3466, 88.0])])
    got = np.empty_like(x)
    many(x, got)
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - exact) / exact) < 2.5e-7
    assert got[np.flatnonzero(x == 0)[0]] == 1.0
    below = np.float32([SMALLEST - 0.01, -100, -1e30, -np.inf])
    out = np.empty_like(below)
    many(below, out)
    assert (out == 0).all()          # no subnormal, no negative, no NaN


# ----------------------------------------------------------------------------- linear

@settings(deadline=None, max_examples=40)
@given(shape=st.sampled_from(MODEL_SHAPES), rows=st.integers(1, 70), seed=st.integers(0, 99))
@example(shape=(49152, 576), rows=1, seed=0)
@example(shape=(576, 1536), rows=67, seed=0)     # 16 blocks of 4, a pair, a last row
def test_the_compiled_linear_is_the_product_for_every_model_shape(shape, rows, seed):
    w = weight(shape)
    x = np.random.default_rng(seed).standard_normal((rows, shape[1]), dtype=np.float32)
    assert_is_the_product(PackedWeight(w)(x), w, x)


@settings(deadline=None, max_examples=60)
@given(out=st.integers(1, 70), inner=st.integers(1, 40), rows=st.integers(1, 11),
       seed=st.integers(0, 99))
@example(out=17, inner=3, rows=7, seed=0)        # a full tile and one weight row left over
@example(out=15, inner=1, rows=1, seed=0)        # no full tile
def test_the_compiled_linear_is_the_product_for_odd_shapes(out, inner, rows, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, inner), dtype=np.float32)
    x = rng.standard_normal((rows, inner), dtype=np.float32)
    assert_is_the_product(PackedWeight(w)(x), w, x)


def test_the_compiled_linear_takes_views_and_the_empty_product():
    w = weight((576, 576))
    dense = PackedWeight(w)
    assert dense(np.zeros((0, 576), np.float32)).shape == (0, 576)
    x = np.random.default_rng(1).standard_normal((3, 1152), dtype=np.float32)[:, ::2]
    assert_is_the_product(dense(x), w, x)                  # a strided view of x


def test_the_packed_weight_keeps_its_rows_once():
    """The panels hold W exactly (zero padding past `out`), and the rows a tied embedding
    looks up are read from them: no second copy of the table."""
    w = np.random.default_rng(3).standard_normal((PANEL + 5, 7), dtype=np.float32)
    dense = PackedWeight(w)
    assert dense.panels.shape == (2, 7, PANEL)
    assert (dense.panels[1, :, 5:] == 0).all()
    ids = np.array([0, 3, PANEL, PANEL + 4, 3])
    np.testing.assert_array_equal(dense.rows[ids], w[ids])
    np.testing.assert_array_equal(np.asarray(dense.rows), w)
    assert dense.rows.panels is dense.panels and len(dense.rows) == PANEL + 5


def test_the_bound_catches_a_kernel_that_skips_a_row_of_x():
    """Negative control: the kernel's output with one row left unwritten fails the bound."""
    w = weight((960, 576))
    x = np.random.default_rng(2).standard_normal((6, 576), dtype=np.float32)
    out = np.zeros((6, 960), dtype=np.float32)
    linear_kernel(x[:5], pack(w), out[:5])                 # row 5 never computed
    with pytest.raises(AssertionError):
        assert_is_the_product(out, w, x)


# ---------------------------------------------------------------------- fused elementwise

def reference_rms_norm(x, w, eps):
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(variance + eps)) * w


@pytest.mark.parametrize("rows", [1, 5, 130])
def test_rms_norm_and_the_residual_add(rows):
    rng = np.random.default_rng(rows)
    h = rng.standard_normal((rows, 576), dtype=np.float32) * 3
    delta = rng.standard_normal((rows, 576), dtype=np.float32)
    w = rng.standard_normal(576, dtype=np.float32)
    eps = np.float32(1e-5)
    out = np.empty_like(h)
    cpu_fused.rms_norm(h, w, eps, out)
    np.testing.assert_allclose(out, reference_rms_norm(h, w, eps), rtol=2e-6, atol=2e-6)
    summed = h + delta
    cpu_fused.add_rms_norm(h, delta, w, eps, out)
    np.testing.assert_array_equal(h, summed)               # the residual stream, in place
    np.testing.assert_allclose(out, reference_rms_norm(summed, w, eps), rtol=2e-6, atol=2e-6)


def test_rope_write_kv_rotates_and_writes_exactly_the_named_slots():
    from refserve.backends.numpy_backend import NumpyBackend

    rng = np.random.default_rng(4)
    heads, kv_heads, dim, tokens = 9, 3, 64, 6
    qkv = rng.standard_normal((tokens, (heads + 2 * kv_heads) * dim), dtype=np.float32)
    positions = np.array([0, 5, 17, 3, 99, 40])
    angles = np.outer(np.arange(128), 1.0 / 10000 ** (np.arange(0, dim, 2) / dim))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    slots = np.array([3, -1, 16, 0, 31, -1])            # two tokens write nothing
    caches = [rng.standard_normal((2, 16, kv_heads, dim), dtype=np.float32)
              for _ in range(4)]                          # compiled k, v; reference k, v
    caches[2][:], caches[3][:] = caches[0], caches[1]
    q = np.empty((tokens, heads, dim), dtype=np.float32)
    cpu_fused.rope_write_kv(qkv, positions, cos, sin, heads, caches[0], caches[1], slots, q)

    def rope(x):                                          # llama.py's rotate-half form
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    np.testing.assert_allclose(q, rope(qkv[:, :heads * dim].reshape(tokens, heads, dim)),
                               rtol=1e-6, atol=1e-6)
    k = rope(qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(tokens, kv_heads, dim))
    v = qkv[:, (heads + kv_heads) * dim:].reshape(tokens, kv_heads, dim)
    NumpyBackend().write_kv(k, v, caches[2], caches[3], slots)
    np.testing.assert_allclose(caches[0], caches[2], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(caches[1], caches[3])   # values are copied, not rounded


def test_silu_mul():
    rng = np.random.default_rng(5)
    gate_up = rng.standard_normal((7, 2 * 1536), dtype=np.float32) * 6
    gate_up[0, :4] = [-200, -90, 90, 0]                   # exp(-x) overflows, underflows
    out = np.empty((7, 1536), dtype=np.float32)
    cpu_fused.silu_mul(gate_up, out)
    gate, up = gate_up[:, :1536].astype(np.float64), gate_up[:, 1536:].astype(np.float64)
    with np.errstate(over="ignore"):
        expected = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-30)


# ---------------------------------------------------------------------- the fused forward

@pytest.mark.parametrize("model_type, bias", [("llama", None), ("qwen2", None),
                                              ("llama", "attention")])
def test_the_fused_forward_gives_the_reference_logits(tmp_path, model_type, bias):
    """Prefill in chunks of 5 (the NumPy tiles beyond 8 tokens are not reached), then the
    same tokens as one 37-token prefill (those tiles), on a tiny model: the compiled
    backend's fused forward against the reference backend's forward."""
    from model_utils import max_rel_err, prefill_logits, save_tiny_hf_model

    from refserve.backends import CpuBackend, NumpyBackend
    from refserve.models.loader import load_model

    folder, _ = save_tiny_hf_model(tmp_path, model_type, True, 2, bias=bias)
    tokens = list(range(3, 40))
    reference = load_model(folder, NumpyBackend())
    tuned = load_model(folder, CpuBackend(kernels="compiled"))
    for chunk in (5, None):
        ref, _ = prefill_logits(reference, tokens, chunk=chunk)
        got, _ = prefill_logits(tuned, tokens, chunk=chunk)
        assert max_rel_err(got, ref) < 1e-5, chunk


# ------------------------------------------------------------------ choosing the kernels

def test_the_setting_is_checked_and_named(monkeypatch):
    from refserve.backends import CpuBackend

    monkeypatch.setenv(compiled.ENV, "fast")
    with pytest.raises(ValueError, match=compiled.ENV):
        compiled.setting()
    with pytest.raises(ValueError, match="kernels="):
        CpuBackend(kernels="fast")
    monkeypatch.setenv(compiled.ENV, "numpy")
    backend = CpuBackend()
    assert not backend.compiled
    assert backend.startup_note().startswith(f"kernels: NumPy ({compiled.ENV}=numpy)")
    assert CpuBackend(kernels="compiled").compiled


def test_a_machine_without_numba_runs_numpy_forms_and_says_so(tmp_path):
    """numba made unimportable (as on a platform without its wheel): the tuned backend
    still loads and answers, on the NumPy forms, and its start-up line says why."""
    script = tmp_path / "no_numba.py"
    script.write_text(
        "import sys\n"
        "sys.modules['numba'] = None   # `import numba` now raises ImportError\n"
        "from refserve.backends import CpuBackend\n"
        "import numpy as np\n"
        "b = CpuBackend()\n"
        "assert not b.compiled\n"
        "print(b.startup_note())\n"
        "w = b.prepare_weight(np.ones((8, 4), np.float32))\n"
        "print(b.linear(np.ones((2, 4), np.float32), w).sum())\n")
    env = {k: v for k, v in os.environ.items() if k != compiled.ENV}
    env["PYTHONPATH"] = str(ROOT)           # this checkout's refserve, not an installed one
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    note, total = result.stdout.splitlines()
    assert note.startswith("kernels: NumPy (numba cannot be imported (")
    assert "pip install numba" in note
    assert float(total) == 64.0
    assert "Traceback" not in result.stderr


def test_the_disk_cache_moves_to_refserve_home_where_the_package_is_read_only(
        tmp_path, monkeypatch):
    """A package folder this user cannot write (a system-wide install; os.access faked,
    since root may write anywhere): the cache goes to $REFSERVE_HOME/numba-cache, unless
    NUMBA_CACHE_DIR says where. A writable one keeps numba's own place."""
    site = tmp_path / "site-packages"
    env = {"REFSERVE_HOME": str(tmp_path / "home")}
    assert compiled.cache_dir_for(site, env) is None or not os.access(site, os.W_OK)
    monkeypatch.setattr(compiled.os, "access", lambda path, mode: Path(path) != site)
    assert compiled.cache_dir_for(site, env) == tmp_path / "home" / "numba-cache"
    assert compiled.cache_dir_for(site, {**env, "NUMBA_CACHE_DIR": "/x"}) is None
    assert compiled.cache_dir_for(tmp_path, env) is None


def test_the_parallel_loops_follow_the_thread_policy(tiny_llama):
    """Each forward sets numba's thread count to the policy's: one thread beside a busy
    neighbour, two on an idle machine (here fixed, as REFSERVE_CPU_THREADS does)."""
    import numba
    from model_utils import prefill_logits

    from refserve.backends import CpuBackend
    from refserve.backends.cpu_threads import ThreadPolicy, thread_policy
    from refserve.models.loader import load_model

    backend = CpuBackend(kernels="compiled")
    model = load_model(tiny_llama, backend)
    try:
        for count in (1, 2):
            backend.threads = ThreadPolicy(fixed=count)
            prefill_logits(model, [1, 2, 3])
            assert numba.get_num_threads() == min(count, numba.config.NUMBA_NUM_THREADS)
    finally:
        backend.threads = thread_policy()


# ------------------------------------------------------------------- batch invariance

def test_a_row_of_the_compiled_linear_does_not_depend_on_the_other_rows():
    """Bitwise: a row's product alone, in a pair, in blocks of four (the kernel's three
    block shapes), so a verify pass and a decode step give a token the same numbers and
    speculation cannot change greedy output through rounding."""
    rng = np.random.default_rng(6)
    for shape in [(960, 576), (576, 1536), (37, 40)]:
        dense = PackedWeight(rng.standard_normal(shape, dtype=np.float32))
        x = rng.standard_normal((19, shape[1]), dtype=np.float32)
        full = dense(x)
        for rows in (1, 2, 3, 5, 8):
            np.testing.assert_array_equal(dense(x[:rows]), full[:rows])
        np.testing.assert_array_equal(dense(x[18:]), full[18:])


def test_a_token_attends_the_same_in_a_decode_and_in_a_verify_chunk():
    """Bitwise: the last token of a 5-token verify chunk, and the same token as a decode
    row over the same cache, get the same attention output."""
    from test_paged_attention import build_batch, paged_attention

    from refserve.backends import CpuBackend

    backend = CpuBackend(kernels="compiled")
    rng = np.random.default_rng(8)
    q, k_cache, v_cache, tables, ctx, qsl, _ = build_batch(rng, 16, 3, 3, 64, [(203, 5)])
    verify = paged_attention(backend, q, k_cache, v_cache, tables, ctx, qsl, 0.125)
    for j in range(5):                 # token j alone: a decode at context 203 - 4 + j
        decode = paged_attention(backend, q[j:j + 1], k_cache, v_cache, tables,
                                 ctx - 4 + j, np.array([0, 1], np.int32), 0.125)
        np.testing.assert_array_equal(decode[0], verify[j])


@pytest.mark.slow
def test_greedy_output_is_the_same_on_compiled_numpy_and_reference_kernels(smollm2_dir,
                                                                          monkeypatch):
    """The real model, a batch of 4 (decode at 2-4 rows) with n-gram speculation (verify
    passes of up to 4 x 5 rows): token-identical output on the compiled kernels, the
    tuned backend's NumPy ones and the reference backend."""
    from refserve import LLM, SamplingParams

    prompts = ["The capital of France is", "Repeat after me: one two three four, one two",
               "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    outputs = {}
    for kernels in ("compiled", "numpy", "reference"):
        monkeypatch.setenv(compiled.ENV, "numpy" if kernels == "numpy" else "compiled")
        llm = LLM(model=str(smollm2_dir), progress=False, speculative_config=spec,
                  backend="numpy" if kernels == "reference" else "cpu")
        outputs[kernels] = [o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outputs["compiled"] == outputs["numpy"] == outputs["reference"]
