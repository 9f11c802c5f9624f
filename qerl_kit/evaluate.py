"""Evaluate a policy on a task: pass@1 and pass@k, a function over a ``Task``.

``evaluate_task(task, model, tokenizer, samples=4)`` evaluates on the task's held-out rows (or
``rows=``): the task renders and tokenizes each chunk of prompts once (``task.encode``), a rollout
engine (``HFEngine`` by default) samples ``samples`` completions per problem, the task's accuracy
reward scores them, and it returns an ``EvalResult``: accuracy (mean pass@1), per-problem
completions and scores, mean completion length. It prints a summary in a terminal and renders a
table in a notebook. ``evaluate(model, tokenizer, rows, reward_fn)`` is the same on plain rows and
one reward function (a ``Task`` is made of them, prompts rendered by ``prompt_fn``, by default
``qerl_kit.data.chat_prompt``).

* The model is evaluated as given: a peft ``PeftModel`` is evaluated **with its adapter**. (The
  official QeRL evaluation loaded the base weights and forgot the LoRA adapter, so it measured the
  base model; ``tests/test_evaluate.py`` pins that an adapter changes the result.)
* Scoring is training's (``qerl_kit.scoring``): the reward function gets the same keyword
  arguments (``reward_kwargs``: ``prompts`` is the rows' raw ``prompt`` column, the question, as in
  training and TRL; ``completions``, ``completion_ids`` and every other column aligned with them),
  is called and checked the same way (``reward_scores``: a dict, None, strings, NaN, inf or the
  wrong number of scores is an error naming the function; an exception comes back as a
  ``RewardError`` naming it), and correct means what the training ``accuracy`` metric counts
  (``is_correct``: reward >= 1.0; None is incorrect). pass@1 of a problem is its fraction of correct
  samples; ``accuracy`` is the mean over problems.
* Greedy (``temperature=0``) samples once per problem: the samples would all be the same.
* Problems are sent to the engine ``batch_size`` at a time (each becomes ``batch_size * samples``
  sequences); chunk i is seeded with ``seed + i``. The default (None) sends ``EVAL_ROWS // samples``
  problems per call to an engine that batches rows itself and drops finished ones (``batches_rows``:
  the StaticEngine, vLLM; all 1319 GSM8K test problems in one call when greedy), and ``HF_BATCH``
  at a time to transformers' generate.
* ``pass_at_k`` is the share of problems with a correct sample among the ``samples``; ``by(column)``
  splits accuracy and pass@k by a dataset column (the arithmetic task's ``level``; a column no row has
  is an error listing the columns).
* The rows are checked as a ``Task``'s (``qerl_kit.data.check_rows``: a list of rows, each
  ``prompt`` a non-empty string), ``seed`` and ``temperature`` by the shared rules, before anything runs.
"""

from __future__ import annotations

import html
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from qerl_kit.config_types import check_names, check_seed, check_temperature, check_value, short_repr
from qerl_kit.data import chat_prompt, check_rows
from qerl_kit.rollout.base import RolloutEngine, check_engine
from qerl_kit.rollout.types import SamplingParams
from qerl_kit.scoring import CORRECT_THRESHOLD, accuracy_scores, is_correct, reward_kwargs
from qerl_kit.table import html_table, text_table
from qerl_kit.tasks.task import Task

__all__ = ["evaluate", "evaluate_task", "EvalResult", "CORRECT_THRESHOLD"]
HF_BATCH = 32  # problems per call for an engine without its own row batching (transformers' generate pads them all)
# rows (problems x samples) per call for the StaticEngine / vLLM: every GSM8K test problem greedily in one
# call; 8 samples of all 1319 (10,552 rows) in one call ran out of an H200's memory (a 0.5B model's
# CUDA-graph pools alone took 63 GiB: each live-row count captures its own graphs)
EVAL_ROWS = 2048


def _short(text: Any, limit: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class EvalResult:
    accuracy: float                 # mean over problems of pass@1 (fraction of correct samples)
    per_problem: list[dict]         # index, prompt, answer, completions, scores, lengths, pass_rate
    samples: int                    # completions per problem
    mean_length: float              # mean completion length in tokens (stop token included)
    temperature: float = 0.0
    stats: dict = field(default_factory=dict)  # rollout/* timing summed over chunks

    @property
    def num_problems(self) -> int:
        return len(self.per_problem)

    @property
    def pass_at_k(self) -> float:
        """Share of problems with at least one correct sample (k = ``samples``)."""
        return sum(p["pass_rate"] > 0 for p in self.per_problem) / len(self.per_problem)

    def by(self, column: str) -> dict:
        """Accuracy, pass@k and count per value of a dataset column (``result.by("level")``). A column
        no row has (a typo: ``"levle"``) is an error listing the columns, not one group ``None``."""
        if not isinstance(column, str):
            raise TypeError(f"by(column): column must be one column name (a string); got {short_repr(column)}")
        columns = list(dict.fromkeys(k for p in self.per_problem for k in p["columns"]))
        if not columns:
            raise ValueError(f"by({short_repr(column)}): the rows have no column to split by besides "
                             "'prompt' and 'answer'")
        check_names("by(column)", column, columns, what="column")
        groups: dict = {}
        for p in self.per_problem:
            groups.setdefault(p["columns"].get(column), []).append(p)
        return {key: {"accuracy": sum(p["pass_rate"] for p in ps) / len(ps),
                      "pass_at_k": sum(p["pass_rate"] > 0 for p in ps) / len(ps), "n": len(ps)}
                for key, ps in sorted(groups.items(), key=lambda kv: (kv[0] is None, str(kv[0])))}

    def summary(self) -> str:
        mode = "greedy" if self.temperature == 0 else f"temperature {self.temperature:g}"
        return (f"accuracy {self.accuracy:.4f} (pass@1, {self.samples} sample(s) per problem, {mode}) "
                f"on {self.num_problems} problems; mean completion length {self.mean_length:.1f} tokens")

    @property
    def truncation_rate(self) -> float:
        """Share of completions that hit the length limit (no stop token)."""
        reasons = [r for p in self.per_problem for r in p.get("finish_reasons", [])]
        return sum(r == "length" for r in reasons) / len(reasons) if reasons else 0.0

    def speed_line(self) -> str:
        tps = self.stats.get("rollout/tokens_per_s")
        secs = self.stats.get("rollout/seconds")
        speed = f"{tps:,.0f} generated tokens/s over {secs:.1f} s" if tps and secs else "no timing from the engine"
        return f"truncated {self.truncation_rate:.1%} of completions; {speed}"

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, "pass_at_k": self.pass_at_k, "samples": self.samples,
                "num_problems": self.num_problems, "mean_length": self.mean_length,
                "truncation_rate": self.truncation_rate, "temperature": self.temperature, "stats": dict(self.stats),
                "per_problem": self.per_problem}

    def save(self, path, meta: dict | None = None) -> None:
        """Write the summary, ``meta`` and every completion as JSON, all at once
        (``file_writes.write_text_atomic``: a reader never sees half a file)."""
        import json

        from qerl_kit.file_writes import write_text_atomic

        write_text_atomic(path, json.dumps({"meta": meta or {}, **self.to_dict()}, indent=1, default=str))

    def example_rows(self, k: int = 3, limit: int = 80) -> list[dict]:
        """The first ``k`` problems (an int >= 0) as table rows, texts cut to ``limit`` characters."""
        k = check_value("k", k, int, ge=0, why="the number of problems shown")
        limit = check_value("limit", limit, int, ge=4, why="characters per text, '...' included")
        return [{"#": p["index"], "prompt": _short(p["prompt"], limit), "answer": _short(p["answer"], 20),
                 "completion": _short(p["completions"][0], limit) if p["completions"] else "",
                 "pass@1": p["pass_rate"]} for p in self.per_problem[:k]]

    def __str__(self) -> str:
        return self.summary() + "\n" + text_table(self.example_rows())

    def _repr_html_(self) -> str:
        return f"<p>{html.escape(self.summary())}</p>" + html_table(self.example_rows(5, 200),
                                                                    caption="first problems")

    def to_dataframe(self):
        """One row per problem (pandas is imported lazily)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("EvalResult.to_dataframe needs pandas: `pip install pandas` "
                              "(or the qerl_kit[notebook] extra)") from e
        return pd.DataFrame(self.per_problem)


def evaluate_task(task: Task, model: Any, tokenizer: Any, rows: Sequence[dict] | None = None, *,
                  samples: int = 1, temperature: float = 0.6, top_p: float = 0.95, max_new_tokens: int | None = None,
                  batch_size: int | None = None, engine: RolloutEngine | None = None,
                  seed: int | None = 0) -> EvalResult:
    """pass@1 of ``model`` (adapter applied, if any) on ``task``'s held-out rows (or ``rows``), with the
    task's prompts and accuracy reward.

    ``engine`` overrides the default ``HFEngine(model, tokenizer)`` (e.g. a vLLM engine, which is
    synced with ``model``'s adapter first; ``model`` may be None when the engine holds it already).
    ``max_new_tokens`` None: the task's budget, else 512.
    """
    if not isinstance(task, Task):
        raise TypeError(f"evaluate_task(task, model, tokenizer, ...) takes a qerl_kit.tasks.Task first; got "
                        f"{type(task).__name__} (for plain rows and a reward function: evaluate(model, tokenizer, "
                        "rows, reward_fn))")
    rows = task.eval if rows is None else [dict(r) for r in check_rows("rows", rows)]
    if not rows:
        raise ValueError(f"task {task.name!r} has no held-out rows to evaluate on; pass rows=")
    seed, temperature, samples = _checked(seed, temperature, samples, batch_size)
    engine = _engine(engine, model, tokenizer)
    if max_new_tokens is None:
        max_new_tokens = task.max_new_tokens or 512
    if batch_size is None:  # few engine calls: the engine batches rows itself and compacts finished ones
        batch_size = max(1, EVAL_ROWS // samples) if getattr(engine, "batches_rows", False) else HF_BATCH
    per_problem: list[dict] = []
    stats: dict[str, float] = {}
    for chunk_index, start in enumerate(range(0, len(rows), batch_size)):
        chunk = rows[start:start + batch_size]
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                  top_p=top_p if temperature > 0 else 1.0,
                                  seed=None if seed is None else seed + chunk_index)
        prompts = task.encode(tokenizer, chunk)  # rendered by the task and tokenized once, as in training
        with engine.sync(model):
            out = engine.generate(prompts, samples, sampling)
        per_problem += _score_chunk(task, chunk, start, out, samples)
        _add_stats(stats, getattr(out, "stats", {}))
    if stats.get("rollout/seconds"):
        stats["rollout/tokens_per_s"] = stats.get("rollout/tokens", 0.0) / stats["rollout/seconds"]
    all_lengths = [L for p in per_problem for L in p["lengths"]]
    return EvalResult(accuracy=sum(p["pass_rate"] for p in per_problem) / len(per_problem),
                      per_problem=per_problem, samples=samples,
                      mean_length=sum(all_lengths) / len(all_lengths), temperature=float(temperature),
                      stats=stats)


def evaluate(model: Any, tokenizer: Any, dataset: Iterable[dict], reward_fn: Callable[..., list],
             *, samples: int = 1, temperature: float = 0.6, top_p: float = 0.95,
             max_new_tokens: int = 512, batch_size: int | None = None, engine: RolloutEngine | None = None,
             prompt_fn: Callable[[Any, dict], str] | None = None, seed: int | None = 0) -> EvalResult:
    """pass@1 of ``model`` on ``dataset`` rows with a ``prompt`` column, scored by ``reward_fn``:
    ``evaluate_task`` on a Task of these rows, ``reward_fn`` and ``prompt_fn(tokenizer, row)`` (default
    ``qerl_kit.data.chat_prompt``: the chat template when there is one, GSM8K's instruction suffix).
    Keyword arguments as there."""
    # a list of rows with a non-empty 'prompt' (never one dict, whose keys would be the rows): Task's check
    rows = [dict(r) for r in check_rows("dataset", dataset)]
    if not rows:
        raise ValueError("the dataset is empty: nothing to evaluate")
    task = Task("evaluate", [], rows, reward_fn, chat_prompt if prompt_fn is None else prompt_fn)
    return evaluate_task(task, model, tokenizer, samples=samples, temperature=temperature, top_p=top_p,
                         max_new_tokens=max_new_tokens, batch_size=batch_size, engine=engine, seed=seed)


def _checked(seed: Any, temperature: Any, samples: Any, batch_size: Any) -> tuple:
    """(seed, temperature, samples) checked by the shared rules; greedy samples once."""
    seed = None if seed is None else check_seed("seed", seed)  # each chunk is seeded with seed + its index
    temperature = check_temperature("temperature", temperature, greedy=True)
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an int >= 1; got {samples!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be None (all problems at once) or an int >= 1; got {batch_size!r}")
    if temperature == 0 and samples > 1:
        warnings.warn(f"temperature=0 is greedy: the {samples} samples would be identical; sampling once",
                      stacklevel=3)
        samples = 1
    return seed, temperature, samples


def _engine(engine: RolloutEngine | None, model: Any, tokenizer: Any) -> RolloutEngine:
    if engine is not None:
        check_engine(engine)  # sync and generate, or a clear TypeError
        return engine
    if model is None:
        raise ValueError("pass a model (evaluated with HFEngine) or an engine")
    from qerl_kit.rollout.hf import HFEngine

    return HFEngine(model, tokenizer)


def _score_chunk(task: Task, chunk: list[dict], start: int, out: Any, samples: int) -> list[dict]:
    """The per-problem records of one chunk's rollouts, scored by the task's accuracy reward with
    training's keyword arguments, call-and-check and correctness rule (``qerl_kit.scoring``)."""
    n = len(chunk) * samples
    scores = accuracy_scores(task, reward_kwargs(chunk, samples, out.texts, out.completion_id_lists()), n)
    lengths = out.completion_lengths.tolist()
    records = []
    for j, row in enumerate(chunk):
        s = slice(j * samples, (j + 1) * samples)
        got = [None if x is None else float(x) for x in scores[s]]
        records.append({"index": start + j, "prompt": row["prompt"], "answer": row.get("answer"),
                        "completions": list(out.texts[s]), "scores": got, "lengths": lengths[s],
                        "finish_reasons": list(out.finish_reasons[s]),
                        "pass_rate": sum(map(is_correct, got)) / samples,
                        "columns": {k: v for k, v in row.items() if k not in ("prompt", "answer")}})
    return records


def _add_stats(stats: dict, chunk_stats: dict) -> None:
    """Sum a chunk's rollout/* timing into ``stats`` (tokens/s is recomputed from the sums)."""
    for key, value in chunk_stats.items():
        if key != "rollout/tokens_per_s":
            stats[key] = stats.get(key, 0.0) + value
