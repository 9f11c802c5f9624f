"""Synthetic tasks with checkable answers, for demos and tests that must run offline.

``qerl_kit.tasks.arith``: multi-step arithmetic word problems whose worked solutions end in
``#### N`` like GSM8K's, with disjoint train/test splits (the task the shipped tiny model,
``qerl_kit.tiny``, is trained on).
"""

from qerl_kit.tasks.arith import LEVELS, careless_solution, make_dataset, make_problem, split_of

__all__ = ["LEVELS", "careless_solution", "make_dataset", "make_problem", "split_of"]
