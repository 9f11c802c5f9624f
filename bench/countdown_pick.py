"""The choices the Countdown device runs make, as plain functions (``bench/device.sh`` calls them).

    python -m bench.countdown_pick calibration OUT   # which of /tmp/cd/m* calibrations to keep
    python -m bench.countdown_pick lr                # the lr from the sweep under /tmp/cdsweep

``calibration``: greedy NVFP4 accuracy inside 10-40% and the largest pass@8 - greedy gap wins,
otherwise the one nearest to 25%; the reports go to OUT/cd/reports.json and the choice to
/tmp/cd/chosen_path, its model archived in 15 MB pieces. ``lr``: NVFP4-LoRA's held-out accuracy
averaged over its evaluations after the start (rewarding early learning that stays), mean over
seeds; ties go to the smaller lr; the choice goes to /tmp/cd/best_lr.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CD = Path("/tmp/cd")


def score(report: dict) -> tuple:
    """Sort key of one calibration report: in band first, then the sampling gap (or nearness to 25%)."""
    g = report["calibration"]["greedy_nvfp4"]["accuracy"]
    p = report["calibration"]["sampled_t1_nvfp4"]["pass_at_k"]
    in_band = 0.10 <= g <= 0.40
    return (in_band, p - g if in_band else -abs(g - 0.25))


def calibration(out: Path) -> None:
    out = out / "cd"
    rep = {}
    for d in sorted(CD.glob("m*")):
        f = d / "train_report.json"
        if f.exists():
            rep[d.name] = r = json.loads(f.read_text())
            c = r["calibration"]
            print(d.name, "steps", r["steps"], "s", r["seconds"],
                  {k: (round(v["accuracy"], 3), round(v["pass_at_k"], 3)) for k, v in c.items()})
    (out / "reports.json").write_text(json.dumps(rep, indent=1, default=str))
    if rep:
        best = max(rep, key=lambda k: score(rep[k]))
        print("chosen", best)
        (CD / "chosen_path").write_text(f"/tmp/cd/{best}")
        subprocess.run(f"tar -C /tmp/cd -cf /tmp/cd/model.tar {best} && "
                       f"split -b 15m /tmp/cd/model.tar {out}/model.tar.part_", shell=True, check=True)


def lr(root: Path = Path("/tmp/cdsweep")) -> None:
    import pandas as pd

    s = pd.concat([pd.read_csv(f) for f in sorted(root.glob("lr*/*/summary.csv"))])
    m = pd.concat([pd.read_csv(f) for f in sorted(root.glob("lr*/*/metrics.csv"))])
    ev = m.dropna(subset=["eval/accuracy"])
    auc = ev[ev.config == "nvfp4-lora"].groupby(["lr", "seed"])["eval/accuracy"].mean().groupby("lr").mean()
    print(s.groupby(["config", "lr"])[["base_accuracy", "final_accuracy", "mean_reward", "final_reward",
                                       "mean_entropy"]].mean().round(3).to_string())
    print("NVFP4 held-out accuracy, mean over evaluations:", auc.round(4).to_dict())
    best = auc[auc == auc.max()].index.min()
    print("best lr", best)
    (CD / "best_lr").write_text(f"{best:g}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "calibration" and len(sys.argv) == 3:
        calibration(Path(sys.argv[2]))
    elif what == "lr":
        lr()
    else:
        sys.exit("usage: python -m bench.countdown_pick calibration OUT | lr")
