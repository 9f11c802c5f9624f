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


DASHBOARD_METRICS = ("reward", "accuracy", "entropy", "completions/mean_length", "aqn/sigma", "rollout/temperature")
# The numeric metrics a Trainer step logs (qerl_kit.trainer, grpo.clip_stats), whatever the config: the
# names a dashboard panel may show. Families whose names depend on the run (one reward function's mean,
# importance-sampling and dynamic-sampling stats, vLLM sync timings) are matched by prefix, "rewards/*".
TRAINER_METRICS = ("step", "reward", "accuracy", "entropy", "loss", "grad_norm", "lr", "kl", "reward_std",
                   "frac_reward_zero_std", "num_tokens", "completions/mean_length", "completions/clipped_ratio",
                   "rollout/temperature", "rollout/tokens_per_s", "update/skipped", "aqn/sigma", "aqn/stage",
                   "aqn/norms", "eval/accuracy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                   "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
                   "rewards/*", "sampling/*", "time/*", "memory/*")
_CONTROLS = ("aqn/sigma", "rollout/temperature", "lr")  # set, not measured: drawn without a moving mean


def plot_dashboard(history: Sequence[dict], metrics: Sequence[str] = DASHBOARD_METRICS, *,
                   chunk_starts: Sequence[int] = (), width_in: float = 10.0, ncols: int = 3,
                   smooth: int = 5, title: str | None = None):
    """The training dashboard's figure: one panel per metric in rows of ``ncols`` (default 2 x 3,
    ``width_in`` inches wide: 900 px at the widgets' 90 dpi), integer step ticks, a moving mean of
    the last ``smooth`` steps (in the legend) and a dotted line before each step in ``chunk_starts``
    (the first step of a chunk; step 1 is no boundary). A metric absent from ``history`` gets an
    empty panel that says so, so the layout does not depend on what was logged."""
    import pandas as pd
    from matplotlib.ticker import MaxNLocator

    if ncols < 1:
        raise ValueError(f"ncols must be >= 1; got {ncols}")
    plt = _plt()
    df = pd.DataFrame(list(history))
    metrics = list(metrics)
    nrows = max(1, -(-len(metrics) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width_in, 2.6 * nrows), squeeze=False)
    boundaries = sorted({int(s) for s in chunk_starts if s > 1})
    for i, ax in enumerate(axes.flat):
        if i >= len(metrics):
            ax.set_visible(False)
            continue
        m = metrics[i]
        ax.set_title(m, fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if m not in df.columns or df[m].isna().all():
            ax.text(0.5, 0.5, f"{m}\nnot logged", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        ax.plot(df["step"], df[m], marker="o", markersize=3, linewidth=1.2, color="tab:blue", label="per step")
        if smooth > 1 and len(df) >= smooth and m not in _CONTROLS:  # a control's mean says nothing
            ax.plot(df["step"], df[m].rolling(smooth, min_periods=1).mean(), color="black", alpha=0.5,
                    linewidth=1, label=f"mean of last {smooth}")
        for j, b in enumerate(boundaries):
            ax.axvline(b - 0.5, color="tab:red", linestyle=":", linewidth=1, label="chunk start" if j == 0 else None)
        if m == "aqn/sigma" and (df[m] > 0).any():
            ax.set_yscale("symlog", linthresh=float(df[m][df[m] > 0].min()) / 2)
        ax.tick_params(labelsize=8)
        ax.set_xlabel("step", fontsize=8)
    first = next((ax for ax in axes.flat if ax.get_visible() and ax.get_legend_handles_labels()[0]), None)
    if first is not None:
        first.legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
