"""Tasks: what a run trains and evaluates on (``Task``), by name (``make_task``), and the synthetic ones.

* ``Task`` (``qerl_kit.tasks.task``): train/eval rows, reward functions, the prompt function.
* ``make_task(DataConfig)`` / ``TASKS`` / ``register_task`` (``qerl_kit.tasks.registry``).
* ``qerl_kit.tasks.arith``: multi-step arithmetic word problems whose worked solutions end in
  ``#### N`` like GSM8K's, with disjoint train/test splits (the shipped tiny model's task).
"""

from qerl_kit.tasks.arith import LEVELS, careless_solution, make_dataset, make_problem, split_of
from qerl_kit.tasks.registry import TASKS, arith_prompt, make_task, register_task, task_names
from qerl_kit.tasks.task import Task, chat_prompt

__all__ = ["Task", "chat_prompt", "TASKS", "make_task", "register_task", "task_names", "arith_prompt",
           "LEVELS", "careless_solution", "make_dataset", "make_problem", "split_of"]
