"""Settings from flags > the ``--config`` file > ``QWENBATCH_*`` environment variables > a dataclass's defaults."""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "QWENBATCH_"
CONFIG_TABLES = ("engine", "server")  # EngineConfig's settings; qwenbatch serve's own
_FORM = "qwenbatch.form"  # the dataclass field metadata key read_as() writes
T = TypeVar("T")


@dataclass(frozen=True)
class Form:
    """How a setting is read: ``parse`` turns text into its value (ValueError if it cannot), ``expected`` names the
    form for the error message, and ``accepts`` says whether a value a TOML file already typed is of this form."""

    parse: Callable[[str], Any]
    expected: str
    accepts: Callable[[Any], bool]


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512MB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size in bytes (e.g. 4GiB, 512MB)")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {
        "B": 1,
        "K": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
        "KI": 2**10,
        "MI": 2**20,
        "GI": 2**30,
        "TI": 2**40,
    }[unit]
    return int(float(m.group(1)) * scale)


def _parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(word)


def _parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is an int subclass, and never a count


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


INT = Form(int, "an integer", _is_int)
FLOAT = Form(float, "a number", lambda v: _is_int(v) or type(v) is float)
BOOL = Form(_parse_bool, "true or false (also 1/0, yes/no, on/off)", lambda v: type(v) is bool)
TEXT = Form(str, "text", lambda v: isinstance(v, str))
PATH = Form(Path, "a path", lambda v: False)  # TOML has no paths, only strings to read
LIST = Form(_parse_list, "comma-separated values", _is_str_list)
WORDS = Form(str.split, "space-separated values", _is_str_list)
BYTES = Form(parse_bytes, "a size in bytes such as 4GiB or 512MB", _is_int)
_BY_TYPE = {int: INT, float: FLOAT, bool: BOOL, str: TEXT, Path: PATH, list: LIST}


def read_as(form: Form) -> dict[str, Form]:
    """Dataclass field metadata saying to read the field as ``form`` (a byte size, say) where its type alone does
    not say how: ``field(default=None, metadata=read_as(BYTES))``."""
    return {_FORM: form}


def resolve(
    cls: type[T],
    flags: Mapping[str, Any],
    config_file: Path | None,
    table: str,
    env: Mapping[str, str] | None = None,
) -> T:
    """``cls`` with each field from, first found: ``flags`` (values that are not None, e.g. ``vars(args)``), the
    ``[table]`` of ``config_file``, ``QWENBATCH_<FIELD>`` in ``env`` (default: os.environ; empty means unset), the
    dataclass's default.

    Text is read by the field's type (int, float, bool, str, Path, a comma-separated list, each optional) or by
    the form :func:`read_as` gave it. Every source is checked, even where a higher one wins: a value that cannot
    be read, an unknown key in the table, or a file that is missing or not TOML raises a one-line ValueError
    (FileNotFoundError) naming the variable, or the file and key.
    """
    forms = _forms(cls)
    from_flags = {name: value for name, value in flags.items() if name in forms and value is not None}
    from_file = _file_values(forms, config_file, table) if config_file is not None else {}
    from_env = _env_values(forms, os.environ if env is None else env)
    return cls(**{**from_env, **from_file, **from_flags})


def _forms(cls: type) -> dict[str, Form]:
    hints = typing.get_type_hints(cls)
    return {f.name: _form_of(f, hints[f.name], cls) for f in fields(cls) if f.init}


def _form_of(f: Field, hint: Any, cls: type) -> Form:
    if _FORM in f.metadata:
        return f.metadata[_FORM]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = options[0] if len(options) == 1 else hint
    form = _BY_TYPE.get(typing.get_origin(hint) or hint)
    if form is None:
        raise TypeError(f"{cls.__name__}.{f.name}: no way to read {hint} from text; give it metadata=read_as(form)")
    return form


def _file_values(forms: dict[str, Form], path: Path, table: str) -> dict[str, Any]:
    values = {}
    for key, value in _read_table(path, table).items():
        if key not in forms:
            raise ValueError(f"--config {path}: unknown {table} setting {key!r} (known: {', '.join(sorted(forms))})")
        values[key] = _from_file(forms[key], value, f"--config {path}: [{table}] {key}")
    return values


def _env_values(forms: dict[str, Form], env: Mapping[str, str]) -> dict[str, Any]:
    variables = {name: ENV_PREFIX + name.upper() for name in forms}
    return {
        name: _read(forms[name], env[variable], variable)
        for name, variable in variables.items()
        if env.get(variable, "").strip()
    }


def _read(form: Form, text: str, where: str) -> Any:
    try:
        return form.parse(text)
    except ValueError:
        raise ValueError(f"{where}={text!r}: expected {form.expected}") from None


def _from_file(form: Form, value: Any, where: str) -> Any:
    if form.accepts(value):
        return value
    if isinstance(value, str):
        return _read(form, value, where)
    raise ValueError(f"{where}={value!r}: expected {form.expected}")


def _read_table(path: Path, table: str) -> dict[str, Any]:
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML ({e})") from None
    unknown = sorted(set(data) - set(CONFIG_TABLES))
    if unknown:
        expected = ", ".join(f"[{name}]" for name in CONFIG_TABLES)
        raise ValueError(f"--config {path}: unknown table(s) {', '.join(unknown)} (expected {expected})")
    if not isinstance(data.get(table, {}), dict):
        raise ValueError(f"--config {path}: {table} must be a table ([{table}])")
    return data.get(table, {})
