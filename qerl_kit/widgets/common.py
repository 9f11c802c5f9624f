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


WIDGET_DPI = 90  # every widget figure is rendered at this dpi: its pixel width is 90 x its width in inches


def figure_png(fig, dpi: int = WIDGET_DPI) -> bytes:
    """A matplotlib figure as PNG bytes (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return _palette_png(buf.getvalue())


def _palette_png(png: bytes, colors: int = 64) -> bytes:
    """The PNG re-encoded with a 64-colour palette: a line plot looks the same at a third of the size,
    which keeps a saved notebook's widget state (every widget image is stored in it) small."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow comes with matplotlib
        return png
    out = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=colors).save(out, format="PNG", optimize=True)
    return out.getvalue()


def figure_html(fig, dpi: int = WIDGET_DPI) -> str:
    """An ``<img>`` that shrinks to the output area's width (never clipped, never scrolled)."""
    data = base64.b64encode(figure_png(fig, dpi)).decode()
    return f'<img class="qerl-plot" style="max-width:100%;height:auto" src="data:image/png;base64,{data}"/>'


def show(obj) -> None:
    """IPython display when available, else print."""
    try:
        from IPython.display import display

        display(obj)
    except ImportError:  # pragma: no cover
        print(obj)
