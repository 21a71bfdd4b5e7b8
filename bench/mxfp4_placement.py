"""How few instructions a weight an MXFP4 decode in registers can take, by counting, not timing.

A one-row experts kernel multiplies each weight by x with one float32 multiply-add, so its decode must
first put the weight's e2m1 code s e1 e0 m where a float32 holds it: e1 e0 m at bits 22-24, s at bit 31
(2^-126 times its value; the group's power of two and the 2^126 can be applied once per group). With a
packing of our choosing, the cheapest placement is one funnel shift (SHF: a rotation of one word, or a
shift across two) and one mask (LOP3), 2 instructions a weight before the multiply-add. This script asks
whether any packing of 8 codes a word lets every code be placed that way: an exact cover of the words'
bits by the bit sets those placements read (each code's 4 bits at residues r, r+1, r+2, r+9 mod 32 of the
words it reads). It also gives the most codes of one word that one rotation each places, and the same for
the bf16x2 placement of two codes at once (mask 0x81C081C0) that `pallas_kernels.mxfp4.pack_words` uses.

    PYTHONPATH=. python3 bench/mxfp4_placement.py --out bench/results
"""
import argparse
import datetime
import json
import sys

F32_BITS = (22, 23, 24, 31)  # e1 e0 m, s of a code placed as float32 bits
BF16X2_BITS = (6, 7, 8, 15, 22, 23, 24, 31)  # two codes placed as a bf16x2 word


def placements(words: int, bits) -> list[frozenset]:
    """The source bit sets (over `words` words, bit 32 w + i) one funnel shift of any ordered pair of the
    words (a rotation where the pair is one word) followed by a mask reads to fill `bits`."""
    out = set()
    for lo in range(words):
        for hi in range(words):
            for n in range(32):
                source = frozenset(32 * lo + k + n if k + n < 32 else 32 * hi + k + n - 32 for k in bits)
                if len(source) == len(bits):
                    out.add(source)
    return sorted(out, key=sorted)


def exact_cover(words: int, bits) -> list | None:
    """A packing in which every code (or code pair) is placed by one shift and a mask: disjoint
    placements covering all 32 `words` bits, or None where there is none (exhaustive search)."""
    total = 32 * words
    by_bit = {b: [p for p in placements(words, bits) if b in p] for b in range(total)}

    def search(covered: int, chosen: list):
        if covered == (1 << total) - 1:
            return chosen
        first = next(b for b in range(total) if not covered >> b & 1)
        for p in by_bit[first]:
            if not any(covered >> b & 1 for b in p):
                found = search(covered | sum(1 << b for b in p), chosen + [sorted(p)])
                if found:
                    return found
        return None

    return search(0, [])


def most_placed(bits) -> list[int]:
    """The most disjoint one-rotation placements in one word: the rotations of a largest such set."""
    sets = placements(1, bits)
    best: list = []

    def search(covered: int, start: int, chosen: list):
        nonlocal best
        if len(chosen) > len(best):
            best = chosen
        for i in range(start, len(sets)):
            if not any(covered >> b & 1 for b in sets[i]):
                search(covered | sum(1 << b for b in sets[i]), i + 1, chosen + [min(sets[i])])

    search(0, 0, [])
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words", type=int, default=3, help="largest packing unit searched (words)")
    parser.add_argument("--out", help="folder for mxfp4_placement_cpu.json")
    args = parser.parse_args(argv)
    rows = []
    for name, bits in (("float32 (one code)", F32_BITS), ("bf16x2 (two codes)", BF16X2_BITS)):
        per_word = 32 // len(bits)
        placed = most_placed(bits)
        covers = {w: exact_cover(w, bits) is not None for w in range(1, args.words + 1)}
        rows.append(dict(placement=name, mask_bits=list(bits), outputs_a_word=per_word,
                         most_placed_by_one_rotation=len(placed), their_lowest_bits=placed,
                         exact_cover_by_words={str(w): c for w, c in covers.items()}))
    print("| placement | outputs a word | placed by one rotation each (most) | every output by one shift, 1.."
          f"{args.words} words |")
    print("|---|---|---|---|")
    for r in rows:
        covers = ", ".join(f"{w}: {'yes' if c else 'no'}" for w, c in r["exact_cover_by_words"].items())
        print(f"| {r['placement']} | {r['outputs_a_word']} | {r['most_placed_by_one_rotation']} | {covers} |")
    if args.out:
        with open(f"{args.out}/mxfp4_placement_cpu.json", "w") as f:
            json.dump(dict(command="PYTHONPATH=. python3 bench/mxfp4_placement.py " + " ".join(argv or sys.argv[1:]),
                           device="cpu (a count: no timing)",
                           date=datetime.date.today().isoformat(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
