"""Reading a YAML config file strictly: every problem is a one-line ``ConfigError`` naming ``file:line``.

PyYAML's ``safe_load`` lets a later duplicate key replace an earlier one (a second ``optim:`` section
silently drops the first one's ``lr``), raises its own multi-line errors for syntax such as a tab in
the indentation, and fails in ``int()`` on an integer of more than ``sys.get_int_max_str_digits()``
digits. ``read_yaml`` refuses a key given twice in any mapping (``optim.lr`` given twice, a section
given twice; YAML's merge keys ``<<:`` still work: an explicit key overrides a merged one, as the
YAML spec says), turns syntax errors into ``<file>:<line>:<column>: <problem>`` and names the key of
an integer too long to read.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from qerl_kit.config_types import ConfigError, short_repr

_MERGE = "tag:yaml.org,2002:merge"
_INT = "tag:yaml.org,2002:int"


def _digits_limit() -> int:
    get = getattr(sys, "get_int_max_str_digits", None)  # Python >= 3.11 (and patched 3.8 - 3.10)
    return get() if get else 0


def _shown(key: str) -> str:
    """A dotted key as the error shows it: as it is, or bounded when it is long or odd."""
    return key if len(key) <= 100 and key.isprintable() else short_repr(key, 100)


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader whose mappings refuse duplicate keys, naming the dotted key and both lines."""

    def __init__(self, stream, name: str):
        super().__init__(stream)
        self.name = name  # shown in every mark (yaml's default is "<unicode string>")
        self._paths: dict[int, str] = {}  # id(mapping node) -> its dotted key, for nested sections

    def _where(self, node) -> str:
        return f"{self.name}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            path, seen = self._paths.get(id(node), ""), {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE:  # `<<: *base`: merged keys may be overridden explicitly
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # yaml's own error says an unhashable key is not allowed
                dotted = (f"{path}.{key}" if path else key) if isinstance(key, str) else short_repr(key, 80)
                if key in seen:
                    raise ConfigError(f"{self._where(key_node)}: {_shown(dotted)} is given twice (first on "
                                      f"line {seen[key]}); a later one would silently replace the earlier: keep one",
                                      dotted, key, "each key once per mapping")
                seen[key] = key_node.start_mark.line + 1
                if isinstance(value_node, yaml.MappingNode):
                    self._paths[id(value_node)] = dotted
                elif isinstance(value_node, yaml.ScalarNode) and value_node.tag == _INT:
                    self._check_int(value_node, dotted)
        return super().construct_mapping(node, deep=deep)

    def _check_int(self, node, key: str) -> None:
        digits = sum(c.isdigit() for c in node.value)
        limit = _digits_limit()
        if limit and digits > limit:
            raise ConfigError(f"{self._where(node)}: {_shown(key)} must be an int of at most {limit} digits "
                              f"(Python's limit for reading one); got an int of {digits} digits", key, None,
                              f"an int of at most {limit} digits")

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # an int too long to convert, outside a mapping (in a list)
            raise ConfigError(f"{self._where(node)}: an int of {sum(c.isdigit() for c in node.value)} digits; Python "
                              f"reads at most {_digits_limit()}") from None


_StrictLoader.add_constructor(_INT, _StrictLoader.construct_yaml_int)


def read_yaml(path: str | Path) -> Any:
    """The YAML document in ``path`` (None for an empty file), or a ``ConfigError`` naming
    ``path:line:column``: a syntax error, a key given twice in one mapping, an int too long to read."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark is not part of the document
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); a config file is YAML text") from None
    loader = _StrictLoader(text, str(path))
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(p) for p in (err.context, err.problem) if p)
        if "'\\t'" in what:
            what += " (YAML indents with spaces, never tabs)"
        raise ConfigError(f"{where}: not valid YAML: {what}".replace("\n", " ")) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {str(err).splitlines()[0] if str(err) else type(err).__name__}") \
            from None
    finally:
        loader.dispose()
