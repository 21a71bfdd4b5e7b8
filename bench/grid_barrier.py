"""Can Pallas-Triton programs wait for one another, and at what cost? A grid-wide barrier on the GPU.

    PYTHONPATH=. python3 bench/grid_barrier.py [--programs 33,66,132,264] [--rounds 2000] [--out DIR] [--tiny]

Why: a decode step of a small model is launch-bound (SmolLM2 at batch 1: ~11 kernels a layer of 1-3 us
each against a 0.15 ms step floor; bench/NOTES.md, issue 13). A persistent kernel, one program per
SM looping over a layer's phases (norm + q/k/v, RoPE + attention, o + residual, gate/up, down),
would replace a layer's launches by barriers between its phases, which pays only if a barrier costs
well under a launch. Pallas-Triton has no grid barrier, but it has atomics (acquire-release, GPU
scope) and loops, so a program can count its arrival and spin until every program of the grid has
arrived. That needs all programs resident at once (a grid of at most the SMs times the programs an
SM holds): the probe deadlocks otherwise, so it runs under a timeout and never in interpret mode,
whose programs run one after another (--tiny runs the loop alone, one program: a smoke test of the
script).

Each round, program p writes a value for the round, arrives, waits for all, then reads program
p + 1's value of the round (double-buffered by the round's parity): a stale read counts an error, and
the counter must end at rounds x programs. The time per round against the same loop without the
barrier is the barrier's cost. Writes DIR/grid_barrier.json and prints a table last.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bench import common


def _kernel(counter_in, data_in, counter_ref, data_ref, errors_ref, *, rounds: int, barrier: bool):
    del counter_in, data_in  # aliased with counter_ref and data_ref
    p, programs = pl.program_id(0), pl.num_programs(0)
    neighbour, zero = jnp.where(p + 1 < programs, p + 1, 0), jnp.zeros((), jnp.int32)

    def round_(r, errors):
        parity = r & 1
        data_ref[parity, p] = r * programs + p
        if barrier:
            plgpu.debug_barrier()  # the block's stores before its arrival
            plgpu.atomic_add(counter_ref, zero, jnp.int32(1))
            target = (r + 1) * programs
            lax.while_loop(lambda seen: seen < target, lambda _: plgpu.atomic_add(counter_ref, zero, jnp.int32(0)), jnp.int32(0))
            plgpu.debug_barrier()
        return errors + (data_ref[parity, neighbour] != r * programs + neighbour).astype(jnp.int32)

    errors_ref[p] = lax.fori_loop(0, rounds, round_, jnp.int32(0))


def run(programs: int, rounds: int, barrier: bool, interpret: bool):
    """(counter, data, errors) after one call; a fresh zero counter each call."""
    kernel = functools.partial(_kernel, rounds=rounds, barrier=barrier)
    return pl.pallas_call(
        kernel, grid=(programs,), in_specs=[pl.no_block_spec] * 2, out_specs=[pl.no_block_spec] * 3,
        out_shape=[jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((2, programs), jnp.int32),
                   jax.ShapeDtypeStruct((programs,), jnp.int32)],
        input_output_aliases={0: 0, 1: 1}, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="grid_barrier",
    )(jnp.zeros((1,), jnp.int32), jnp.full((2, programs), -1, jnp.int32))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", default="33,66,132,264")
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tiny", action="store_true", help="one program in interpret mode: a smoke test of this script")
    args = p.parse_args()
    grid = [1] if args.tiny else [int(n) for n in args.programs.split(",")]
    rounds = 8 if args.tiny else args.rounds
    result = common.run_info() | {"rounds": rounds, "rows": []}
    for programs in grid:
        row = {"programs": programs}
        for barrier in (False,) if args.tiny else (False, True):
            f = jax.jit(functools.partial(run, programs, rounds, barrier, args.tiny))
            counter, _, errors = jax.device_get(f())
            name = "barrier" if barrier else "loop"
            row[f"{name}_us_per_round"] = common.seconds_per_call(f) / rounds * 1e6
            if barrier:  # arrivals counted once a program, and no read before its round's write
                row["counter_ok"] = bool(counter[0] == rounds * programs)
                row["stale_reads"] = int(errors.sum())
        row["barrier_us"] = row.get("barrier_us_per_round", float("nan")) - row["loop_us_per_round"]
        result["rows"].append(row)
        print(row, flush=True)
        common.write_json(args.out / "grid_barrier.json", result)
    print(common.markdown_table(result["rows"], [
        ("programs", "programs", "d"), ("loop us/round", "loop_us_per_round", ".3f"),
        ("with barrier us/round", "barrier_us_per_round", ".3f"), ("barrier us", "barrier_us", ".3f"),
        ("counter ok", "counter_ok", ""), ("stale reads", "stale_reads", "d")]))


if __name__ == "__main__":
    main()
