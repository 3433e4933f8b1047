"""Every key of the merged config and the type of its value, checked before
TorchTitan's parser (tyro) sees them.

tyro answers a misspelled key (``--grpo.gruop_size 4``) or a value of the
wrong type (``--grpo.group_size abc``) with a 10-line box on stderr and exit
2, which torchrun's failure report replaces by a link to its docs; a wrong
type in the TOML file passes it unchecked and fails later as a TypeError.
:func:`check_cli_args` and :func:`check_toml_values` raise one ConfigError
line instead, naming the key and the nearest valid one (or what the value
must be), which grpo_train.py prints and writes to torchrun's error file.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

# Arguments tyro itself takes, which are no config key.
_OWN_FLAGS = ("-h", "--help")


def key_types(cls, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """``{"grpo.group_size": (int, 16), ...}``: the type hint and default of
    every leaf field of the dataclass ``cls`` and the dataclasses in it."""
    hints = typing.get_type_hints(cls)  # some modules' annotations are strings
    out: dict[str, tuple[Any, Any]] = {}
    for f in dataclasses.fields(cls):
        ftype = hints.get(f.name, f.type)
        if dataclasses.is_dataclass(ftype):
            out |= key_types(ftype, f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            out[f"{prefix}{f.name}"] = (ftype, default)
    return out


def nearest_key(key: str, keys: typing.Iterable[str]) -> str | None:
    """The known key closest to ``key``: by spelling, else one of the same
    name in another section (``grpo.temperature`` -> ``rollout.temperature``)."""
    keys = sorted(keys)
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if close:
        return close[0]
    name = key.rpartition(".")[2]
    same = [k for k in keys if k.rpartition(".")[2] == name]
    if same:
        return same[0]
    close = difflib.get_close_matches(name, [k.rpartition(".")[2] for k in keys], n=1, cutoff=0.75)
    return next((k for k in keys if close and k.rpartition(".")[2] == close[0]), None)


def _unknown(key: str, keys: typing.Iterable[str], where: str, spelling: str = "{}") -> str:
    """The error line; ``spelling`` writes a key as the user wrote it (``--{}``, ``[{}]``)."""
    near = nearest_key(key, keys)
    hint = f"; did you mean {spelling.format(near)}?" if near else "; grpo_train.py --help lists the keys"
    return f"unknown config key {spelling.format(key)}{where}{hint}"


def _members(tp) -> tuple:
    """The alternatives of ``A | B`` / ``Optional[A]``, else ``(tp,)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _fits(tp, value, from_cli: bool) -> bool | None:
    """Whether ``value`` (a command-line string, or a TOML value) is one of
    type ``tp``; None for a type this module does not check (tyro does)."""
    results = []
    for t in _members(tp):
        origin = typing.get_origin(t)
        if t is type(None):
            ok = from_cli and value == "None"
        elif origin is typing.Literal:
            choices = typing.get_args(t)
            ok = (value in [str(c) for c in choices]) if from_cli else value in choices
        elif t is bool:
            ok = (not from_cli) and isinstance(value, bool)  # the command line's booleans are config/cli_bools.py's
        elif t is int:
            ok = _parses(int, value) if from_cli else isinstance(value, int) and not isinstance(value, bool)
        elif t is float:
            ok = _parses(float, value) if from_cli else isinstance(value, (int, float)) and not isinstance(value, bool)
        elif t is str:
            ok = from_cli or isinstance(value, str)
        elif origin is list and typing.get_args(t) in ((str,), (int,)) and not from_cli:
            (item,) = typing.get_args(t)
            ok = isinstance(value, list) and all(isinstance(v, item) and not isinstance(v, bool) for v in value)
        else:
            return None
        results.append(ok)
    return any(results)


def _parses(kind, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def _expected(tp, default) -> str:
    """What a value of ``tp`` must be, for the error line."""
    names = []
    for t in _members(tp):
        if typing.get_origin(t) is typing.Literal:
            names.append("one of " + ", ".join(repr(c) for c in typing.get_args(t)))
        elif t is type(None):
            continue
        elif typing.get_origin(t) is list:
            names.append(f"a list of {typing.get_args(t)[0].__name__}")
        else:
            names.append({int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
                t, getattr(t, "__name__", str(t))))
    text = " or ".join(names)
    return f"must be {text}" + ("" if typing.get_origin(tp) is typing.Literal or default in (None, [], "")
                                else f" (default {default!r})")


def check_cli_args(argv: list[str], keys: dict[str, tuple[Any, Any]], error: type[Exception]) -> None:
    """Raise ``error`` (one line) for the first ``--section.key`` of ``argv``
    that names no key, or whose value is not of the key's type. Booleans
    have been turned into flags (config/cli_bools.py) before: ``--a.b`` and
    ``--a.no_b`` take no value."""
    flags = {k for k, (t, _) in keys.items() if t is bool}
    flags |= {f"{k.rpartition('.')[0]}.no_{k.rpartition('.')[2]}" for k in flags}
    k = 0
    while k < len(argv):
        arg = argv[k]
        k += 1
        if not arg.startswith("--") or arg in _OWN_FLAGS:
            continue  # a value, or a stray word tyro names itself
        flag, eq, value = arg.partition("=")
        key = flag[2:].replace("-", "_")
        if key in flags:
            continue
        if key not in keys:
            raise error(_unknown(key, list(keys) + sorted(flags), "", "--{}"))
        if not eq:
            # a value may start with "--" itself (inference.engine_args); another key may not
            nxt = argv[k].partition("=")[0][2:].replace("-", "_") if k < len(argv) else ""
            if k >= len(argv) or (argv[k].startswith("--") and (nxt in keys or nxt in flags)):
                raise error(f"config key {key}: --{key} needs a value")
            value = argv[k]
            k += 1
        tp, default = keys[key]
        if _fits(tp, value, from_cli=True) is False:
            raise error(f"config key {key} = {value!r}: {_expected(tp, default)}")


def check_toml_values(data: dict, keys: dict[str, tuple[Any, Any]], path: str, error: type[Exception],
                      prefix: str = "") -> None:
    """Raise ``error`` (one line) for the first key of the TOML ``data`` that
    names no key of its section, or whose value is not of the key's type."""
    for name, value in data.items():
        key = f"{prefix}{name}"
        where = f" in {path!r} ({'[' + prefix[:-1] + ']' if prefix else 'top level'})"
        if isinstance(value, dict) and key not in keys:
            if not value:  # an empty section: name the nearest section
                sections = {k.rpartition(".")[0] for k in keys} - {""}
                raise error(_unknown(key, sections, where, "[{}]"))
            check_toml_values(value, keys, path, error, key + ".")  # an unknown section names its first key
            continue
        if key not in keys:
            raise error(_unknown(key, keys, where))
        tp, default = keys[key]
        if _fits(tp, value, from_cli=False) is False:
            raise error(f"config key {key} = {value!r} in {path!r}: {_expected(tp, default)}")
