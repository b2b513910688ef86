"""Compares DeepSpeed runs of tests/deepspeed_worker.py (scripts/gpu-check.sh deepspeed): the
per-step losses and the final parameters of each commd run against the reference run of the same
stage, and the median step times; one JSON line per comparison, appended to --json.

    python3 tests/gpu/deepspeed_compare.py --json OUT.jsonl [--control CTL.json] REF.json RUN.json...

On more than 2 ranks a sum's order differs between algorithms, so two correct backends drift
apart in the last bits, and AdamW (which divides by the gradients' RMS) carries that drift into the
parameters. --control names a run of the reference backend with another reduction order (e.g.
NCCL with another channel count): a run passes when it is within --rtol or within --factor times
the control's own distance from the reference, whichever is larger. --control may be given more
than once (the largest distance counts); a control at distance 0 summed in the reference's own
order after all (on 4 GPUs NCCL's reduce-scatter adds each element in ring order whatever the
channel count, so ZeRO-3's control came out bit-identical) and is set aside, said in the output.
The reference backend's run of another ZeRO stage is such a control: stages 2 and 3 compute the
same training with other collectives (all-reduce against reduce-scatter and all-gather).
"""

import argparse
import json
import sys

import torch


def params(run):
    if run.get("params_file"):
        return torch.load(run["params_file"])
    return torch.tensor(run["params"], dtype=torch.float64)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--control", action="append", default=[])
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("ref")
    p.add_argument("runs", nargs="+")
    a = p.parse_args()
    ref = json.load(open(a.ref))
    rp = params(ref).double()
    scale = rp.abs().max().item()

    def dist(run):
        dl = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(run["losses"], ref["losses"]))
        return dl, (params(run).double() - rp).abs().max().item()

    tl, tp = a.rtol, a.rtol * scale
    ctl = []
    for path in a.control:
        cl, cp = dist(json.load(open(path)))
        same = cl == 0.0 and cp == 0.0
        ctl.append({"file": path.rsplit("/", 1)[-1], "loss_max_rel_diff": cl,
                    "param_max_abs_diff": cp, "same_order_as_ref": same})
        if not same:
            tl, tp = max(tl, a.factor * cl), max(tp, a.factor * cp)
    bad = False
    for path in a.runs:
        run = json.load(open(path))
        dl, dp = dist(run)
        row = {"stage": run["stage"], "world": run["world"], "numel": run["numel"],
               "ref": ref["backend"], "run": run["backend"],
               "file": path.rsplit("/", 1)[-1], "controls": ctl,
               "tolerance": {"loss_rel": tl, "param_abs": tp},
               "ref_step_ms": round(ref["step_ms"], 2), "run_step_ms": round(run["step_ms"], 2),
               "loss_max_rel_diff": dl, "param_max_abs_diff": dp, "param_max_abs": scale,
               "final_loss_ref": ref["losses"][-1], "final_loss_run": run["losses"][-1]}
        ok = len(run["losses"]) == len(ref["losses"]) and dl <= tl and dp <= tp
        row["ok"] = ok
        bad |= not ok
        print(json.dumps(row))
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
