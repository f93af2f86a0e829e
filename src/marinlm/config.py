"""Typed configs: dataclasses that load from YAML, take `--a.b=c` overrides, and save back.

Every component owns a `@dataclass(kw_only=True)` config. A run config nests them, and its YAML
file mirrors the tree. Loading is strict: an unknown key, a wrong type or an impossible value
raises `ConfigError` naming the dotted key and what would be valid.

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

import yaml

from marinlm.utils.io import write_text_atomic

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


def check(condition: bool, key: str, message: str) -> None:
    """Raise ConfigError(key, message) unless condition holds. For use in `__post_init__`."""
    if not condition:
        raise ConfigError(key, message)


def _choice_base(tp: Any) -> type | None:
    if isinstance(tp, type) and issubclass(tp, Choice) and Choice in tp.__bases__:
        return tp
    return None


def _is_config_class(tp: Any) -> bool:
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
        if origin is Literal and value.value not in get_args(tp) and value.text in get_args(tp):
            return value.text
        if origin not in (typing.Union, types.UnionType):  # a union tries each option with both
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
        if isinstance(value, dict) and value and all(map(_is_index, value)):
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
    if _is_config_class(tp):
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
        if name not in base._variants:
            raise ConfigError(_join(prefix, "type"), f"must be one of {sorted(base._variants)}, got {name!r}")
        cls = base._variants[name]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(_join(prefix, unknown[0]), f"unknown key for {cls.__name__}; valid keys: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], _join(prefix, name))
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(_join(prefix, missing[0]), f"required key missing for {cls.__name__}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise (e.under(prefix) if prefix else e) from None


def _join(prefix: str, name: str) -> str:
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


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn `["--optim.lr=3e-4", "--model.moe.top_k", "2"]` into a nested mapping."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError("", f"override {arg!r} must look like --key.sub=value")
        body = arg[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, raw = body, args[i + 1]
            i += 1
        else:
            raise ConfigError(body, "override has no value; write --key=value")
        try:
            value = yaml.load(raw, Loader=_StrictLoader) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(key, f"not a YAML value: {raw!r} ({str(e).splitlines()[0]})") from None
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            if _is_yaml_ref(node.get(part)):  # `--model=x.yaml --model.vocab_size=4096`: that file, edited
                node[part] = {"include": node[part]}
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(key, "conflicts with another override")
        if _is_yaml_ref(value) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]]["include"] = value  # the same, given the other way round
        else:
            node[parts[-1]] = value
        i += 1
    return tree


def _is_yaml_ref(value: Any) -> bool:
    return isinstance(value, str) and value.endswith((".yaml", ".yml"))


def merge(base: dict[str, Any], update: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Recursive dict merge; `update` wins. A changed `type:` replaces the whole subtree.

    A mapping with integer keys over a list edits its items, as `--data.sources.0.weight=0.5` does;
    the key one past the end appends an item.
    """
    out = dict(base)
    for key, value in update.items():
        name = _join(prefix, str(key))
        if isinstance(value, dict) and isinstance(out.get(key), list) and value and all(map(_is_index, value)):
            out[key] = _merge_items(out[key], value, name)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            if "type" in value and value["type"] != out[key].get("type"):
                out[key] = value
            else:
                out[key] = merge(out[key], value, name)
        else:
            out[key] = value
    return out


def _is_index(key: Any) -> bool:
    return (isinstance(key, int) and not isinstance(key, bool)) or (isinstance(key, str) and key.isdecimal())


def _merge_items(items: list, update: dict, key: str) -> list:
    """`items` with `update[i]` merged into item i; i == len(items) appends (in index order)."""
    out = list(items)
    for index in sorted(update, key=int):
        i, value = int(index), update[index]
        if i > len(out):
            raise ConfigError(
                f"{key}.{i}", f"no such item: the list has {len(out)}, so the index must be 0..{len(out)} (= append)"
            )
        if i == len(out):
            out.append(value)
        elif isinstance(value, dict) and isinstance(out[i], dict):
            out[i] = merge(out[i], value, f"{key}.{i}")
        else:
            out[i] = value
    return out


class YamlScalar:
    """A YAML scalar that reads as a bool, an integer or a number, with the text it was written as.

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


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (PyYAML keeps the last in
    silence), and reads bools, integers and numbers as `YamlScalar`s (mapping keys stay plain)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} given twice (first on line {seen[key]}, again on line {line})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return {plain(k): v for k, v in super().construct_mapping(node, deep=deep).items()}


def _keep_text(construct):
    return lambda loader, node: YamlScalar(construct(loader, node), node.value)


for _tag, _construct in (
    ("bool", yaml.SafeLoader.construct_yaml_bool),
    ("int", yaml.SafeLoader.construct_yaml_int),
    ("float", yaml.SafeLoader.construct_yaml_float),
):
    _StrictLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _keep_text(_construct))


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with `safe_load`, resolving `include:` (a path or list, relative to the file)."""
    path = Path(path)
    if not path.is_file():
        from marinlm.presets import shipped_configs

        raise ConfigError("", f"config file not found: {path} (shipped configs: {', '.join(shipped_configs())})")
    try:
        with path.open(encoding="utf-8") as f:  # a stream, so YAML's own messages name the file
            data = yaml.load(f, Loader=_StrictLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path}: invalid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError("", f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: top level must be a mapping, got {type(data).__name__}")
    includes = data.pop("include", [])
    includes = [includes] if isinstance(includes, str) else includes
    merged: dict[str, Any] = {}
    for inc in includes:
        included = path.parent / inc
        merged = merge(merged, _rebase_file_refs(read_yaml(included), included.parent))
    return merge(merged, data)


def _rebase_file_refs(value: Any, base_dir: Path) -> Any:
    """An included file's relative `*.yaml` references, made absolute from that file's folder: they are
    relative to the file that names them, not to the file that includes it."""
    if isinstance(value, dict):
        return {k: _rebase_file_refs(v, base_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebase_file_refs(v, base_dir) for v in value]
    if isinstance(value, str) and value.endswith((".yaml", ".yml")) and not Path(value).is_absolute():
        return str(base_dir / value)
    return value


def resolve_file_refs(data: dict[str, Any], base_dir: Path, cls: type) -> dict[str, Any]:
    """A string where a sub-config is expected names a YAML file: `model: ../model/tiny.yaml`.

    A mapping there may name one with `include:` and change some of its keys:
    `model: {include: ../model/tiny.yaml, vocab_size: 4096}`.
    """
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    if not hints:
        return data
    out = dict(data)
    for key, value in data.items():
        tp = hints.get(key)
        sub = next((a for a in (get_args(tp) or (tp,)) if _is_config_class(a)), None)
        if sub is None:
            continue
        if _is_yaml_ref(value):
            out[key] = _read_sub_config(value, base_dir, sub, key)
        elif isinstance(value, dict) and _is_yaml_ref(value.get("include")):
            rest = {k: v for k, v in value.items() if k != "include"}
            out[key] = merge(
                _read_sub_config(value["include"], base_dir, sub, key), resolve_file_refs(rest, base_dir, sub)
            )
        elif isinstance(value, dict):
            out[key] = resolve_file_refs(value, base_dir, sub)
    return out


def _read_sub_config(name: str, base_dir: Path, cls: type, key: str) -> dict[str, Any]:
    ref = Path(name)
    ref = ref if ref.is_absolute() else base_dir / ref
    try:
        return resolve_file_refs(read_yaml(ref), ref.parent, cls)
    except ConfigError as e:
        raise e.under(key) from None


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Load `cls` from a YAML file (optional) plus command-line overrides.

    Args:
        cls: the config dataclass to build.
        path: YAML file mirroring `cls`; sub-configs may be given as paths to other YAML files.
        overrides: `--a.b=c` strings applied on top.
    """
    from marinlm.presets import find_config

    data: dict[str, Any] = {}
    base_dir = Path.cwd()
    if path is not None:
        path = find_config(path)
        data = read_yaml(path)
        base_dir = path.parent
    data = resolve_file_refs(data, base_dir, cls)
    over: dict[str, Any] = {}
    if overrides:
        over = parse_overrides(overrides)
        try:
            data = merge(data, resolve_file_refs(over, Path.cwd(), cls))
        except ConfigError as e:
            raise ConfigError(e.key, e.reason + " (set on the command line)") from None
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        if _overridden(over, e.key):
            where = " (set on the command line)"
        elif path is not None:
            where = f" (in {path}" + (", with the command-line overrides)" if over else ")")
        else:
            where = ""
        raise ConfigError(e.key, e.reason + where) from None


def _overridden(tree: dict[str, Any], key: str) -> bool:
    """Whether the dotted `key`, or a section above it, was given as a command-line override."""
    node: Any = tree
    # "sources[0].weight": the override set the whole list, or item 0 of it (--sources.0.weight=...)
    for part in key.replace("[", ".").replace("]", "").split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
        if not isinstance(node, dict):
            return True
    return bool(key)


def save_config(config: Any, path: str | Path) -> None:
    """Write a resolved config as YAML; `load_config(type(config), path)` reads it back equal."""
    write_text_atomic(path, dump_config(config))


def dump_config(config: Any) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
