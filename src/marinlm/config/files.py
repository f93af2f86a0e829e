"""Configs from YAML files and `--a.b=c` command-line overrides, and back to YAML.

A run's YAML file mirrors its config tree. A sub-config may be another file (`model:
../model/tiny.yaml`), edited in place (`model: {include: ../model/tiny.yaml, num_layers: 2}`), and
a file may `include:` others. Overrides edit any key, or one item of a list (`--data.sources.0.path`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml

from marinlm.config.typed import (
    ConfigError,
    YamlScalar,
    did_you_mean,
    from_dict,
    is_config_class,
    is_index,
    join_key,
    plain,
    to_dict,
)
from marinlm.utils.io import write_text_atomic

T = TypeVar("T")


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


def file_sections(tree: dict[str, Any], prefix: tuple = ()) -> list[tuple]:
    """Paths in parsed overrides whose value names a YAML file (or includes one)."""
    paths = []
    for key, value in tree.items():
        if _is_yaml_ref(value) or (isinstance(value, dict) and _is_yaml_ref(value.get("include"))):
            paths.append((*prefix, key))
        elif isinstance(value, dict):
            paths += file_sections(value, (*prefix, key))
    return paths


def _get_path(tree: dict[str, Any], path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set_path(tree: dict[str, Any], path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _is_yaml_ref(value: Any) -> bool:
    return isinstance(value, str) and value.endswith((".yaml", ".yml"))


def merge(base: dict[str, Any], update: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Recursive dict merge; `update` wins. A changed `type:` replaces the whole subtree.

    A mapping with integer keys over a list edits its items, as `--data.sources.0.weight=0.5` does;
    the key one past the end appends an item.
    """
    out = dict(base)
    for key, value in update.items():
        name = join_key(prefix, str(key))
        if isinstance(value, dict) and isinstance(out.get(key), list) and value and all(map(is_index, value)):
            out[key] = _merge_items(out[key], value, name)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            if "type" in value and value["type"] != out[key].get("type"):
                out[key] = value
            else:
                out[key] = merge(out[key], value, name)
        else:
            out[key] = value
    return out


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
    ("timestamp", yaml.SafeLoader.construct_yaml_timestamp),  # `run_dir: runs/2026-11-30` is a path
):
    _StrictLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _keep_text(_construct))


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping with `safe_load`, resolving `include:` (a path or list, relative to the file)."""
    path = Path(path)
    if path.is_dir():  # a run or checkpoint folder, say: its config.yaml is the file meant
        inside = f"; its config file is {path / 'config.yaml'}" if (path / "config.yaml").is_file() else ""
        raise ConfigError("", f"{path} is a folder, not a config file{inside}")
    if not path.is_file():
        from marinlm.presets import shipped_configs

        shipped = shipped_configs()
        given = str(Path(*path.parts[1:])) if path.parts[:1] == ("configs",) else str(path)
        hint = did_you_mean(given, shipped, "configs/")
        raise ConfigError("", f"config file not found: {path} (shipped configs: {', '.join(shipped)}){hint}")
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
        included = _find_ref(inc, path.parent)
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
        sub = next((a for a in (get_args(tp) or (tp,)) if is_config_class(a)), None)
        if sub is None:
            continue
        try:
            out[key] = _resolve_sub_config(value, base_dir, sub, tp, key)
        except ConfigError as e:
            raise e.under(key) from None
    return out


def _resolve_sub_config(value: Any, base_dir: Path, cls: type, tp: Any, section: str) -> Any:
    if _is_yaml_ref(value):
        return _read_sub_config(value, base_dir, cls, section)
    if isinstance(value, dict) and _is_yaml_ref(value.get("include")):
        rest = {k: v for k, v in value.items() if k != "include"}
        return merge(_read_sub_config(value["include"], base_dir, cls, section), resolve_file_refs(rest, base_dir, cls))
    if isinstance(value, dict):
        return resolve_file_refs(value, base_dir, cls)
    if isinstance(value, str) and typing.get_origin(tp) in (None, typing.Union, types.UnionType):
        # (not in a list or dict of sub-configs, whose own error says what was expected)
        raise ConfigError(
            "",
            f"expected a mapping, or a YAML file's path ending in .yaml (e.g. ../model/tiny.yaml, or a shipped "
            f"config as configs/model/tiny.yaml from any folder), got {value!r}",
        )
    return value


def _find_ref(name: str, base_dir: Path) -> Path:
    """The YAML file that `name` refers to: relative to `base_dir` (the naming file's folder, or the
    working folder for an override); else, as for a top-level config, the shipped copy
    (`configs/model/small.yaml` from any folder with a plain `pip install`)."""
    from marinlm.presets import shipped_config

    ref = Path(name)
    ref = ref if ref.is_absolute() else base_dir / ref
    if ref.is_file():
        return ref
    # A copy of a shipped config elsewhere still names its siblings as the shipped tree lays them
    # out (`../model/tiny.yaml` from configs/train/): those are the shipped ones.
    sibling = Path(*[part for part in Path(name).parts if part != ".."]) if not Path(name).is_absolute() else None
    return shipped_config(name) or (shipped_config(sibling) if sibling and sibling.parts else None) or ref


def _read_sub_config(name: str, base_dir: Path, cls: type, section: str) -> dict[str, Any]:
    """The file's mapping; from a whole config holding the section (a run's config.yaml for
    `--model=RUN/config.yaml`), that section."""
    ref = _find_ref(name, base_dir)
    data = read_yaml(ref)
    if section in data and section not in _field_names(cls):
        return _resolve_sub_config(data[section], ref.parent, cls, cls, section)
    return resolve_file_refs(data, ref.parent, cls)


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None, kinds=None) -> T:
    """Load `cls` from a YAML file (optional) plus command-line overrides.

    Args:
        cls: the config dataclass to build.
        path: YAML file mirroring `cls`; sub-configs may be given as paths to other YAML files.
        overrides: `--a.b=c` strings applied on top.
        kinds: (config class, description) of each command, to say what a file given to the wrong
            command is (marinlm.commands.config_kinds()); None gives no such hint.
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
            resolved = resolve_file_refs(over, Path.cwd(), cls)
            data = merge(data, resolved)
            # A file given for a section replaces it (`--model=FILE` is that file's model, not the
            # base's with the file's keys merged in); `--model=FILE --model.x=y` is that file, edited.
            for section in file_sections(over):
                _set_path(data, section, _get_path(resolved, section))
        except ConfigError as e:
            raise ConfigError(e.key, e.reason + " (set on the command line)") from None
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        where = origin(e.key, over, path)
        from_file = path is not None and not _overridden(over, e.key)
        if from_file and e.key in data and e.key not in _field_names(cls) and (kind := _config_kind(data, kinds)):
            where += f"; that file is {kind}, not a {cls.__name__}"
        raise ConfigError(e.key, e.reason + where) from None


def origin(key: str, overrides: dict[str, Any], path: str | Path | None) -> str:
    """Where the value of a config error's `key` came from, for its message: the command line
    (`overrides` as parse_overrides returns them), or the file."""
    if _overridden(overrides, key):
        return " (set on the command line)"
    if path is None:
        return ""
    return f" (in {path}" + (", with the command-line overrides)" if overrides else ")")


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _config_kind(data: dict[str, Any], kinds) -> str | None:
    """What a config file whose top-level keys are all another command's is: a hint for a file
    given to the wrong command (a curation config to `marinlm train`). `kinds` are the commands'
    (config class, description) pairs, from the caller (marinlm.commands)."""
    for cls, kind in kinds or ():
        if data and set(data) <= _field_names(cls):
            return kind
    return None


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
