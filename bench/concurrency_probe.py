"""Can XLA run two independent half-batches of a draft layer side by side?

A 128-row SmolLM2 draft layer is latency-bound: its cuBLAS products and small kernels each take a few
microseconds whatever their rows. If the command buffer ran two independent halves' kernels at once
(`--xla_gpu_command_buffer_scheduling_mode=CONCURRENT` builds the graph from buffer dependencies),
a layer could cost about one half's time. This probe times a scan of 30 layers of SmolLM2's four
products, norms and SiLU on one chain of B rows against two independent chains of B / 2 rows (and of
B rows: if those cost one chain's time, they ran side by side). Run it once per scheduling mode.
"""

import argparse
import functools
import json
import os
import time
from pathlib import Path

from jaxspec.xla_flags import set_gpu_flags
import jax
import jax.numpy as jnp

HIDDEN, QKV, FFN, LAYERS = 576, 960, 1536, 30


def weights(key):
    k = jax.random.split(key, 4)
    init = lambda kk, shape: (jax.random.normal(kk, (LAYERS,) + shape, jnp.float32) / shape[0] ** 0.5).astype(jnp.bfloat16)
    return dict(qkv=init(k[0], (HIDDEN, QKV)), o=init(k[1], (HIDDEN, HIDDEN)),
                gate_up=init(k[2], (HIDDEN, 2 * FFN)), down=init(k[3], (FFN, HIDDEN)))


def norm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(jnp.bfloat16)


def layer(x, w):
    qkv = norm(x) @ w["qkv"]
    h = x + qkv[:, :HIDDEN] @ w["o"]
    gu = norm(h) @ w["gate_up"]
    return h + (jax.nn.silu(gu[:, :FFN]) * gu[:, FFN:]) @ w["down"]


def scanned(x, ws, unroll: int = 1):
    """One chain through the layers, a scan over their stacked weights."""
    return jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws, unroll=unroll)[0]


def chains(xs, ws):
    """Each chain its own scan of the layers: no data flows between chains."""
    return [scanned(x, ws) for x in xs]


def chains_one_scan(xs, ws):
    """All chains in one scan body: the layer written once per chain, side by side."""
    def body(xs, w):
        return [layer(x, w) for x in xs], None
    return jax.lax.scan(body, list(xs), ws)[0]


def timed(cases, repeats=30, rounds=9):
    """Median over rounds that alternate the cases, so clock and host drift hit all alike."""
    for fn, args in cases.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (fn, args) in cases.items():
            t = time.perf_counter()
            for _ in range(repeats):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t) / repeats * 1e6)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def unrolled(x, ws):
    """The layers as a Python loop over separate weight arrays: no scan, no dynamic slice."""
    for w in ws:
        x = layer(x, w)
    return x


def products(x, ws):
    """Only the four products a layer, with slices between them."""
    for w in ws:
        qkv = x @ w["qkv"]
        gu = (qkv[:, :HIDDEN] @ w["o"]) @ w["gate_up"]
        x = gu[:, :FFN] @ w["down"]
    return x


def gemm_cases(B, stacked):
    ws = [jax.tree.map(lambda a: a[i], stacked) for i in range(LAYERS)]
    x = jax.random.normal(jax.random.key(1), (B, HIDDEN), jnp.bfloat16)
    return {
        f"scan, layer of {B}": (jax.jit(scanned), (x, stacked)),
        f"scan unroll=30, layer of {B}": (jax.jit(functools.partial(scanned, unroll=LAYERS)), (x, stacked)),
        f"unrolled, layer of {B}": (jax.jit(unrolled), (x, ws)),
        f"unrolled, products of {B}": (jax.jit(products), (x, ws)),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--part", choices=("chains", "gemms"), default="chains")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    mode = "_".join(f.split("=")[0].removeprefix("--xla_gpu_") + "-" + f.split("=")[1]
                    for f in os.environ.get("XLA_FLAGS", "").split()) or "default"
    ws = weights(jax.random.key(0))
    B = args.batch
    x = lambda n, seed: jax.random.normal(jax.random.key(seed), (n, HIDDEN), jnp.bfloat16)
    if args.part == "gemms":
        rows = timed(gemm_cases(B, ws))
    else:
        rows = timed({
            f"one chain of {B}": (jax.jit(chains), ([x(B, 1)], ws)),
            f"two chains of {B // 2}, two scans": (jax.jit(chains), ([x(B // 2, 1), x(B // 2, 2)], ws)),
            f"two chains of {B // 2}, one scan": (jax.jit(chains_one_scan), ([x(B // 2, 1), x(B // 2, 2)], ws)),
            f"two chains of {B}, one scan": (jax.jit(chains_one_scan), ([x(B, 1), x(B, 2)], ws)),
            f"four chains of {B // 4}, one scan": (jax.jit(chains_one_scan), ([x(B // 4, s) for s in range(4)], ws)),
        })
    print(f"mode {mode}, {jax.devices()[0].device_kind}: us per 30-layer pass")
    for name, us in rows.items():
        print(f"  {name:34s} {us:8.1f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"concurrency_probe_{args.part}_{mode}.json").write_text(json.dumps(
            dict(mode=mode, device=jax.devices()[0].device_kind, batch=B, us=rows), indent=1))


if __name__ == "__main__":
    set_gpu_flags()
    main()
