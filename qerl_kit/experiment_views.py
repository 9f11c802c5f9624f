"""Tables and figures of a grid's results (``qerl_kit.experiments``): the per-configuration summary
table (a DataFrame, or Markdown), curves against step with bands over seeds, and per-seed dots.
They read the DataFrames ``run_grid`` returns or the CSVs it writes, and never train anything.
"""

from __future__ import annotations

import math
from typing import Sequence


def _order(frame) -> list[str]:
    return list(dict.fromkeys(frame["label"]))


def summary_table(summary):
    """Per configuration: seeds, lr, initial entropy, base and final held-out accuracy, mean reward
    (the area under the reward curve, a measure of how fast reward grew), as mean and sd over seeds."""
    import pandas as pd

    if len(summary) == 0:
        raise ValueError("summary is empty: nothing to tabulate")
    cols = ("initial_entropy", "mean_entropy", "initial_rollout_nll", "base_accuracy", "final_accuracy",
            "mean_reward", "final_reward")
    rows = []
    for label in _order(summary):
        g = summary[summary["label"] == label]
        row = {"configuration": label, "seeds": len(g), "lr": g["lr"].iloc[0]}
        for c in cols:
            row[c] = g[c].mean()
            row[c + "_sd"] = g[c].std(ddof=1) if len(g) > 1 else float("nan")
        row["minutes_per_run"] = g["wall_seconds"].mean() / 60
        rows.append(row)
    return pd.DataFrame(rows).set_index("configuration")


def markdown_table(table) -> str:
    """``summary_table`` as a Markdown table, ``mean ± sd`` per cell."""
    heads = {"initial_entropy": "initial entropy", "initial_rollout_nll": "initial rollout NLL",
             "mean_entropy": "mean entropy", "base_accuracy": "base held-out acc.",
             "final_accuracy": "final held-out acc.", "mean_reward": "mean reward (all steps)",
             "final_reward": "reward, last 5 steps"}
    lines = ["| configuration | seeds | lr | " + " | ".join(heads.values()) + " | min/run |",
             "|---" * (len(heads) + 4) + "|"]
    for label, r in table.iterrows():
        d = {c: 4 if "entropy" in c or "nll" in c else 3 for c in heads}  # digits
        cells = [f"{r[c]:.{d[c]}f}" + ("" if math.isnan(r[c + "_sd"]) else f" ± {r[c + '_sd']:.{d[c]}f}")
                 for c in heads]
        lines.append(f"| {label} | {int(r['seeds'])} | {r['lr']:g} | {' | '.join(cells)} | "
                     f"{r['minutes_per_run']:.1f} |")
    return "\n".join(lines)


def plot_curves(metrics, y: Sequence[str] = ("reward", "entropy"), *, errorbar=("ci", 95), smooth: int = 1,
                title: str | None = None):
    """One panel per metric against step, a line per configuration and a band over seeds
    (``errorbar``: seaborn's, e.g. ("ci", 95) or "sd"); ``smooth`` > 1 averages each run over a
    trailing window of that many steps before the bands are computed. A sparse metric (recorded at
    some steps only, such as ``eval/accuracy``) is drawn at its own steps, with markers, never smoothed."""
    import seaborn as sns

    from qerl_kit.plots import _plt

    missing = [m for m in y if m not in metrics.columns]
    if missing or len(metrics) == 0:
        raise ValueError(f"metrics has no rows or lacks {missing}; columns: {list(metrics.columns)}")
    plt, df = _plt(), metrics.copy()
    sparse = {m for m in y if df[m].isna().any()}
    if smooth > 1:
        for m in set(y) - sparse:
            df[m] = df.groupby(["config", "seed"])[m].transform(lambda s: s.rolling(smooth, min_periods=1).mean())
    order = _order(df)
    dashes = {label: (4, 2) if "AQN" in label else "" for label in order}  # AQN runs dashed: they can overlap
    sns.set_theme(style="whitegrid")
    fig, axes = plt.subplots(1, len(y), figsize=((5.2 if len(y) <= 3 else 4.4) * len(y), 3.8), squeeze=False)
    for ax, m in zip(axes[0], y):
        # seed=0: the same bootstrap bands on every call
        sns.lineplot(data=df.dropna(subset=[m]), x="step", y=m, hue="label", hue_order=order, style="label",
                     style_order=order, dashes=dashes, errorbar=errorbar, seed=0, ax=ax, linewidth=1.4,
                     marker="o" if m in sparse else None, markersize=4)
        ax.set_title(m + (f" ({smooth}-step mean)" if smooth > 1 and m not in sparse else ""))
        ax.set_ylabel("")
        ax.get_legend().remove()
    axes[0][-1].legend(*axes[0][-1].get_legend_handles_labels(), fontsize=8, loc="upper left",
                       bbox_to_anchor=(1.02, 1.0), frameon=False)
    seeds = df.groupby("label")["seed"].nunique().min()
    band = errorbar if isinstance(errorbar, str) else f"{errorbar[0]} {errorbar[1]}"
    fig.suptitle(title or f"mean over {seeds} seed(s), band: {band}")
    fig.tight_layout()
    return fig


def curve_metrics(metrics) -> tuple[str, ...]:
    """The panels of the command line's smoothed figure: reward, entropy, rollout NLL, completion
    length, and held-out accuracy where the grid recorded it during training (``eval_every``)."""
    extra = ("completions/mean_length",) if "completions/mean_length" in metrics.columns else ()
    if "eval/accuracy" in metrics.columns and metrics["eval/accuracy"].notna().any():
        extra += ("eval/accuracy",)
    return ("reward", "entropy", "rollout_nll") + extra


def plot_summary(summary, y: Sequence[str] = ("initial_entropy", "final_accuracy", "mean_reward")):
    """Per configuration, one dot per seed and the mean: initial entropy, final accuracy, mean reward."""
    import seaborn as sns

    from qerl_kit.plots import _plt

    if len(summary) == 0:
        raise ValueError("summary is empty: nothing to plot")
    sns.set_theme(style="whitegrid")
    fig, axes = _plt().subplots(1, len(y), figsize=(4.6 * len(y), 3.8), squeeze=False)
    order = _order(summary)
    for ax, m in zip(axes[0], y):
        sns.stripplot(data=summary, x=m, y="label", order=order, ax=ax, color="gray", size=5, jitter=False)
        sns.pointplot(data=summary, x=m, y="label", order=order, ax=ax, errorbar=None, linestyle="none",
                      marker="D", color="tab:red")
        ax.set(title=m, xlabel="", ylabel="")
    fig.tight_layout()
    return fig
