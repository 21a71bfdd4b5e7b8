"""How few instructions a weight an MXFP4 decode in registers can take, by counting, not timing.

A one-row experts kernel multiplies each weight by x with one float32 multiply-add, so its decode must
first put the weight's e2m1 code s e1 e0 m where a float32 holds it: e1 e0 m at bits 22-24, s at bit 31
(2^-126 times its value; the group's power of two and the 2^126 can be applied once per group). With a
packing of our choosing, the cheapest placement is one funnel shift (SHF: a rotation of one word, or a
shift across two) and one mask (LOP3), 2 instructions a weight before the multiply-add. This script asks
whether any packing of 8 codes a word lets every code be placed that way: an exact cover of the words'
bits by the bit sets those placements read (each code's 4 bits at residues r, r+1, r+2, r+9 mod 32 of the
words it reads). It also gives the most codes of one word that one rotation each places, and the same for
the bf16x2 placement of two codes at once that `pallas_kernels.mxfp4.pack_words` uses (its WORD_MAGNITUDE
and WORD_SIGN masks; the float32 placement is their high half).

    PYTHONPATH=. python3 bench/mxfp4_placement.py --out bench/results
"""
import argparse
import datetime
import json
import sys

from pallas_kernels.mxfp4 import WORD_MAGNITUDE, WORD_SIGN

BF16X2_MASK = WORD_MAGNITUDE | WORD_SIGN  # two codes placed as a bf16x2 word
F32_MASK = BF16X2_MASK & 0xFFFF0000  # e1 e0 m, s of one code placed as float32 bits


def bits_of(mask: int) -> list[int]:
    """The set bits of `mask`, lowest first."""
    return [b for b in range(mask.bit_length()) if mask >> b & 1]


def placements(words: int, mask: int) -> list[int]:
    """The source bits (as masks over `words` words, bit 32 w + i) that one funnel shift of any ordered pair
    of the words (a rotation where the pair is one word) followed by `mask` reads, lowest source first."""
    out = set()
    for lo in range(words):
        for hi in range(words):
            for n in range(32):
                source = {32 * lo + k + n if k + n < 32 else 32 * hi + k + n - 32 for k in bits_of(mask)}
                if len(source) == mask.bit_count():
                    out.add(sum(1 << b for b in source))
    return sorted(out, key=lambda m: (m & -m, m))


def exact_cover(words: int, mask: int) -> bool:
    """Whether a packing places every code (or code pair) by one shift and `mask`: disjoint placements
    covering all 32 `words` bits (exhaustive search)."""
    full = (1 << 32 * words) - 1
    options = placements(words, mask)

    def search(covered: int) -> bool:
        if covered == full:
            return True
        first = ~covered & (covered + 1)  # the lowest bit not yet covered
        return any(search(covered | p) for p in options if p & first and not p & covered)

    return search(0)


def most_placed(mask: int) -> list[int]:
    """The most disjoint one-rotation placements in one word: the lowest source bit of each, of a largest
    such set."""
    sets = placements(1, mask)
    best: list = []

    def search(covered: int, start: int, chosen: list):
        nonlocal best
        if len(chosen) > len(best):
            best = chosen
        for i in range(start, len(sets)):
            if not sets[i] & covered:
                search(covered | sets[i], i + 1, chosen + [bits_of(sets[i])[0]])

    search(0, 0, [])
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words", type=int, default=4, help="largest packing unit searched (words)")
    parser.add_argument("--out", help="folder for mxfp4_placement_cpu.json")
    args = parser.parse_args(argv)
    rows = []
    for name, mask in (("float32 (one code)", F32_MASK), ("bf16x2 (two codes)", BF16X2_MASK)):
        placed = most_placed(mask)
        covers = {w: exact_cover(w, mask) for w in range(1, args.words + 1)}
        rows.append(dict(placement=name, mask_bits=bits_of(mask), outputs_a_word=32 // mask.bit_count(),
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
