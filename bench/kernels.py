"""GPU check and benchmark of the Pallas kernels against their references and peers (docs/development.md,
"Measurement protocol").

    PYTHONPATH=. python3 bench/kernels.py [--quick] [--long] [--pages scattered|contiguous] [--out DIR] [--budget SECONDS]

1. measures copy bandwidth and the bf16 matmul rate; 2. checks every Pallas kernel against its
reference at real sizes (PASS/FAIL); 3. times them at Qwen3-8B attention shapes (Hq 32, Hkv 8,
Dh 128, bf16) with the floors (bytes / bandwidth, flops / matmul rate); 4. times peers on the same
shapes; 5. writes DIR/kernels.json (default bench/results) and prints a markdown table last.

--quick: one shape (4 x 32K) and the main configurations. --long: adds 4 x 128K (about 25 GB of
GPU memory: fits an H100).
--tiny: small shapes, a smoke test of this script itself (runs on CPU, kernels in interpret mode).
The verify and sparse kernels read paged pools of 128-slot pages; --pages: rows' pages in random order
over them (a server's, the default) or consecutive. The peers read the same keys as contiguous rows.
Every item runs in its own try/except; the JSON is rewritten after every item, so a run cut short
still leaves its results. Items are skipped once --budget seconds have passed.
"""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory for torch

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from bench import common  # noqa: E402
from bench.common import seconds_per_call  # noqa: E402
from pallas_kernels import Collect, paging  # noqa: E402
from pallas_kernels._common import interpret_default  # noqa: E402
from pallas_kernels.sparse_attention import (  # noqa: E402
    sparse_attention_pallas,
    sparse_attention_reference,
)
from pallas_kernels.topk import select_topk_pallas, select_topk_reference  # noqa: E402
from pallas_kernels.verify_attention import (  # noqa: E402
    verify_attention_pallas,
    verify_attention_reference,
)

HQ, HKV, DH = 32, 8, 128
G = HQ // HKV
SCALE = DH ** -0.5
DTYPE = jnp.bfloat16
RATIO, TAIL = 0.07, 16
TOPK_LAYERS = 36
LAYERS = 2              # cache layers; calls alternate between them (each layer is > L2 = 50 MB)
STEPS = 8               # scan steps per timed call, LAYERS kernel calls each
MIN_RUN_S = 0.05        # each timing repeats the timed call until it takes this long
CHECK_TOL = 2e-2        # bf16
PAGE = paging.DEFAULT_PAGE_SIZE

SHAPES = [(1, 32768), (4, 32768), (16, 8192)]
LONG_SHAPE = (4, 131072)
QUICK_SHAPES = [(4, 32768)]
TINY_SHAPES = [(2, 1024)]


# ---------------------------------------------------------------- bookkeeping

class Bench:
    """Collects results, guards every item, keeps the JSON current."""

    def __init__(self, args):
        self.args = args
        self.start = time.perf_counter()
        self.out = Path(args.out) / "kernels.json"
        self.interpret = interpret_default()
        self.result = {
            "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "jax": jax.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name] + sys.argv), "copy_GBps": None,
            "matmul_TFLOPs": None, "checks": [], "timings": [], "errors": [], "skipped": []}

    def elapsed(self):
        return time.perf_counter() - self.start

    def run(self, what, fn, *args, **kwargs):
        """Returns fn(*args, **kwargs); on failure records and prints the error's first lines and
        returns None."""
        if self.elapsed() > self.args.budget:
            self.result["skipped"].append(what)
            print(f"[{self.elapsed():6.1f}s] SKIP {what} (budget)", flush=True)
            return None
        try:
            value = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- one failure must not end the run
            lines = "".join(traceback.format_exception_only(e)).strip().splitlines()
            message = "\n".join(lines[:6])
            self.result["errors"].append({"item": what, "error": message})
            print(f"[{self.elapsed():6.1f}s] ERROR {what}: {message}", flush=True)
            value = None
        self.save()
        return value

    def save(self):
        common.write_json(self.out, self.result)

    def timing(self, **row):
        bw, rate = self.result["copy_GBps"], self.result["matmul_TFLOPs"]
        row["GBps"] = row["bytes"] / row["us"] / 1e3
        if bw:
            row["pct_copy_bw"] = 100 * row["GBps"] / bw
            row["floor_bw_us"] = row["bytes"] / bw / 1e3
        if rate:
            row["floor_flops_us"] = row["flops"] / rate / 1e6
        self.result["timings"].append(row)
        print(f"[{self.elapsed():6.1f}s] {row['kernel']:8s} {row['impl']:22s} B={row['B']:<3d} "
              f"S={row['S']:<6d} T={row.get('T', '-')!s:3s} {row.get('collect', '-')!s:16s} "
              f"{row['us']:9.1f} us {row['GBps']:7.0f} GB/s "
              f"{row.get('pct_copy_bw', 0):5.1f}% of copy", flush=True)


def time_steps(step, state):
    """Microseconds per kernel call: step(state, i, layer) runs STEPS x LAYERS times in one scan.

    The layer alternates inside the scan body (static index: no copy), the query changes every call,
    and every output is kept, so XLA can neither hoist nor drop work.
    """
    def run(state):
        body = lambda carry, i: (carry, [step(state, i, layer) for layer in range(LAYERS)])
        return lax.scan(body, 0, jnp.arange(STEPS))[1]

    return seconds_per_call(jax.jit(run), state) / (STEPS * LAYERS) * 1e6


def rel_error(got, want):
    """max |got - want| / max |want| over finite entries; inf if NaN or the -inf patterns differ."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    if np.isnan(got).any() or not np.array_equal(np.isfinite(got), finite):
        return float("inf")
    return float(np.abs(got[finite] - want[finite]).max() / np.abs(want[finite]).max())


def normal(key, shape, dtype=DTYPE):
    return jax.random.normal(key, shape, dtype)


# ---------------------------------------------------------------- 1. device rates

def measure_rates(bench, tiny):
    """Device ceilings (bench/common.py), taken after the checks, on a warm GPU."""
    bench.result.update(common.measure_rates(tiny))


def measure_harness(bench):
    """Per-call cost of time_steps around a trivial step (launches, slicing, dispatch): a floor
    under every timed call; small kernels (sparse at 1 x 32K) sit on it."""
    st = {"q": normal(jax.random.key(4), (STEPS, LAYERS, 4, HQ, DH))}
    bench.result["harness_us"] = time_steps(lambda s, i, layer: s["q"][i, layer] * 2, st)
    print(f"timing harness: {bench.result['harness_us']:.1f} us per call of a trivial step",
          flush=True)


# ---------------------------------------------------------------- 2. correctness at real sizes

def check_positions(B, T, S):
    """Full rows, short rows, mid-block rows: row b ends at one of these lengths."""
    ends = [S - 1, T + 4, S // 3 + 45, S - 1000 + 7]
    return jnp.asarray([[ends[b % 4] - T + 1 + t for t in range(T)] for b in range(B)], jnp.int32)


def paged_kv(bench, key, B, S):
    """(k, v, pages): random pools [LAYERS, HKV, B * S + PAGE, DH] of B rows' pages and the null
    page, and their table (--pages)."""
    kk, kv = jax.random.split(key)
    pool = (LAYERS, HKV, B * S + PAGE, DH)
    return normal(kk, pool), normal(kv, pool), common.page_table(B, S, PAGE, bench.args.pages == "scattered")


def check_verify(bench, B, S, T, collect):
    ks = jax.random.split(jax.random.key(10 + T), 2)
    q = normal(ks[0], (B, T, HQ, DH))
    k, v, pages = paged_kv(bench, ks[1], B, S)
    pos = check_positions(B, T, S)
    options = dict(page_size=PAGE, scale=SCALE, collect=collect)
    got = jax.jit(lambda *a: verify_attention_pallas(*a, interpret=bench.interpret, **options))(
        q, k, v, pages, 1, pos)
    want = jax.jit(lambda *a: verify_attention_reference(*a, **options))(q, k, v, pages, 1, pos)
    errors = {name: rel_error(g, w) for name, g, w in zip(("out", "lse", "scores"), got, want)
              if w is not None}
    return record_check(bench, f"verify B={B} S={S} T={T} {describe(collect)}", errors)


def check_sparse(bench, B, S, Hs):
    ks = jax.random.split(jax.random.key(20 + Hs), 2)
    q = normal(ks[0], (B, 1, HQ, DH))
    rng = np.random.default_rng(Hs)
    k, v, pages = paged_kv(bench, ks[1], B, S)
    K = math.ceil(RATIO * S)
    tail_start = np.array([S - TAIL, S // 2, K + 3, S - 5])[np.arange(B) % 4]
    q_pos = np.minimum(tail_start + np.array([TAIL - 1, 3, -1, 4])[np.arange(B) % 4], S - 1)
    n_idx = np.array([K, K // 2, 1, K - 7])[np.arange(B) % 4]
    idx = np.stack([[rng.permutation(tail_start[b])[:K] for _ in range(Hs)] for b in range(B)])
    args = (q, k, v, pages, 1, jnp.asarray(idx, jnp.int32), *(jnp.asarray(x, jnp.int32)
                                                             for x in (n_idx, tail_start, q_pos[:, None])))
    options = dict(page_size=PAGE, scale=SCALE, tail_capacity=TAIL)
    got = jax.jit(lambda *a: sparse_attention_pallas(*a, interpret=bench.interpret, **options))(*args)
    want = jax.jit(lambda *a: sparse_attention_reference(*a, **options))(*args)
    return record_check(bench, f"sparse B={B} S={S} Hs={Hs}", {"out": rel_error(got, want)})


def check_topk(bench, B, S):
    K = math.ceil(RATIO * S)
    scores = jax.random.normal(jax.random.key(30), (TOPK_LAYERS, B, S))
    lengths = jax.random.randint(jax.random.key(31), (TOPK_LAYERS, B, 1), K // 2, S)
    scores = jnp.where(jnp.arange(S) < lengths, scores, -jnp.inf)
    k = jnp.full((TOPK_LAYERS, B), K, jnp.int32)
    got = np.asarray(jax.jit(lambda s, k: select_topk_pallas(s, K, k, interpret=bench.interpret))(
        scores, k))
    want = np.asarray(select_topk_reference(scores, K, k))
    x, n = np.asarray(scores), np.minimum(K, np.asarray(lengths)[..., 0])
    bad = 0
    for row in np.ndindex(x.shape[:-1]):
        chosen = np.sort(x[row][got[row][:n[row]]])
        bad += not np.array_equal(chosen, np.sort(x[row][want[row][:n[row]]]))
    return record_check(bench, f"topk [{TOPK_LAYERS},{B},{S}] k={K}", {"rows_wrong": bad},
                        limit=0)


def record_check(bench, what, errors, limit=CHECK_TOL):
    ok = all(e <= limit for e in errors.values())
    bench.result["checks"].append({"item": what, "errors": errors, "passed": ok})
    print(f"[{bench.elapsed():6.1f}s] {'PASS' if ok else 'FAIL'} {what}: "
          + ", ".join(f"{k}={v:.2e}" for k, v in errors.items()), flush=True)
    return ok


def describe(collect):
    if collect is None:
        return "-"
    rows = "all" if len(collect.rows) > 2 else ",".join(map(str, collect.rows))
    return f"{collect.metric}/{'mean' if collect.reduce_rows else 'rows'}[{rows}]"


# ---------------------------------------------------------------- 3. timings of our kernels

def kv_bytes(B, S, keys=None):
    """K and V bytes of `keys` slots per (row, kv head); all S by default."""
    return B * HKV * (S if keys is None else keys) * DH * 2 * jnp.dtype(DTYPE).itemsize


def attention_flops(B, T, keys):
    return 4 * B * HQ * T * keys * DH


def verify_state(bench, B, S, T):
    ks = jax.random.split(jax.random.key(B * S + T), 2)
    k, v, pages = paged_kv(bench, ks[1], B, S)
    return {"q": normal(ks[0], (STEPS, LAYERS, B, T, HQ, DH)), "k": k, "v": v, "pages": pages,
            "pos": jnp.broadcast_to(jnp.arange(S - T, S, dtype=jnp.int32), (B, T))}


def rows_view(st, name, layer):
    """Layer `layer` of pool st[name] as contiguous rows [B, HKV, S, DH] (the peers' layout)."""
    return paging.layer_view(st[name], layer, st["pages"], PAGE)


def collect_modes(T):
    """No collection, then each metric x reduce mode: vegas rows (0, T-1) or all rows per row."""
    if T == 1:
        return [None]
    ends, rows = (0, T - 1), tuple(range(T))
    return [None, Collect(ends, "weight", True), Collect(ends, "logit", True),
            Collect(rows, "weight", False), Collect(rows, "logit", False)]


def time_verify(bench, st, B, S, T, collect, impl="pallas", **options):
    if impl == "pallas":
        attend = lambda *a: verify_attention_pallas(*a, page_size=PAGE, scale=SCALE, collect=collect,
                                                    interpret=bench.interpret, **options)
    else:
        attend = lambda *a: verify_attention_reference(*a, page_size=PAGE, scale=SCALE, collect=collect)
    us = time_steps(lambda s, i, l: attend(s["q"][i, l], s["k"], s["v"], s["pages"], l, s["pos"]), st)
    out_bytes = 0 if collect is None else B * S * 4 * (1 if collect.reduce_rows
                                                       else len(collect.rows))
    name = impl + "".join(f" {k}={v}" for k, v in options.items())
    bench.timing(kernel="verify", impl=name, B=B, S=S, T=T, collect=describe(collect), us=us,
                 bytes=kv_bytes(B, S) + out_bytes, flops=attention_flops(B, T, S))


def time_sparse(bench, B, S, Hs):
    K = math.ceil(RATIO * S)
    ks = jax.random.split(jax.random.key(B * S + Hs), 2)
    rng = np.random.default_rng(B + Hs)
    idx = np.stack([[rng.permutation(S - TAIL)[:K] for _ in range(Hs)] for _ in range(B)])
    k, v, pages = paged_kv(bench, ks[1], B, S)
    st = {"q": normal(ks[0], (STEPS, LAYERS, B, 1, HQ, DH)), "k": k, "v": v, "pages": pages,
              "idx": jnp.asarray(idx, jnp.int32), "n_idx": jnp.full((B,), K, jnp.int32),
              "tail_start": jnp.full((B,), S - TAIL, jnp.int32), "pos": jnp.full((B, 1), S - 1, jnp.int32)}

    def step(s, i, layer):
        return sparse_attention_pallas(s["q"][i, layer], s["k"], s["v"], s["pages"], layer, s["idx"],
                                       s["n_idx"], s["tail_start"], s["pos"], page_size=PAGE, scale=SCALE,
                                       tail_capacity=TAIL, interpret=bench.interpret)

    us = time_steps(step, st)
    bench.timing(kernel="sparse", impl=f"pallas Hs={Hs}", B=B, S=S, T=1,
                 collect=f"{K}+{TAIL} keys", us=us, bytes=kv_bytes(B, S, K + TAIL),
                 flops=attention_flops(B, 1, K + TAIL))


def time_topk(bench, B, S):
    K = math.ceil(RATIO * S)
    st = {"scores": jax.random.normal(jax.random.key(B + S), (STEPS, LAYERS, TOPK_LAYERS, B, S)),
              "k": jnp.full((TOPK_LAYERS, B), K, jnp.int32)}
    pallas = lambda s, i, layer: select_topk_pallas(s["scores"][i, layer], K, s["k"],
                                                    interpret=bench.interpret)
    reference = lambda s, i, layer: select_topk_reference(s["scores"][i, layer], K, s["k"])
    for impl, step in (("pallas radix", pallas), ("lax.top_k", reference)):
        us = bench.run(f"topk {impl} B={B} S={S}", time_steps, step, st)
        if us is not None:
            bench.timing(kernel="topk", impl=impl, B=B, S=S, collect=f"[{TOPK_LAYERS},{B},{S}]"
                         f" k={K}", us=us, bytes=TOPK_LAYERS * B * (S + K) * 4, flops=0)


# ---------------------------------------------------------------- 4. peers

def peer_decode_attention(bench, st, B, S, T):
    """JAX's Pallas decode kernel (mqa) on the same cache: batch x kv head rows, G*T query rows
    each (for T > 1 without the causal mask among the new rows)."""
    from jax.experimental.pallas.ops.gpu import decode_attention
    ks = [rows_view(st, "k", layer).reshape(B * HKV, S, DH) for layer in range(LAYERS)]
    vs = [rows_view(st, "v", layer).reshape(B * HKV, S, DH) for layer in range(LAYERS)]
    lengths = jnp.full((B * HKV,), S, jnp.int32)

    def step(s, i, layer):
        q = jnp.swapaxes(s["q"][i, layer].reshape(B, T, HKV, G, DH), 1, 2)
        return decode_attention.mqa(q.reshape(B * HKV, T * G, DH), ks[layer], vs[layer],
                                    kv_seq_len=lengths, sm_scale=SCALE)
    return time_steps(step, st)


def peer_paged_attention(bench, st, B, S, T):
    """JAX's Pallas paged kernel, 16-token pages laid out [Hkv, pages, 16, Dh] (decode only)."""
    from jax.experimental.pallas.ops.gpu import paged_attention
    assert T == 1
    page = 16
    pages = [jnp.swapaxes(rows_view(st, name, layer), 0, 1).reshape(HKV, B * S // page, page, DH)
             for name in ("k", "v") for layer in range(LAYERS)]
    tables = jnp.arange(B * S // page, dtype=jnp.int32).reshape(B, S // page)
    lengths = jnp.full((B,), S, jnp.int32)

    def step(s, i, layer):
        return paged_attention.paged_attention(s["q"][i, layer][:, 0], pages[layer],
                                               pages[LAYERS + layer], tables, lengths)
    return time_steps(step, st)


def peer_cudnn(bench, st, B, S, T):
    """jax.nn.dot_product_attention(implementation="cudnn"), cache as [B, S, Hkv, Dh] (transposed
    outside the timing); for T > 1 without the causal mask among the new rows."""
    ks = [jnp.swapaxes(rows_view(st, "k", layer), 1, 2) for layer in range(LAYERS)]
    vs = [jnp.swapaxes(rows_view(st, "v", layer), 1, 2) for layer in range(LAYERS)]
    lengths = jnp.full((B,), S, jnp.int32)

    def step(s, i, layer):
        return jax.nn.dot_product_attention(s["q"][i, layer], ks[layer], vs[layer], scale=SCALE,
                                            key_value_seq_lengths=lengths,
                                            implementation="cudnn")
    return time_steps(step, st)


def peer_torch_sdpa(bench, st, B, S, T):
    """torch scaled_dot_product_attention (enable_gqa), no mask: every row sees the full cache."""
    import torch
    import torch.nn.functional as F
    q = torch.randn(B, HQ, T, DH, device="cuda", dtype=torch.bfloat16)
    kv = [torch.randn(B, HKV, S, DH, device="cuda", dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    run = lambda layer: F.scaled_dot_product_attention(q, kv[layer], kv[LAYERS + layer],
                                                       scale=SCALE, enable_gqa=True)
    for layer in range(LAYERS):
        run(layer)
    torch.cuda.synchronize()

    def timed(n):
        start = time.perf_counter()
        for i in range(n):
            run(i % LAYERS)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    n = max(10, math.ceil(MIN_RUN_S / timed(10)))
    return statistics.median(timed(n) for _ in range(3)) * 1e6


PEERS = [("pallas decode_attention", peer_decode_attention, (1, 10)),
         ("pallas paged_attention", peer_paged_attention, (1,)),
         ("cudnn", peer_cudnn, (1, 10)),
         ("torch sdpa", peer_torch_sdpa, (1, 10))]


# ---------------------------------------------------------------- driver

def with_state(bench, B, S, T, items, *args):
    """Builds the timing inputs for one shape, runs items(bench, state, B, S, T, *args), frees them."""
    st = bench.run(f"inputs B={B} S={S} T={T}", verify_state, bench, B, S, T)
    if st is not None:
        items(bench, st, B, S, T, *args)
    del st
    gc.collect()


def verify_plain(bench, st, B, S, T):
    bench.run(f"verify pallas B={B} S={S} T={T}", time_verify, bench, st, B, S, T, None)


def verify_collecting(bench, st, B, S, T, modes):
    for collect in collect_modes(T)[1:modes + 1]:
        bench.run(f"verify pallas B={B} S={S} T={T} {describe(collect)}", time_verify, bench, st,
                  B, S, T, collect)


def verify_peers(bench, st, B, S, T):
    bench.run(f"verify reference B={B} S={S} T={T}", time_verify, bench, st, B, S, T, None,
              impl="reference (XLA)")
    for name, peer, peer_Ts in PEERS:
        if T not in peer_Ts or bench.interpret:
            continue
        us = bench.run(f"{name} B={B} S={S} T={T}", peer, bench, st, B, S, T)
        if us is not None:
            bench.timing(kernel="verify", impl=name, B=B, S=S, T=T, collect="peer", us=us,
                         bytes=kv_bytes(B, S), flops=attention_flops(B, T, S))


def verify_tuning(bench, st, B, S, T):
    """Block size and split count around the defaults."""
    for block_k in (32, 64, 128):
        for n_splits in (8, 16, 32):
            bench.run(f"tune verify block_k={block_k} n_splits={n_splits}", time_verify, bench,
                      st, B, S, T, None, block_k=block_k, n_splits=n_splits)


def phase_core(bench, shapes, Ts):
    """Verify without collection, sparse with a shared index set, top-k: every shape first."""
    for B, S in shapes:
        for T in Ts:
            with_state(bench, B, S, T, verify_plain)
        bench.run(f"sparse B={B} S={S} Hs=1", time_sparse, bench, B, S, 1)
        time_topk(bench, B, S)


def phase_collect(bench, shapes, Ts, modes):
    """The collection modes (their cost over plain verify) and per-KV-head sparse index sets."""
    for B, S in shapes:
        for T in Ts:
            with_state(bench, B, S, T, verify_collecting, modes)
        bench.run(f"sparse B={B} S={S} Hs={HKV}", time_sparse, bench, B, S, HKV)


def phase_peers(bench, shapes, Ts):
    """Our XLA reference and the peers, decode (T=1) and verification shapes; 4 x 32K first, as
    each peer takes up to ~40 s to build and time and the budget may not reach the others."""
    for B, S in sorted(shapes, key=lambda shape: shape != (4, 32768)):
        for T in Ts:
            with_state(bench, B, S, T, verify_peers)


def markdown(result):
    lines = [(f"{result['device']}: copy {result['copy_GBps'] or 0:.0f} GB/s, bf16 matmul "
              f"{result['matmul_TFLOPs'] or 0:.0f} TFLOP/s, harness "
              f"{result.get('harness_us', 0):.1f} us/call"), "",
             ("| kernel | impl | B x S | T | collect | us | GB/s | % copy BW | floor BW us "
              "| floor flops us |"), "|" + " --- |" * 10]
    for r in result["timings"]:
        lines.append(f"| {r['kernel']} | {r['impl']} | {r['B']} x {r['S']} | {r.get('T', '-')} "
                     f"| {r.get('collect', '-')} | {r['us']:.1f} | {r['GBps']:.0f} "
                     f"| {r.get('pct_copy_bw', float('nan')):.1f} "
                     f"| {r.get('floor_bw_us', float('nan')):.1f} "
                     f"| {r.get('floor_flops_us', float('nan')):.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--long", action="store_true", help="add 4 x 128K")
    parser.add_argument("--tiny", action="store_true", help="smoke test of this script (CPU ok)")
    parser.add_argument("--pages", choices=("scattered", "contiguous"), default="scattered",
                        help="the kernels' tables: rows' pages in random order over the pool, or consecutive")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--budget", type=float, default=330.0,
                        help="seconds after which remaining items are skipped")
    args = parser.parse_args()
    bench = Bench(args)
    print(f"{bench.result['device']} ({bench.result['backend']}), jax {jax.__version__}",
          flush=True)
    B, S = TINY_SHAPES[0] if args.tiny else (4, 32768)
    for T, collect in [(1, None), (10, None)] + [(10, c) for c in collect_modes(10)[1:]]:
        bench.run(f"check verify T={T} {describe(collect)}", check_verify, bench, B, S, T, collect)
    for Hs in (1, HKV):
        bench.run(f"check sparse Hs={Hs}", check_sparse, bench, B, S, Hs)
    bench.run("check topk", check_topk, bench, B, S)
    bench.run("device rates", measure_rates, bench, args.tiny)
    bench.run("harness", measure_harness, bench)

    small = args.quick or args.tiny
    shapes = TINY_SHAPES if args.tiny else QUICK_SHAPES if args.quick else SHAPES
    shapes = shapes + ([LONG_SHAPE] if args.long else [])
    phase_core(bench, shapes, (1, 10) if small else (1, 7, 10))
    phase_collect(bench, shapes, (10,) if small else (7, 10), 2 if small else 4)
    phase_peers(bench, shapes, (1, 10))
    if not small:
        with_state(bench, 1, 32768, 10, verify_tuning)   # B=1: where the split count matters

    bench.result["total_s"] = bench.elapsed()
    bench.save()
    checks = bench.result["checks"]
    print(f"\nchecks: {sum(c['passed'] for c in checks)}/{len(checks)} passed; "
          f"errors: {len(bench.result['errors'])}; skipped: {len(bench.result['skipped'])}; "
          f"{bench.elapsed():.0f} s; JSON: {bench.out}\n")
    print(markdown(bench.result))


if __name__ == "__main__":
    main()
