"""The package's layers, read from its source: imports point down, names stay private.

* core modules (everything outside ``hooks/`` and ``integrations/``) never import
  ``hooks/``;
* hooks import only the layers below them (never the registry, the handle, the round
  engine, options or checkpoints);
* no module imports another module's ``_private`` name (a name a second module needs
  is API: it is public);
* no module reads another object's ``_private`` attribute through ``bucket._x`` /
  ``handle._x`` / ``state._x``;
* the docs' Layout table (``docs/guide/layout.md``) lists every module, every public
  module has an API page, and the options page shows the table ``AveragingOptions``
  generates (``tests/test_docs.py`` checks the built pages).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from ddp_avg_hooks.options import markdown_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ddp_avg_hooks"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "csrc" not in p.parts)


def _name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imports(path: pathlib.Path):
    """``(module imported, names imported)`` for every import in ``path``, resolved."""
    tree = ast.parse(path.read_text())
    package = _name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _name(path)
    if path.name == "__init__.py":
        package = _name(path).removesuffix(".__init__")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "ddp_avg_hooks":
        return "outside"
    return parts[1] if len(parts) > 1 and parts[1] in ("hooks", "integrations") else "core"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_imports_point_down(path):
    me = _layer(_name(path))
    for module, _ in _imports(path):
        layer = _layer(module)
        if me == "core" and _name(path) != "ddp_avg_hooks.__init__":
            assert layer not in ("hooks", "integrations"), f"{_name(path)} imports {module}"
        if me == "hooks":
            assert module.split(".")[1:2] not in (["registry"], ["handle"], ["rounds"],
                                                 ["options"], ["checkpoint"], ["integrations"]), \
                f"{_name(path)} imports {module}"


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_imports_another_modules_private_name(path):
    for module, names in _imports(path):
        if module.startswith("ddp_avg_hooks"):
            # a private *module* of a package (ops' implementations) is not a private name
            folder = ROOT.joinpath(*module.split("."))
            private = [n for n in names if n.startswith("_") and not n.startswith("__")
                       and not (folder / f"{n}.py").exists()]
            assert not private, f"{_name(path)} imports {private} from {module}"


_CROSS = re.compile(r"\b(bucket|b|handle|engine|state|storage|rnd|pending|record)\._[a-z]\w*")


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_reads_private_attributes_of_other_objects(path):
    hits = [line.strip() for line in path.read_text().splitlines()
            if _CROSS.search(line) and not line.strip().startswith("#")]
    assert not hits, f"{_name(path)}: {hits}"


LAYOUT_PAGE = ROOT / "docs" / "guide" / "layout.md"


def test_layout_page_lists_every_module():
    table = [line for line in LAYOUT_PAGE.read_text().splitlines() if line.startswith("| `")]
    listed = set(re.findall(r"`([\w/]+\.py)`", "\n".join(table)))
    for path in MODULES:
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.endswith("__init__.py"):
            continue
        assert rel in listed or path.name in listed, f"{LAYOUT_PAGE.name} does not list {rel}"
    for name in listed:
        assert any(p.relative_to(PACKAGE).as_posix() == name or p.name == name
                   for p in MODULES), f"{LAYOUT_PAGE.name} lists {name}, which does not exist"


def test_every_public_module_has_an_api_page():
    pages = {module for page in (ROOT / "docs" / "api").glob("*.rst")
             for module in re.findall(r"^\.\. automodule:: (\S+)$", page.read_text(), flags=re.M)}
    modules = {_name(p).removesuffix(".__init__") for p in MODULES}
    public = {m for m in modules if not any(part.startswith("_") for part in m.split(".")[1:])}
    assert public - pages == set(), "modules without an API page in docs/api"
    assert pages - public == set(), "API pages of modules that do not exist or are private"


def test_options_table_is_generated_into_the_docs():
    """The options page renders ``markdown_table()`` at build time (the ``options-table``
    directive of docs/conf.py); nothing holds a hand-copied table to drift."""
    page = (ROOT / "docs" / "guide" / "options.md").read_text()
    assert "```{options-table}\n```" in page
    header = markdown_table().splitlines()[0]
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        assert header not in path.read_text(), f"{path.name} holds a copy of the options table"
