"""Shared bits of the widgets: availability flag, figure-to-widget rendering, display fallback."""

from __future__ import annotations

import base64
import io

try:  # ipywidgets is optional: qerl_kit[notebook]
    import ipywidgets as W

    HAS_WIDGETS = True
except ImportError:  # pragma: no cover - exercised by a test that hides the module
    W = None
    HAS_WIDGETS = False


def figure_png(fig) -> bytes:
    """A matplotlib figure as PNG bytes (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def figure_html(fig) -> str:
    data = base64.b64encode(figure_png(fig)).decode()
    return f'<img class="qerl-plot" src="data:image/png;base64,{data}"/>'


def show(obj) -> None:
    """IPython display when available, else print."""
    try:
        from IPython.display import display

        display(obj)
    except ImportError:  # pragma: no cover
        print(obj)
