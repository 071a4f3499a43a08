"""Typed dataclass configs with dotted `key=value` overrides.

Values are parsed as Python literals (numbers, booleans, lists, strings) and checked against the
field's annotated type, so `batches=ten` or `nonsense=1` fail with a message naming the key, instead
of silently running a different experiment. Mappings read from YAML (`apply_mapping`) are checked against the
same types directly, with no round trip through text.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
import types
import typing
from pathlib import Path

_WORDS = {"true": True, "false": False, "none": None, "null": None}
"""Words read as values in any case, alone or inside a literal (`{'a': true}`), as YAML and JSON write them."""


class _Words(ast.NodeTransformer):
    def visit_Name(self, node):
        return ast.Constant(_WORDS[node.id.lower()]) if node.id.lower() in _WORDS else node


def _has_comment(text: str) -> bool:
    """Whether Python would read part of `text` as a comment (`1e-5#c`: the shell passes `#` on mid-word)."""
    import io
    import tokenize

    try:
        return any(t.type == tokenize.COMMENT for t in tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return False


def _parse(text: str):
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    if _has_comment(text):
        return text  # text, so the type check names the key, rather than a value with its tail dropped
    try:
        return ast.literal_eval(_Words().visit(ast.parse(text.strip(), mode="eval")))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text  # a bare string


def _item_types(typ, value) -> tuple:
    """Element types of a list/tuple annotation for `value`: fixed for tuple[a, b], repeated otherwise."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) is tuple and args and args[-1] is not Ellipsis:
        return args
    n = len(value) if isinstance(value, (list, tuple)) else 1
    return ((args[0] if args and args[0] is not Ellipsis else typing.Any),) * n


def _check(key: str, value, typ):
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            split = isinstance(value, str) and value.startswith("[") and not value.endswith("]")
            hint = f"; a space split it from the rest: quote the whole argument, \"{key}=[a, b]\"" if split else ""
            raise ValueError(f"config key {key!r} expects a list, got {value!r}{hint}")
        return [_check(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)] if args else list(value)
    if origin is dict or typ is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"config key {key!r} expects a mapping with text keys like {{'name': 3}}, got {value!r}")
        inner = args[1] if len(args) == 2 else typing.Any
        return {k: _check(f"{key}.{k}", v, inner) for k, v in value.items()}
    if origin is tuple or typ is tuple:
        types_ = _item_types(typ, value)
        if not isinstance(value, (list, tuple)) or len(types_) != len(value):
            raise ValueError(f"config key {key!r} expects {len(types_)} items like [a, b], got {value!r}")
        return tuple(_check(f"{key}[{i}]", v, t) for i, (v, t) in enumerate(zip(value, types_, strict=True)))
    if origin in (typing.Union, types.UnionType):
        for a in args:
            try:
                return _check(key, value, a)
            except ValueError:
                continue
        raise ValueError(f"config key {key!r} expects {typ}, got {value!r}")
    if typ is typing.Any:
        return value
    if typ is type(None):
        if value is None:
            return None
        raise ValueError(f"config key {key!r} expects None, got {value!r}")
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits
            number = math.inf
        if not math.isfinite(number):  # YAML's .inf / .nan, or 1e999 on the command line: no setting means that
            raise ValueError(f"config key {key!r} must be a finite number, got {str(value)[:40]}")
        return number
    if typ in (int, str, bool) and type(value) is typ:
        return value
    if dataclasses.is_dataclass(typ):
        raise ValueError(f"config key {key!r} is a section; set its fields as {key}.<field>=...")
    raise ValueError(f"config key {key!r} expects {getattr(typ, '__name__', typ)}, got {value!r}")


def is_file(path) -> bool:
    """Path(path).is_file(), False for a name no file system holds (a part past 255 bytes raises OSError)."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def check_like_default(what: str, key: str, value, default) -> None:
    """Raise a ValueError naming `what` and `key` when `value` is not of its default's type (bool, int, float or
    str; an int passes for a float): a free option, such as a task's or a correction's, checked before it is used."""
    want = type(default)
    if want in (bool, int, float, str) and not (type(value) is want or (want is float and type(value) is int)):
        raise ValueError(f"{what} option {key!r} expects {want.__name__} (default {default!r}), got {value!r}")


def field_docs(cls, prefix: str = "") -> dict[str, tuple[object, str]]:
    """{dotted key: (default, docstring)} of a config dataclass, from the string literal under each field (the
    house style documents every field once, there); nested dataclasses are flattened to their dotted keys."""
    import inspect
    import textwrap

    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError):  # no source (a frozen build): keys without their documentation
        body = []
    docs = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
            docs[node.target.id] = " ".join(str(text).split())
    hints, out, default = typing.get_type_hints(cls), {}, cls()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(field_docs(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (getattr(default, f.name), docs.get(f.name, ""))
    return out


def override_key(item: str) -> str:
    """The key of a `key=value` override, as apply_overrides reads it (`' lr =1e-5'` -> `'lr'`)."""
    return item.split("=", 1)[0].strip()


def check_once(items: list[str], where: str = "") -> None:
    """Refuse `key=value` items that give one key more than once (`lr=1e-5 ... lr=1e-6`): the last would win without a
    word. `where` names the list (`train=[...]`) in the error."""
    keys = [override_key(item) for item in items if "=" in item]
    if twice := sorted({k for k in keys if keys.count(k) > 1}):
        given = " ".join(item for item in items if override_key(item) in twice)
        raise ValueError(f"{', '.join(map(repr, twice))} given more than once{where} ({given}); give each key once")


def apply_overrides(cfg, overrides: list[str]):
    """Apply `a.b=value` strings to a (nested) dataclass instance in place; returns it."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value")
        key, text = item.split("=", 1)
        *path, last = override_key(item).split(".")
        target = cfg
        for i, part in enumerate([*path, last]):
            if isinstance(target, dict):  # task_options.max_operand=5
                whole = ".".join(path[:i])
                raise ValueError(f"config key {key!r}: {whole} is a mapping, given whole: "
                                 f"\"{whole}={{'{part}': ...}}\"")  # fmt: skip
            if i < len(path):
                target = _field_value(target, part, key)
        if not dataclasses.is_dataclass(target):
            raise ValueError(f"config key {key!r}: the part before {last!r} is a value, not a section")
        hints = typing.get_type_hints(type(target))
        if last not in hints or last not in {f.name for f in dataclasses.fields(target)}:
            valid = sorted(f.name for f in dataclasses.fields(target))
            raise ValueError(f"unknown config key {key!r}{_did_you_mean(last, valid)}; valid keys here: {valid}")
        setattr(target, last, _from_text(key, text.strip(), hints[last]))
    return cfg


def apply_mapping(cfg, data: dict, prefix: str = ""):
    """Apply a nested mapping (a YAML preset) to a dataclass instance in place; returns it. Values keep the
    types YAML gave them and are checked like overrides; a numeric string such as `'1e-4'` is accepted where a
    float, and no text, is expected."""
    if not isinstance(data, dict):
        raise ValueError(f"config section {prefix.rstrip('.') or '<top>'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise ValueError(f"unknown config key {key!r}{_did_you_mean(name, names)}; valid keys here: "
                             f"{sorted(names)}")  # fmt: skip
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            apply_mapping(getattr(cfg, name), value, f"{key}.")
            continue
        setattr(cfg, name, _check(key, _float_text(value, typ), typ))
    return cfg


def _float_text(value, typ):
    """`value` with each string that spells a float made one where `typ` takes floats but not strings (a quoted
    `'1e-4'`, or YAML 1.1's reading of `1e-4` as text), inside lists and tuples too. A mapping of free values
    (task_options, say) keeps its text: there a string is what the user wrote (the preset loader reads unquoted
    exponents as floats, as the command line does)."""
    options = typing.get_args(typ) if typing.get_origin(typ) in (typing.Union, types.UnionType) else (typ,)
    if isinstance(value, (list, tuple)):
        for opt in options:
            if (typing.get_origin(opt) or opt) in (list, tuple):  # extra items keep their text; _check counts them
                types_ = [*_item_types(opt, value), *[typing.Any] * len(value)][: len(value)]
                return [_float_text(v, t) for v, t in zip(value, types_, strict=True)]
        return value
    if isinstance(value, str) and float in options and str not in options:
        try:  # a number as text ('1e-3', which YAML 1.1 leaves a string); 'nan' or 'inf' stays text, as on the
            x = float(value)  # command line, and the type check names the key
        except ValueError:
            return value
        return x if math.isfinite(x) else value
    return value


def _top_level_items(key: str, text: str) -> list[str]:
    """`text` split at the commas outside quotes and brackets (`[a, [b, c], 'd,e']` has three items); an unclosed
    bracket or quote is an error naming the key."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
        if depth < 0:
            break
    if depth or quote:
        raise ValueError(f"config key {key!r}: [{text}] has an unclosed or unbalanced bracket or quote")
    return [*items, text[start:]]


MAX_SPAN = 100_000
"""The most values a span `[a,...,b]` gives."""
_SPAN = re.compile(r"\[\s*(-?\d+)\s*,\s*\.\.\.\s*,\s*(-?\d+)\s*\]")  # [a,...,b] in a list of integers


def _from_text(key: str, text: str, typ):
    """Parse override text guided by the field type: strings stay text (`name=none` is the string
    'none'), lists accept unquoted items (`methods=[none,tis]`), a list of integers a span (`seeds=[0,...,9]`),
    `none` sets an optional field to None."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if typ is str:
        return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
    span = _SPAN.fullmatch(text)
    if origin is list and args == (int,) and span:  # seeds=[0,...,9]: every integer from the first to the last
        first, last = int(span[1]), int(span[2])
        if last < first:
            raise ValueError(f"config key {key!r}: [{first},...,{last}] runs backwards; write [{last},...,{first}]")
        if last - first >= MAX_SPAN:  # a slipped digit would fill the memory before any check
            raise ValueError(f"config key {key!r}: [{first},...,{last}] holds {last - first + 1} values, past the "
                             f"{MAX_SPAN} a span may give; check the numbers")  # fmt: skip
        return list(range(first, last + 1))
    if origin in (list, tuple) and text.startswith("[") and text.endswith("]"):
        try:
            return _check(key, ast.literal_eval(text), typ)
        except (ValueError, SyntaxError):
            items = [t.strip() for t in _top_level_items(key, text[1:-1]) if t.strip()]
            types_ = (list(_item_types(typ, items)) + [str] * len(items))[: len(items)]  # extras fail in _check
            values = [_from_text(f"{key}[{i}]", t, e) for i, (t, e) in enumerate(zip(items, types_, strict=True))]
            return _check(key, values, typ)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if text.lower() in ("none", "null"):
            return None
        (inner,) = [a for a in args if a is not type(None)][:1] or [str]
        return _from_text(key, text, inner)
    return _check(key, _parse(text), typ)


def _did_you_mean(name, names) -> str:
    """" (did you mean 'max_steps'?)" for a near miss (`max-steps`, `max_step`), else ""."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(n) for n in names], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_value(obj, part: str, key: str):
    if not dataclasses.is_dataclass(obj):
        raise ValueError(f"config key {key!r}: the part before {part!r} is a value, not a section")
    names = {f.name for f in dataclasses.fields(obj)}
    if part not in names:
        raise ValueError(f"unknown config key {key!r}: {part!r}{_did_you_mean(part, names)} is not one of "
                         f"{sorted(names)}")  # fmt: skip
    return getattr(obj, part)
