"""Typed configs (`typed.py`: dataclass trees built strictly from mappings) loaded from YAML files
with `--a.b=c` command-line overrides (`files.py`), and saved back."""

from marinlm.config.files import dump_config, load_config, merge, parse_overrides, read_yaml, save_config
from marinlm.config.typed import Choice, ConfigError, check, from_dict, to_dict

__all__ = [
    "Choice",
    "ConfigError",
    "check",
    "dump_config",
    "from_dict",
    "load_config",
    "merge",
    "parse_overrides",
    "read_yaml",
    "save_config",
    "to_dict",
]
