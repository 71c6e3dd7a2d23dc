"""`python -m refserve.selfcheck --backend cupy`: the one GPU check, tests then numbers.

On a machine with a CUDA GPU (CuPy, torch and transformers installed; no network, nothing
downloaded: every model is random weights made on the spot) it

  1. runs the GPU equality tests (tests/test_backend_equality_gpu.py) with pytest;
  2. measures the machine's ceilings: device-to-device copy GB/s (bytes read + written per
     second by cudaMemcpy) and a large float16 matmul's TFLOP/s;
  3. times paged decode attention at batch 1/16/64/256 x context 512/4096/32768 (32 query /
     8 KV heads, head_dim 128, block size 16, shuffled blocks, float16): v1 and v2, which
     one the backend's rule picks, achieved GB/s = KV bytes read / time and its share of the
     copy bandwidth, and torch's scaled_dot_product_attention over the same KV as one dense
     contiguous cache (the reference);
  4. runs end to end on a random Llama-3.2-1B-shaped model (float16): LLM.generate decode
     throughput at batch 64 against transformers' generate on the same weights, batch-1
     time per output token against the weight-streaming floor (weight bytes / copy GB/s),
     and greedy tokens of the NumPy reference, the tuned CPU and the CuPy backends on a
     random SmolLM2-135M-shaped model (float32, all three, same prompts);

then prints one table and writes everything as JSON (--json, default selfcheck.json).
Without a usable GPU it prints `error: no usable CUDA GPU: <cause>` and exits with status 2.

Timing: CUDA events around the work, median of repeated runs after warm-ups; end-to-end
numbers are wall-clock times of whole generate calls (prefill included, both sides alike).
Attention K/V hold a constant: the kernels' time does not depend on the values.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parents[1] / "tests" / "test_backend_equality_gpu.py"
ATTN_BATCHES, ATTN_CONTEXTS = (1, 16, 64, 256), (512, 4096, 32768)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def log(message: str) -> None:
    print(f"[selfcheck {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def gpu_time(cp, fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() on the current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    start, end, times = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


def run_tests() -> dict:
    if not TESTS.exists():
        return {"status": "not found", "path": str(TESTS)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", str(TESTS), "-q", "-rs",
                           "-p", "no:cacheprovider"], cwd=TESTS.parents[1],
                          capture_output=True, text=True, timeout=240)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"status": "passed" if proc.returncode == 0 else "FAILED",
            "seconds": round(time.perf_counter() - t0, 1), "summary": tail[-1] if tail else "",
            "tail": tail}


def measure_ceilings(cp) -> dict:
    n = 1 << 28                                       # 1 GiB of float32
    src, dst = cp.ones(n, cp.float32), cp.empty(n, cp.float32)
    t = gpu_time(cp, functools.partial(dst.data.copy_from_device_async, src.data, src.nbytes))
    copy_gbs = 2 * src.nbytes / t / 1e9               # every byte read once, written once
    del src, dst
    m = 8192
    a = cp.random.standard_normal((m, m), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((m, m), dtype=cp.float32).astype(cp.float16)
    t = gpu_time(cp, functools.partial(cp.matmul, a, b), reps=10)
    return {"copy_GBps": copy_gbs, "matmul_fp16_TFLOPs": 2 * m**3 / t / 1e12}


def bench_attention(cp, backend, copy_gbs: float) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from refserve.backends import cuda_launch as cl
    from refserve.model_runner import build_attention_metadata

    rows, rng, scale = [], np.random.default_rng(0), HEAD_DIM ** -0.5
    for batch in ATTN_BATCHES:
        for ctx in ATTN_CONTEXTS:
            kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
            row = {"batch": batch, "context": ctx, "kv_GB": kv_bytes / 1e9}
            free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
            if 1.3 * kv_bytes > free:
                rows.append({**row, "skipped": "does not fit in memory"})
                continue
            blocks = batch * ctx // BLOCK
            k = cp.full((blocks, BLOCK, KV_HEADS, HEAD_DIM), 0.01, cp.float16)
            v = cp.full_like(k, 0.02)
            tables = rng.permutation(blocks).reshape(batch, ctx // BLOCK).astype(np.int32)
            attn = build_attention_metadata(np.full(batch, -1), np.arange(batch + 1),
                                           np.full(batch, ctx), tables, backend.to_device)
            q = cp.random.standard_normal((batch, HEADS, HEAD_DIM), cp.float32).astype(cp.float16)
            out = cp.empty_like(q)
            arrays = (q, k, v, attn.block_tables, attn.context_lens, attn.query_start_loc)
            v1 = cl.decode_v1_launch(out, *arrays, scale, batch, "float16")
            part = cl.Partitioning(True, cl.PARTITION_SIZE, -(-ctx // cl.PARTITION_SIZE))
            work = backend._v2_workspace(batch, HEADS, HEAD_DIM, part.max_partitions)
            v2 = cl.decode_v2_launches(out, *arrays, scale, batch, part, work["tmp_out"],
                                       work["max_logits"], work["exp_sums"], "float16")
            t_v1 = gpu_time(cp, functools.partial(backend._run, v1))
            t_v2 = gpu_time(cp, functools.partial(_run_all, backend, v2))
            rule = cl.choose_partitioning(batch, HEADS, KV_HEADS, ctx, backend.num_sms)
            t = t_v2 if rule.use_v2 else t_v1
            row.update(v1_us=t_v1 * 1e6, v2_us=t_v2 * 1e6, chosen="v2" if rule.use_v2 else "v1",
                       GBps=kv_bytes / t / 1e9, pct_copy=100 * kv_bytes / t / 1e9 / copy_gbs)
            del k, v, q, out, attn, work
            backend._workspace.clear()
            cp.get_default_memory_pool().free_all_blocks()
            try:  # torch SDPA over the same KV as a dense contiguous cache
                kt = torch.full((batch, KV_HEADS, ctx, HEAD_DIM), 0.01, dtype=torch.float16,
                                device="cuda")
                vt, qt = torch.full_like(kt, 0.02), torch.randn(
                    batch, HEADS, 1, HEAD_DIM, dtype=torch.float16, device="cuda")
                sdpa = functools.partial(F.scaled_dot_product_attention, qt, kt, vt,
                                         enable_gqa=True)
                row["sdpa_us"] = torch_time(torch, sdpa) * 1e6
                del kt, vt, qt
            except Exception as exc:  # noqa: BLE001  (old torch, out of memory: report it)
                row["sdpa_us"] = None
                row["sdpa_error"] = f"{type(exc).__name__}: {exc}"[:120]
            torch.cuda.empty_cache()
            rows.append(row)
            log(f"attention B={batch} ctx={ctx}: {row.get('GBps', 0):.0f} GB/s")
    return rows


def _run_all(backend, launches) -> None:
    for launch in launches:
        backend._run(launch)


def torch_time(torch, fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def random_checkpoint(torch, transformers, shape: dict, folder: Path, device: str):
    """A random Llama of `shape`, made on `device`, saved as safetensors into `folder`."""
    config = transformers.LlamaConfig(**shape, max_position_embeddings=2048)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = model.to(dtype).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def bench_end_to_end(copy_gbs: float, workdir: Path) -> dict:
    import torch
    import transformers

    from refserve import LLM, SamplingParams

    hf = random_checkpoint(torch, transformers, LLAMA_1B, workdir / "llama1b", "cuda")
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    batch, prompt_len, new = 64, 128, 128
    prompts = np.random.default_rng(1).integers(LLAMA_1B["vocab_size"],
                                                size=(batch, prompt_len)).tolist()
    llm = LLM(model=str(workdir / "llama1b"), backend="cupy", dtype="float16",
              max_model_len=1024, max_num_seqs=batch, progress=False)

    def generate(ps, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]

    generate(prompts, 4)                                        # compile, capture graphs
    t_refserve, ours = generate(prompts, new)
    ids = torch.tensor(prompts, device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new,
                  min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        theirs = hf.generate(ids, **kwargs)[:, prompt_len:].tolist()
        torch.cuda.synchronize()
        t_hf = time.perf_counter() - t0
    generate(prompts[:1], 8)
    t_one, _ = generate(prompts[:1], 1)
    t_many, _ = generate(prompts[:1], 65)
    per_token = (t_many - t_one) / 64
    floor = weight_bytes / (copy_gbs * 1e9)
    match = [len(_common_prefix(a, b)) for a, b in zip(ours, theirs)]
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new,
            "refserve_tok_s": batch * new / t_refserve, "transformers_tok_s": batch * new / t_hf,
            "speedup": t_hf / t_refserve, "batch1_ms_per_token": per_token * 1e3,
            "weight_GB": weight_bytes / 1e9, "floor_ms_per_token": floor * 1e3,
            "x_floor": per_token / floor,
            "greedy_vs_transformers_mean_common_prefix": float(np.mean(match))}


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def greedy_across_backends(workdir: Path) -> dict:
    import torch
    import transformers

    from refserve import LLM, SamplingParams

    random_checkpoint(torch, transformers, SMOLLM2_135M, workdir / "smol", "cpu")
    prompts = np.random.default_rng(2).integers(SMOLLM2_135M["vocab_size"],
                                                size=(4, 12)).tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("numpy", "cpu", "cupy"):
        llm = LLM(model=str(workdir / "smol"), backend=backend, dtype="float32",
                  max_model_len=256, max_num_seqs=8, progress=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    equal = {name: sum(a == b for a, b in zip(tokens["numpy"], tokens[name]))
             for name in ("cpu", "cupy")}
    return {"prompts": len(prompts), "identical": equal, "tokens": tokens}


def table(results: dict) -> str:
    lines = [f"{'check':<46} {'value':>14}  target"]

    def add(name, value, target=""):
        lines.append(f"{name:<46} {value:>14}  {target}")

    tests = results.get("tests", {})
    add("GPU equality tests", tests.get("status", "-"), tests.get("summary", ""))
    c = results["ceilings"]
    add("device copy bandwidth (GB/s)", f"{c['copy_GBps']:.0f}")
    add("fp16 matmul 8192^3 (TFLOP/s)", f"{c['matmul_fp16_TFLOPs']:.0f}")
    for r in results.get("attention", []):
        name = f"attention B={r['batch']} ctx={r['context']}"
        if "skipped" in r:
            add(name, "skipped", r["skipped"])
            continue
        sdpa = "n/a" if r.get("sdpa_us") is None else f"{r['sdpa_us']:.0f}"
        target = ">= 80% copy, <= sdpa" if (r["batch"], r["context"]) == (64, 4096) else ""
        add(f"{name} ({r['chosen']}) us", f"{min(r['v1_us'], r['v2_us']):.0f}",
            f"v1 {r['v1_us']:.0f} v2 {r['v2_us']:.0f} sdpa {sdpa} | {r['GBps']:.0f} GB/s "
            f"= {r['pct_copy']:.0f}% copy {target}")
    e = results.get("end_to_end")
    if e:
        add("LLM.generate 1B fp16 batch 64 (tok/s)", f"{e['refserve_tok_s']:.0f}",
            f"transformers {e['transformers_tok_s']:.0f}: {e['speedup']:.2f}x (target >= 2x)")
        add("batch-1 decode (ms/token)", f"{e['batch1_ms_per_token']:.2f}",
            f"floor {e['floor_ms_per_token']:.2f}: {e['x_floor']:.2f}x (target <= 3x)")
        add("greedy vs transformers (common prefix)",
            f"{e['greedy_vs_transformers_mean_common_prefix']:.1f}", "of 128 tokens, fp16")
    g = results.get("greedy")
    if g:
        for name, same in g["identical"].items():
            add(f"greedy tokens numpy == {name} (fp32)", f"{same}/{g['prompts']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from refserve.entrypoints.cli_common import ArgumentParser, CLIError, check_output_path

    parser = ArgumentParser(prog="python -m refserve.selfcheck",
                            description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["cupy"], default="cupy")
    parser.add_argument("--json", type=Path, default=Path("selfcheck.json"),
                        help="where to write the results (checked before the run)")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    args = parser.parse_args(argv)
    try:
        check_output_path(args.json, "--json")
    except CLIError as e:
        parser.error(str(e))

    from refserve.backends import _gpu_unavailable_reason, get_backend

    reason = _gpu_unavailable_reason()
    if reason is not None:
        print(f"error: no usable CUDA GPU: {reason}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results: dict = {}
    if not args.skip_tests:
        log("running the GPU equality tests")
        results["tests"] = run_tests()
    backend = get_backend("cupy")
    cp = backend.xp
    results["device"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    log("measuring copy bandwidth and matmul throughput")
    results["ceilings"] = measure_ceilings(cp)
    copy_gbs = results["ceilings"]["copy_GBps"]
    log("timing paged decode attention")
    results["attention"] = bench_attention(cp, backend, copy_gbs)
    with tempfile.TemporaryDirectory() as tmp:
        for key, fn in (("end_to_end", lambda: bench_end_to_end(copy_gbs, Path(tmp))),
                        ("greedy", lambda: greedy_across_backends(Path(tmp)))):
            log(f"running {key}")
            try:
                results[key] = fn()
            except Exception as exc:  # noqa: BLE001  (report and go on to the next part)
                results[key + "_error"] = f"{type(exc).__name__}: {exc}"
                log(f"{key} failed: {results[key + '_error']}")
    results["seconds"] = round(time.perf_counter() - started, 1)
    print(f"refserve selfcheck on {results['device']} ({results['seconds']} s)")
    print(table(results))
    Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    print(f"results written to {args.json}")
    failed = results.get("tests", {}).get("status") == "FAILED" or any(
        k.endswith("_error") for k in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
