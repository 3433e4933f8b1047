"""``--section.key true|false`` for boolean keys on the command line.

tyro (TorchTitan's parser) takes a boolean key as a flag pair only:
``--checkpoint.enable`` and ``--checkpoint.no-enable``; ``--checkpoint.enable
true`` is refused with "Unrecognized options: true". The README promises
``--section.key value`` for every key, so :func:`rewrite_bool_args` turns a
boolean key followed by a value (or ``=value``) into tyro's flag before
parsing. The boolean keys are read from the merged dataclasses, so
TorchTitan's keys and ours are covered alike.
"""

from __future__ import annotations

import dataclasses
import typing

TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off")


def bool_keys(cls, prefix: str = "") -> set[str]:
    """Dotted names (``checkpoint.enable``) of every ``bool`` field of the
    dataclass ``cls`` and of the dataclasses nested in it."""
    hints = typing.get_type_hints(cls)  # some modules' annotations are strings
    keys = set()
    for f in dataclasses.fields(cls):
        ftype = hints.get(f.name, f.type)
        name = f"{prefix}{f.name}"
        if ftype is bool:
            keys.add(name)
        elif dataclasses.is_dataclass(ftype):
            keys |= bool_keys(ftype, name + ".")
    return keys


def rewrite_bool_args(argv: list[str], keys: set[str], error: type[Exception] = ValueError) -> list[str]:
    """``--a.b true`` / ``--a.b=yes`` -> ``--a.b``; ``--a.b false`` / ``--a.b=0``
    -> ``--a.no_b``, for ``a.b`` in ``keys`` (dashes or underscores). A bare
    ``--a.b`` and every other argument pass unchanged. A value that is not a
    boolean raises ``error`` naming the key."""
    out: list[str] = []
    k = 0
    while k < len(argv):
        arg = argv[k]
        k += 1
        flag, eq, value = arg.partition("=")
        key = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        if key not in keys:
            out.append(arg)
            continue
        if not eq:
            if k >= len(argv) or argv[k].startswith("-"):
                out.append(arg)  # the bare flag: tyro's own form
                continue
            value = argv[k]
            k += 1
        word = value.strip().lower()
        if word not in TRUE + FALSE:
            raise error(f"config key {key}: {value!r} is not a boolean (true/false, 1/0, yes/no)")
        section, _, name = key.rpartition(".")
        out.append(f"--{key}" if word in TRUE else f"--{section + '.' if section else ''}no_{name}")
    return out
