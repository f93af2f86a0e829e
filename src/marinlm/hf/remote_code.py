"""Assemble the export folder's flat `modeling_marin.py` from the reference model's own source.

There is one copy of the model to maintain: the modules of `marinlm.model` (and the typed-config
builder they rest on) are concatenated in dependency order, their `marinlm` imports dropped, and
the HF wrapper (hf/modeling_marin.py) appended. Every dropped import must name something an
earlier module defined, and no top-level name may be defined twice, so a new import in model/
that the assembly would miss fails the export, not the user's `from_pretrained`.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

# Dependency order: each module only imports from the ones above it.
SOURCE_MODULES = (
    "marinlm.config.typed",
    "marinlm.model.config",
    "marinlm.model.context",
    "marinlm.model.layers",
    "marinlm.model.attention",
    "marinlm.model.router",
    "marinlm.model.experts",
    "marinlm.model.moe",
    "marinlm.model.loss",
    "marinlm.model.transformer",
    "marinlm.hf.modeling_marin",
)
CONFIG_MODULE = "marinlm.hf.configuration_marin"

HEADER = '''"""Marin MoE transformer for `transformers` (trust_remote_code), written by `marinlm export`.

Self-contained readable PyTorch: the reference model of marinlm {version}, module by module, then
the HF wrapper MarinHFForCausalLM. Generated; edit marinlm's source, not this file.
"""

from __future__ import annotations

'''


def module_path(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ImportError(f"{name}: source not found")
    return Path(spec.origin)


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _strip_own_imports(source: str, module: str, defined: set[str]) -> tuple[str, list[str]]:
    """The module's source without `from __future__` and `from marinlm... import` statements, and
    the third-party import lines it keeps (hoisted to the top of the file)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    drop: set[int] = set()
    kept_imports: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (
            node.module == "__future__" or (node.module or "").startswith("marinlm")
        ):
            if node.module != "__future__":
                missing = [a.name for a in node.names if a.name not in defined]
                if missing and node.module != CONFIG_MODULE:
                    raise ImportError(
                        f"{module}: imports {missing} from {node.module}, which the export does not include"
                    )
            drop.update(range(node.lineno - 1, node.end_lineno))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.Import) and any(a.name.startswith("marinlm") for a in node.names):
                raise ImportError(f"{module}: `import marinlm...` cannot be assembled; use `from ... import`")
            kept_imports.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            drop.update(range(node.lineno - 1, node.end_lineno))
    body = "\n".join(line for i, line in enumerate(lines) if i not in drop)
    return body.strip() + "\n", kept_imports


def modeling_source(version: str = "") -> str:
    """The text of the exported modeling_marin.py."""
    defined: set[str] = set()
    imports: list[str] = []
    bodies: list[str] = []
    for module in SOURCE_MODULES:
        path = module_path(module)
        source = path.read_text()
        body, kept = _strip_own_imports(source, module, defined)
        names = _top_level_names(ast.parse(source))
        clash = sorted(names & defined)
        if clash:
            raise ValueError(f"{module}: defines {clash} again; the flat export needs each top-level name once")
        defined |= names
        imports += [line for line in kept if line not in imports]
        rel = "/".join(module.split(".")[1:]) + ".py"
        bodies.append(f"# {'-' * 30} marinlm/{rel} {'-' * 30}\n\n{body}")
    imports.append("from .configuration_marin import MarinHFConfig")
    text = HEADER.format(version=version) + "\n".join(imports) + "\n\n\n" + "\n\n".join(bodies)
    compile(text, "modeling_marin.py", "exec")  # a syntax error here, not in the user's load
    return text


def configuration_source() -> str:
    return module_path(CONFIG_MODULE).read_text()
