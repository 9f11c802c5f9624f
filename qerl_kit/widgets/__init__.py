"""Notebook views: an AQN panel, a training dashboard and rich displays.

A view layer only: the panels observe and poke library objects (an ``AQN``, a ``Trainer``) and
own no training state, so closing a widget loses nothing. Everything degrades to plain printed
output and static figures when ipywidgets is not installed.
"""

from qerl_kit.widgets.aqn_panel import AQNPanel
from qerl_kit.widgets.dashboard import TrainingDashboard
from qerl_kit.widgets.common import HAS_WIDGETS

__all__ = ["AQNPanel", "TrainingDashboard", "HAS_WIDGETS"]
