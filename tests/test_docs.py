"""The documentation builds without a warning and documents every public name.

One full Sphinx build (``-W``: a warning, such as a broken reference or a docstring that
does not parse, fails it) into a temporary folder, or the one ``make docs`` has just made
when ``DAH_DOCS_BUILT`` names it (``make test`` does); the checks read its
``objects.inv`` (every documented object) and its pages.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import ddp_avg_hooks
from ddp_avg_hooks import hooks
from ddp_avg_hooks.options import AveragingOptions

pytest.importorskip("sphinx")
pytest.importorskip("myst_parser")

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs")]


# session-scoped: xdist runs other modules' tests between these on the same worker, and a
# module-scoped build would be torn down and made again (30 s of sphinx each time)
@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    # `make test` runs `make docs` (the same full build, -E) just before pytest and names
    # its output here, rather than have the suite build it again
    if os.environ.get("DAH_DOCS_BUILT"):
        out = Path(os.environ["DAH_DOCS_BUILT"])
        assert (out / "objects.inv").is_file(), f"DAH_DOCS_BUILT={out}: no build there"
        return out
    out = tmp_path_factory.mktemp("html")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
         str(ROOT / "docs"), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.fixture(scope="session")
def inventory(built) -> dict[str, str]:
    """Every object the build documents: ``{name: role}`` read from ``objects.inv``."""
    data = (built / "objects.inv").read_bytes()
    header = data.split(b"\n", 4)
    assert header[0] == b"# Sphinx inventory version 2"
    entries = {}
    for line in zlib.decompress(header[4]).decode().splitlines():
        name, role = line.split(" ", 2)[:2]
        entries[name] = role
    return entries


def _documented_name(package, name: str) -> str:
    """Where ``package.name`` is documented: the module that defines it."""
    obj = getattr(package, name)
    if inspect.ismodule(obj):
        return obj.__name__
    return f"{obj.__module__}.{obj.__qualname__}"


def _public_modules() -> list[str]:
    found = [m.name for m in pkgutil.walk_packages(ddp_avg_hooks.__path__, "ddp_avg_hooks.")]
    return ["ddp_avg_hooks"] + sorted(
        m for m in found if not any(p.startswith("_") for p in m.split(".")))


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def test_the_docs_tests_run_on_one_worker(request):
    # `make test` builds the docs once only if pytest-xdist keeps this module's
    # xdist_group on one worker; it marks the group's tests by their ids
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@docs"), (
            "pytest-xdist split the xdist_group 'docs' (and every other group) between "
            "workers: this pytest-xdist does not work with this pytest (pytest-xdist 3.8 "
            "needs pytest < 9.2); install the versions pyproject.toml's test extra names")


@pytest.mark.parametrize("package", [ddp_avg_hooks, hooks], ids=lambda p: p.__name__)
def test_every_public_name_is_documented_and_listed(package, built, inventory):
    page = (built / "api" / f"{package.__name__.removeprefix('ddp_avg_hooks.')}.html")
    listing = page.read_text()
    for name in package.__all__:
        documented = _documented_name(package, name)
        assert documented in inventory, f"{package.__name__}.{name} is not documented"
        assert f"#{documented}" in listing or f"#module-{documented}" in listing, \
            f"{page.name} does not list {name}"


def test_every_public_hook_function_is_documented(inventory):
    functions = [n for n in hooks.__all__ if inspect.isfunction(getattr(hooks, n))]
    assert "allreduce_hook" in functions and "outer_optimizer" in functions
    for name in functions:
        assert inventory.get(_documented_name(hooks, name)) == "py:function", name


def test_every_public_module_has_a_page(inventory):
    for module in _public_modules():
        assert inventory.get(module) == "py:module", f"{module} has no API page"


@pytest.mark.parametrize("package", [ddp_avg_hooks, hooks], ids=lambda p: p.__name__)
def test_public_classes_document_their_public_members(package, inventory):
    """Each public method and property a public class defines is in the reference (the
    bucket API a hook uses: ``ParamBucket.defer``, ``private_group``, ...)."""
    for name in package.__all__:
        cls = getattr(package, name)
        if not inspect.isclass(cls):
            continue
        importlib.import_module(cls.__module__)
        for attr, value in vars(cls).items():
            if attr.startswith("_") or not (callable(value) or isinstance(
                    value, (property, classmethod, staticmethod))):
                continue
            assert f"{cls.__module__}.{cls.__qualname__}.{attr}" in inventory, \
                f"{name}.{attr} is not documented (give it a docstring)"
    if package is ddp_avg_hooks:
        assert "ddp_avg_hooks.bucket.ParamBucket.defer" in inventory
        assert "ddp_avg_hooks.bucket.ParamBucket.private_group" in inventory


def test_options_page_shows_every_option_in_order(built):
    """The options page's table is generated from ``AveragingOptions``: one row per
    field, in declaration order, with its default."""
    page = (built / "guide" / "options.html").read_text()
    table = page[page.index("<table"):page.index("</table>")]
    rows = [_text_row(r) for r in re.findall(r"<tr.*?</tr>", table, flags=re.S)]
    assert rows[0] == ["option", "default", "meaning"]
    fields = dataclasses.fields(AveragingOptions)
    assert [r[0] for r in rows[1:]] == [f.name for f in fields]
    assert [r[1] for r in rows[1:]] == [repr(f.default) for f in fields]


def _text_row(row: str) -> list[str]:
    cells = re.findall(r"<t[hd].*?</t[hd]>", row, flags=re.S)
    return [html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in cells]


def test_guide_shows_the_readme_examples(built):
    """The guide includes the README's example and hook snippets (one source, which
    tests/test_readme.py runs)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    started = _text(built / "guide" / "getting-started.html")
    hook_page = _text(built / "guide" / "writing-a-hook.html")
    assert blocks[0].splitlines()[-1] in started and "AveragingHandle" in started
    assert "def mean_hook" in hook_page and "def my_delta_hook" in hook_page


def test_readme_links_point_at_existing_files():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"
