"""Typed configs: `@dataclass(kw_only=True)` trees built strictly from plain mappings, and back.

Every component owns a `@dataclass(kw_only=True)` config. A run config nests them. Building one
is strict: an unknown key, a wrong type or an impossible value raises `ConfigError` naming the
dotted key and what would be valid.

Variants (routers, schedules, ...) subclass a `Choice` base and are picked with a `type:` key,
Levanter/draccus style:

    @RouterConfig.register("qb")
    @dataclass(kw_only=True)
    class QBRouterConfig(RouterConfig): ...

A config class checks combinations in `__post_init__` with `check(cond, key, message)`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config value. The message starts with the dotted key that is wrong."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.reason = message
        super().__init__(f"{key}: {message}" if key else message)

    def under(self, prefix: str) -> ConfigError:
        key = f"{prefix}.{self.key}" if self.key else prefix
        return ConfigError(key, self.reason)


class Choice:
    """Base for a config with registered variants, selected in YAML by `type: name`."""

    _variants: ClassVar[dict[str, type]]
    type_name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if Choice in cls.__bases__:
            cls._variants = {}

    @classmethod
    def register(cls, name: str):
        def wrap(sub: type[T]) -> type[T]:
            if name in cls._variants:
                raise ValueError(f"{cls.__name__} variant {name!r} registered twice")
            sub.type_name = name
            cls._variants[name] = sub
            return sub

        return wrap

    @classmethod
    def variants(cls) -> dict[str, type]:
        return dict(cls._variants)


def did_you_mean(name: str, choices, what: str = "") -> str:
    """ "; did you mean 'x'?" for the closest of `choices` to a misspelt `name` (`what` put before
    it, a folder say), or ""."""
    import difflib

    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {what + close[0]!r}?" if close else ""


def check(condition: bool, key: str, message: str) -> None:
    """Raise ConfigError(key, message) unless condition holds. For use in `__post_init__`."""
    if not condition:
        raise ConfigError(key, message)


def _choice_base(tp: Any) -> type | None:
    if isinstance(tp, type) and issubclass(tp, Choice) and Choice in tp.__bases__:
        return tp
    return None


def is_config_class(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) or (isinstance(tp, type) and issubclass(tp, Choice))


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`, converting where it is lossless."""
    origin = get_origin(tp)
    if isinstance(value, YamlScalar):
        if tp is str or tp is Path:  # `run_dir: 007`, the language code `no`: the text as written
            return _coerce(value.text, tp, key)
        if origin is Literal:  # `mode: off` where the options are words: the word
            words = value.value not in get_args(tp) and all(isinstance(a, str) for a in get_args(tp))
            value = value.text if words else value.value
        elif origin not in (typing.Union, types.UnionType):  # a union tries each option with both
            value = value.value
    if tp is Any:
        return plain(value)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(key, f"must not be null; expected {_type_name(tp)}")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(e.reason)
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r} ({'; '.join(errors)})")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(key, f"must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if isinstance(value, dict) and value and all(map(is_index, value)):
            raise ConfigError(
                key,
                f"item overrides ({key}.{next(iter(value))}=...) edit a list the config file sets; "
                f"this one is not set there: give the whole list, e.g. --{key}='[...]'",
            )
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(key, f"expected {len(args)} items, got {len(value)}")
            items = [_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item_type = args[0] if args else Any
            items = [_coerce(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}")
        key_type, value_type = get_args(tp) or (Any, Any)
        return {_coerce(k, key_type, key): _coerce(v, value_type, f"{key}.{k}") for k, v in value.items()}
    if is_config_class(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _number(value) if isinstance(value, str) else value  # `1e5`: see float below
        if isinstance(number, float) and number.is_integer():
            return int(number)
        raise ConfigError(key, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # PyYAML reads `3e-4` (no dot) as a string; accept any string Python reads as a float.
        if isinstance(value, str) and (number := _number(value)) is not None:
            return number
        raise ConfigError(key, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, f"expected a string, got {value!r}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(key, f"expected a path, got {value!r}")
    raise ConfigError(key, f"unsupported config type {_type_name(tp)}")


def _number(text: str) -> float | None:
    """The float Python reads in `text`, or None."""
    try:
        return float(text)
    except ValueError:
        return None


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build config `cls` from a plain mapping, strictly. Errors name the dotted key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a mapping for {cls.__name__}, got {data!r}")
    base = _choice_base(cls)
    if base is not None or (isinstance(cls, type) and issubclass(cls, Choice) and "type" in data):
        base = base or next(b for b in cls.__mro__ if _choice_base(b))
        data = dict(data)
        name = data.pop("type", cls.type_name or None)
        name = name.text if isinstance(name, YamlScalar) else name  # variant names are words
        if name not in base._variants:
            raise ConfigError(join_key(prefix, "type"), f"must be one of {sorted(base._variants)}, got {name!r}")
        cls = base._variants[name]
    if hasattr(cls, "older_keys"):  # keys that files written by older versions kept elsewhere
        data = cls.older_keys(data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            join_key(prefix, unknown[0]),
            f"unknown key for {cls.__name__}; valid keys: {sorted(fields)}{did_you_mean(unknown[0], fields)}",
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], join_key(prefix, name))
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(join_key(prefix, missing[0]), f"required key missing for {cls.__name__}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise (e.under(prefix) if prefix else e) from None


def is_index(key: Any) -> bool:
    return (isinstance(key, int) and not isinstance(key, bool)) or (isinstance(key, str) and key.isdecimal())


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def to_dict(config: Any) -> Any:
    """Plain, YAML-safe view of a config tree; `from_dict(type(c), to_dict(c)) == c`."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        out: dict[str, Any] = {}
        if isinstance(config, Choice):
            out["type"] = config.type_name
        for f in dataclasses.fields(config):
            if f.init:
                out[f.name] = to_dict(getattr(config, f.name))
        return out
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    if isinstance(config, Path):
        return str(config)
    return config


class YamlScalar:
    """A YAML scalar that reads as a bool, an integer, a number or a date, with the text it was written as.

    YAML 1.1 reads `no` (Norwegian's language code) as false and `007` as 7. Where the config
    field is a string, the text is what was meant; every other field takes the value.
    """

    __slots__ = ("value", "text")

    def __init__(self, value: Any, text: str):
        self.value, self.text = value, text

    def __eq__(self, other):
        return self.value == (other.value if isinstance(other, YamlScalar) else other)

    def __hash__(self):
        return hash(self.value)

    def __repr__(self):
        return repr(self.value)


def plain(value: Any) -> Any:
    """`value` with every `YamlScalar` in it replaced by its value."""
    if isinstance(value, YamlScalar):
        return value.value
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
