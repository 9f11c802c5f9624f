"""Seaborn plots of a run and of the AQN schedule; plain functions that return a matplotlib Figure.

Used by the demo (saved as PNG), the notebooks and the widgets, so every view draws the same
picture. matplotlib's non-interactive Agg backend is used when no display is attached.
"""

from __future__ import annotations

from typing import Sequence

DEFAULT_METRICS = ("reward", "accuracy", "entropy", "completions/mean_length", "clip_ratio/region_mean")


def _plt():
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg",) and not _in_notebook():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except Exception:
        return False


def plot_metrics(history: Sequence[dict], metrics: Sequence[str] = DEFAULT_METRICS, *, title: str | None = None,
                 reference: dict[str, float] | None = None):
    """One panel per metric against step; ``reference`` draws dashed horizontal lines (e.g. the
    base model's held-out accuracy)."""
    import pandas as pd
    import seaborn as sns

    plt = _plt()
    df = pd.DataFrame(list(history))
    metrics = [m for m in metrics if m in df.columns]
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(3.6 * max(len(metrics), 1), 3.0), squeeze=False)
    sns.set_theme(style="whitegrid")
    for ax, m in zip(axes[0], metrics):
        sns.lineplot(data=df, x="step", y=m, ax=ax, marker="o", markersize=3)
        if len(df) >= 5:
            smooth = df[m].rolling(5, min_periods=1).mean()
            ax.plot(df["step"], smooth, color="black", alpha=0.5, linewidth=1)
        for name, value in (reference or {}).items():
            if name == m:
                ax.axhline(value, linestyle="--", color="gray")
        ax.set_title(m)
        ax.set_ylabel("")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_schedule(aqn, ax=None, step: int | None = None):
    """The AQN sigma against step (a staircase), with an optional marker at ``step``."""
    plt = _plt()
    if ax is None:
        fig, ax = plt.subplots(figsize=(5, 3))
    else:
        fig = ax.figure
    steps = list(range(aqn.total_steps))
    ax.step(steps, [aqn.sigma(s) for s in steps], where="post", color="tab:blue")
    ax.set_yscale("symlog", linthresh=min(aqn.sigma_start, aqn.sigma_end) / 2)
    ax.set_xlabel("step")
    ax.set_ylabel("AQN sigma")
    ax.set_title(f"AQN: {aqn.stages} stages, {aqn.sigma_start:.1e} -> {aqn.sigma_end:.1e}")
    if step is not None:
        ax.axvline(step, color="tab:red", linestyle=":")
    fig.tight_layout()
    return fig
