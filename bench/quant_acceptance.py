"""How far quantized drafts move SmolLM2: one-token acceptance of int8 and int4 draft weights.

    PYTHONPATH=. python3 bench/quant_acceptance.py [--windows 2] [--tokens 512] [--groups 128,64,32]

Teacher-forced on held-out local text (jaxspec.training.data.heldout_windows), float32 on any
device: for each draft-weight kind (int4 at each group size), the exact rejection-sampling
acceptance of one token at temperature 1, mean over positions of sum_v min(p_v, q_v), the greedy
agreement of the argmaxes, and the copies' bytes. Writes bench/results/quant_acceptance_<device>.json.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench import common
from jaxspec.loaders import load_model
from jaxspec.models import decoder, draft_weights, quantize
from jaxspec.training.data import heldout_windows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--groups", default="128,64,32", help="int4 group sizes (rows of K per scale)")
    args = p.parse_args()
    cfg, params, tokenizer = load_model("smollm2", dtype="float32")
    tokens = jnp.asarray(heldout_windows(tokenizer, args.tokens, args.windows))
    target = jax.nn.softmax(decoder.score(params, cfg, tokens), -1)
    result = {**common.run_info(), "tokens": list(tokens.shape), "rows": []}
    for kind, group in [("int8", None)] + [("int4", int(g)) for g in args.groups.split(",")]:
        if group:  # int4_group takes the first of (GROUP, 64, 32) that divides K
            quantize.GROUP = group
            jax.clear_caches()  # the jitted quantizer was traced with the previous group
        copies = draft_weights.with_draft_weights(params, kind)
        draft, _ = draft_weights.draft_params(copies, kind, (), "reference")
        q = jax.nn.softmax(decoder.score(draft, cfg, tokens), -1)
        row = {"kind": kind, "group": group, "acceptance_T1": float(jnp.mean(jnp.sum(jnp.minimum(target, q), -1))),
               "greedy_agreement": float(jnp.mean(jnp.argmax(q, -1) == jnp.argmax(target, -1))),
               "draft_bytes": draft_weights.draft_bytes(copies)}
        result["rows"].append(row)
        print(row, flush=True)
    device = jax.devices()[0].device_kind.replace(" ", "_")
    common.write_json(common.RESULTS / f"quant_acceptance_{device}.json", result)


if __name__ == "__main__":
    main()
