"""
The closing table of reduce_every and reshard_after_forward: per stage and mode at grad_accum=4
on 4 thread ranks (test_bytes.run_modes, the fixed model of test_equivalence.py), the bytes a
rank sent in a step and memory(), each against its formula, and the bits against stage 0's in
the same reduction. Run from the repository root: PYTHONPATH=$PWD python tests/bytes_table.py
"""
import torch

from minizero_lib import launch
from test_bytes import MODES, N, K, run_modes


def main():
    ranks = launch.run_threads(run_modes, N)
    print(f"{N} ranks, grad_accum={K}, fp32, {sum(ranks[0][MODES[0]]['padded'])} parameters "
          f"(padded); bytes per step (the formula's kinds) and memory per rank, measured: "
          f"= formula on every rank")
    head = ("stage", "reduce_every", "reshard", "sent/step", "=", "rs / ag / hpz", "memory", "=",
            "bits = stage 0")
    rows = [head]
    for mode in MODES:
        stage, every, rf = mode
        sent_ok = all(r[mode]["sent"] == r[mode]["sent_formula"] for r in ranks)
        mem_ok = all(m == r[mode]["memory_formula"] for r in ranks for m in r[mode]["memory"])
        ref = [r[0, every, True]["state"] for r in ranks]
        same = all(torch.equal(r[mode]["state"][k], s[k]) for r, s in zip(ranks, ref) for k in s)
        sent, mem = ranks[0][mode]["sent"], ranks[0][mode]["memory_formula"]
        kinds = " / ".join(str(sent.get(k, 0))
                           for k in ("reduce_scatter", "all_gather", "hpz_gather"))
        rows.append((str(stage), every, str(rf) if stage == 3 else "-", str(sum(sent.values())),
                     "yes" if sent_ok else "NO", kinds, str(sum(mem.values())),
                     "yes" if mem_ok else "NO", "yes" if same else "NO"))
    widths = [2 + max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    main()
