"""Load GSM8K / MATH-500 problems and build prompts.

- ``load_gsm8k(path_or_split)`` / ``load_math500(path_or_split)`` read local JSON Lines files: a
  path, or a split name such as ``"test"``, found as ``gsm8k_test.jsonl`` in the data folder
  (``$QERL_DATA``, else ``./data``, else ``../shared/data``: ``find_data_file``). Never the hub
  at run time unless asked: ``source="hub"`` reads Hugging Face ``datasets`` (``openai/gsm8k``
  "main", ``HuggingFaceH4/MATH-500``; imported lazily).
- Each row is a plain dict with ``prompt`` (the question text), ``answer`` (the gold final answer)
  and the original columns. For GSM8K the original ``answer`` column (the worked solution ending in
  ``#### N``) is kept as ``solution`` and ``answer`` becomes the number ``N`` (thousands separators
  removed: "#### 1,600" -> "1600"). ``datasets.Dataset.from_list(rows)`` turns the list into a
  dataset for TRL.
- A malformed row (not UTF-8, bad JSON, nesting too deep, a key twice in one object, not an object,
  missing/empty field, GSM8K solution without a numeric ``#### N``) raises
  ``DataError("<file>:<line>: ...")`` (a ValueError, which ``qerl`` prints as one line) with the
  1-based line number; blank lines are skipped. Rows whose columns differ from the first row's are
  refused at load (``check_columns``): a batch's columns are taken from its first row. A column
  the loader derives (``prompt``; GSM8K's ``solution``) that the file already has with another
  value is refused, never overwritten.
- ``build_prompt(tokenizer, question, ...)`` uses the tokenizer's chat template when it has one,
  else a plain ``"Question: ...\\nAnswer:"`` template; ``build_messages`` gives the conversational form.

Deviation from official QeRL / verl preprocessing: none in content (same GSM8K instruction suffix);
we validate every row instead of silently keeping rows without a parsable answer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Iterable

from .config_types import short_repr
from .rewards import parse_number

__all__ = [
    "load_gsm8k", "load_math500", "read_jsonl", "check_columns", "check_rows", "DataError", "build_prompt", "build_messages",
    "data_dirs", "find_data_file",
    "DATA_ENV",
    "GSM8K_SUFFIX", "MATH_SUFFIX",
]

GSM8K_SUFFIX = ' Let\'s think step by step and output the final answer after "####".'
MATH_SUFFIX = " Please reason step by step, and put your final answer within \\boxed{}."

_HF_SOURCES = {
    "gsm8k": ("openai/gsm8k", "main"),
    "math500": ("HuggingFaceH4/MATH-500", None),
}


class DataError(ValueError):
    """A data file or row that cannot be used; the message starts with where (``file:line``)."""


class _DuplicateKey(Exception):
    """Raised by ``_unique_keys`` while a line is parsed; ``read_jsonl`` turns it into a DataError."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads``'s object hook: a key twice in one object (``{"answer": 2, "answer": 7}``) is an
    error, not "the last one wins" (which would silently pick a gold answer)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def read_jsonl(path: str | os.PathLike) -> list[tuple[int, Any]]:
    """(1-based line number, parsed JSON) for every non-blank line. Whatever makes a line unreadable
    (not UTF-8, invalid JSON, nesting too deep for the parser, an integer too long to convert, a key
    twice in one object) is a ValueError naming file:line."""
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                 f"{e.start + 1}); JSON Lines files are UTF-8") from None
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line, object_pairs_hook=_unique_keys)))
            except _DuplicateKey as e:
                raise DataError(f"{path}:{lineno}: the key {short_repr(e.args[0], 60)} appears twice in one JSON object; "
                                 "keep one (JSON readers disagree on which wins)") from None
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            except RecursionError:
                raise DataError(f"{path}:{lineno}: JSON nested too deeply to read") from None
            except ValueError as e:  # e.g. an integer longer than Python's int(str) digit limit
                raise DataError(f"{path}:{lineno}: unreadable JSON ({str(e)[:200]})") from None
    return out


def check_columns(rows: Iterable[tuple[str, dict]]) -> None:
    """Every row has the columns of the first (reward functions get one list per column, taken
    from a batch's first row): a row with a column more or less is a ValueError naming where it
    is (``file:line``) and the difference, at load time rather than at a later training step."""
    first_where, first = None, None
    for where, row in rows:
        if first is None:
            first_where, first = where, set(row)
            continue
        cols = set(row)
        if cols != first:
            extra, missing = sorted(map(str, cols - first)), sorted(map(str, first - cols))
            diff = "; ".join(part for part in (f"extra {extra}" if extra else "",
                                               f"missing {missing}" if missing else "") if part)
            raise DataError(f"{where}: the columns differ from the first row's ({first_where}): {diff}; "
                             f"every row needs the same columns {sorted(map(str, first))}")


def check_rows(key: str, rows: Any) -> list:
    """Rows given in Python (a ``Task``'s splits, ``evaluate``'s dataset) as a list: a list, tuple or
    other iterable of rows (never a string, which would be its characters, nor one dict, which would be
    its keys), each a mapping whose ``prompt`` column is a non-empty string (a None or a number would
    be rendered as the text "None" or "5" and trained on). Errors name ``key``, the row and the value."""
    hint = " (one row? wrap it in a list: [row])" if isinstance(rows, Mapping) else ""
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Iterable):
        raise TypeError(f"{key} must be a list of rows (dicts with a 'prompt' column); got {short_repr(rows)}{hint}")
    rows = list(rows)
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"{key}[{i}] must be a row (a dict with a 'prompt' column); got {short_repr(row)}")
    missing = [i for i, row in enumerate(rows) if "prompt" not in row]
    if missing:
        raise ValueError(f"{key} rows {missing[:5]} have no 'prompt' column (keys of row {missing[0]}: "
                         f"{short_repr(sorted(map(str, rows[missing[0]])))})")
    for i, row in enumerate(rows):
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            kind = TypeError if not isinstance(prompt, str) else ValueError
            raise kind(f"{key}[{i}]['prompt'] must be a non-empty string (the question, not only whitespace); got {short_repr(prompt)}")
    return rows


def _field(row: Any, key: str, where: str) -> str:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if key not in row or row[key] is None:
        raise DataError(f"{where}: missing field {key!r} (has {sorted(row)})")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    value = str(value).strip()
    if not value:
        raise DataError(f"{where}: field {key!r} is empty")
    return value


def _check_derived(row: dict, where: str, **derived: str) -> None:
    """The columns the loader derives (``prompt``, GSM8K's ``solution``) must not overwrite a column
    of that name the file already has with another value (it would silently never reach the reward
    functions): a DataError naming the row and the column instead."""
    for key, value in derived.items():
        if key in row and row[key] != value:
            raise DataError(f"{where}: the file's own column {key!r} ({short_repr(row[key], 60)}) clashes with the "
                            f"{key!r} the loader derives from it ({short_repr(value, 60)}); rename that column")


def _gsm8k_row(row: Any, where: str) -> dict[str, Any]:
    question = _field(row, "question", where)
    solution = _field(row, "answer", where)
    if "####" not in solution:
        raise DataError(f"{where}: GSM8K solution has no '#### <answer>' line")
    final = solution.rsplit("####", 1)[1].strip()
    if not final:
        raise DataError(f"{where}: empty answer after '####'")
    if parse_number(final) is None:
        raise DataError(f"{where}: answer after '####' is not a number: {final!r}")
    _check_derived(row, where, prompt=question, solution=solution)
    out = {k: v for k, v in row.items() if k != "answer"}
    out.update(prompt=question, answer=final.replace(",", ""), solution=solution)
    return out


def _math500_row(row: Any, where: str) -> dict[str, Any]:
    problem = _field(row, "problem", where)
    answer = _field(row, "answer", where)
    _check_derived(row, where, prompt=problem)
    return {**row, "prompt": problem, "answer": answer}


def _looks_like_path(s: str) -> bool:
    return os.sep in s or "/" in s or s.endswith((".jsonl", ".json")) or s.startswith(".")


DATA_ENV = "QERL_DATA"
# Where a split name (``load_gsm8k("test")``, ``data.dataset: gsm8k``) is looked up, in order:
# $QERL_DATA, ./data, ../shared/data (this project's layout), each relative to the working directory.
DEFAULT_DATA_DIRS = ("data", "../shared/data")
FILE_NAMES = {"gsm8k": "gsm8k_{split}.jsonl", "math500": "math500_{split}.jsonl"}


def data_dirs() -> list[Path]:
    """The folders searched for ``<task>_<split>.jsonl`` (``$QERL_DATA`` alone when it is set). A
    ``$QERL_DATA`` that is a file, not a folder, is a FileNotFoundError saying so (qerl prints it as one line)."""
    env = os.environ.get(DATA_ENV)
    if env:
        folder = Path(env).expanduser()
        if folder.exists() and not folder.is_dir():
            raise FileNotFoundError(f"{DATA_ENV}={short_repr(env, 60)} is a file, not a folder: set {DATA_ENV} to the folder "
                                    "that holds the data files (gsm8k_test.jsonl ...), or pass the .jsonl path itself")
        return [folder]
    return [Path(d) for d in DEFAULT_DATA_DIRS]


def find_data_file(kind: str, split: str) -> Path:
    """The local JSON Lines file of ``kind``'s ``split`` (``gsm8k_test.jsonl`` ...), or a
    FileNotFoundError naming every folder searched and how to point at one. Never the hub."""
    name = FILE_NAMES[kind].format(split=split)
    searched = data_dirs()
    for folder in searched:
        if (folder / name).is_file():
            return folder / name
    where = ", ".join(str(f.resolve()) + ("" if f.is_dir() else " (no such folder)") for f in searched)
    raise FileNotFoundError(
        f"{kind} split {split!r}: no {name} in {where}. Put the JSON Lines files in ./data, or set "
        f"{DATA_ENV}=/path/to/folder (this project's copies: ../shared/data), or pass a .jsonl path; "
        f"to fetch from the Hugging Face Hub explicitly, use load_{kind}({split!r}, source='hub')")


def _load(kind: str, path_or_split: str | os.PathLike, convert, limit: int | None, source: str = "local") -> list[dict]:
    if source not in ("local", "hub"):
        raise ValueError(f"source must be 'local' or 'hub'; got {source!r}")
    p = Path(path_or_split)
    if source == "hub":
        rows: Iterable[tuple[str, Any]] = _from_hub(kind, str(path_or_split))
    elif p.is_file():
        rows = ((f"{p}:{n}", r) for n, r in read_jsonl(p))
    elif isinstance(path_or_split, os.PathLike) or _looks_like_path(str(path_or_split)):
        raise FileNotFoundError(f"{kind}: no such file: {path_or_split}")
    else:
        f = find_data_file(kind, str(path_or_split))
        rows = ((f"{f}:{n}", r) for n, r in read_jsonl(f))
    out, wheres = [], []
    for where, row in rows:
        if limit is not None and len(out) >= limit:
            break
        out.append(convert(row, where))
        wheres.append(where)
    check_columns(zip(wheres, out))
    return out


def _from_hub(kind: str, split: str) -> Iterable[tuple[str, Any]]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"{kind}: loading split {split!r} from the Hugging Face Hub needs the `datasets` "
                          "package: `pip install datasets` (or pass the path of a local .jsonl file)") from e
    name, config = _HF_SOURCES[kind]
    ds = datasets.load_dataset(name, config, split=split) if config else datasets.load_dataset(name, split=split)
    return ((f"{name}[{split}] row {i + 1}", dict(r)) for i, r in enumerate(ds))


def load_gsm8k(path_or_split: str | os.PathLike = "test", *, limit: int | None = None,
               source: str = "local") -> list[dict]:
    """GSM8K rows ``{prompt, answer, question, solution}`` from a JSONL file or a split name
    (``gsm8k_<split>.jsonl`` in the data folder, ``find_data_file``); ``source="hub"`` reads the
    split from the Hugging Face Hub instead (needs ``datasets`` and a network)."""
    return _load("gsm8k", path_or_split, _gsm8k_row, limit, source)


def load_math500(path_or_split: str | os.PathLike = "test", *, limit: int | None = None,
                 source: str = "local") -> list[dict]:
    """MATH-500 rows ``{prompt, answer, problem, solution, subject, level, unique_id}``, found as
    ``load_gsm8k``'s (``math500_<split>.jsonl``)."""
    return _load("math500", path_or_split, _math500_row, limit, source)


def build_messages(question: str, system_prompt: str | None = None,
                   suffix: str = GSM8K_SUFFIX) -> list[dict[str, str]]:
    """Conversational prompt (TRL's conversational dataset format)."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": f"{question}{suffix or ''}"}]


def chat_prompt(tokenizer: Any, row: dict, suffix: str | None = None) -> str:
    """The prompt of a dataset row: ``build_prompt`` of its ``prompt`` column (the tokenizer's chat
    template when it has one), with GSM8K's instruction suffix unless ``suffix`` says otherwise.
    The default prompt function of a ``qerl_kit.tasks.Task`` and of ``qerl_kit.evaluate.evaluate``."""
    return build_prompt(tokenizer, row["prompt"], suffix=GSM8K_SUFFIX if suffix is None else suffix)


def build_prompt(tokenizer: Any, question: str, system_prompt: str | None = None,
                 suffix: str = GSM8K_SUFFIX) -> str:
    """Prompt text for generation: the tokenizer's chat template (with the generation prompt) when it
    has one, else ``"[system\\n\\n]Question: <question><suffix>\\nAnswer:"``. ``tokenizer`` may be None."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None:
        text = tokenizer.apply_chat_template(build_messages(question, system_prompt, suffix),
                                             tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
        return text
    head = f"{system_prompt}\n\n" if system_prompt else ""
    return f"{head}Question: {question}{suffix or ''}\nAnswer:"
