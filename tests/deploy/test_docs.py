"""The README stays a landing page and the reference in docs/ stays true to the code.

Every relative link in the README and the docs pages leads to a file (and to a heading, when it
names one), every file a page names in backticks exists, every docs page is reachable from the
README, and the settings page lists exactly the ``MOTOR_*`` variables the code reads (the
settings, the runtime's knobs and ``make run``'s options), with the defaults the code has.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A module path written in backticks: `serving/edge/asgi.py`.
MODULE_PATH = re.compile(r"`([\w.-]+(?:/[\w.-]+)+\.py)`")
# A file path written in backticks: a module, a script, a manifest, a lock, a page.
FILE_PATH = re.compile(r"`([\w.-]+(?:/[\w.-]+)+\.(?:py|md|sh|ya?ml|json|lua|toml|lock|in|txt|html))`")
# The pages cite files of vLLM's and vllm-ascend's trees too; those are not this repository's.
OTHER_TREES = ("vllm/", "vllm_ascend/", "examples/", "docs/source/", "../")  # "../": beside the checkout, not in it
# Pages name the data plane's modules from its package (`derender/session.py`) as well as from the root.
PIPELINE = ROOT / "serving" / "pipeline"
SETTINGS_ROW = re.compile(r"^\| ((?:`MOTOR_[A-Z0-9_]+`(?: / )?)+) \| ([^|]*) \|", re.M)
# A newcomer reads the README in five minutes; the reference lives in docs/.
README_MAX_LINES = 120


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_leads_to_a_file_and_heading() -> None:
    broken = []
    for page in PAGES:
        for target in _relative_links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _relative_links(ROOT / "README.md")}
    orphans = sorted(p.name for p in DOCS.glob("*.md") if p.resolve() not in linked)
    assert not orphans, f"link these from the README: {orphans}"


def test_every_module_the_lifecycle_page_names_exists() -> None:
    named = set(MODULE_PATH.findall((DOCS / "request-lifecycle.md").read_text()))
    assert len(named) >= 20  # the pattern found the page's paths
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/request-lifecycle.md names modules that do not exist: {missing}"


def test_every_file_a_page_names_exists() -> None:
    named = {(page, p) for page in PAGES for p in FILE_PATH.findall(page.read_text()) if not p.startswith(OTHER_TREES)}
    assert len(named) >= 150  # the pattern found the pages' paths
    missing = sorted(
        f"{page.relative_to(ROOT)}: {p}" for page, p in named if not ((ROOT / p).is_file() or (PIPELINE / p).is_file())
    )
    assert not missing, f"pages name files that do not exist: {missing}"


def test_the_layout_page_names_every_part_of_the_data_plane() -> None:
    """Each folder and module of ``serving/pipeline`` is on docs/layout.md's map (``apis/``,
    ``sse.py``), so a newcomer finds every piece of the data plane there."""
    tree = (DOCS / "layout.md").read_text().split("```")[1]
    block = tree[tree.index("serving/pipeline/"):tree.index("\nenginesim/")]
    parts = [p.name + ("/" if p.is_dir() else "") for p in sorted(PIPELINE.iterdir())
             if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.name != "__init__.py")]
    assert len(parts) > 20  # the walk found the package
    missing = [name for name in parts if not re.search(rf"(?<![\w/]){re.escape(name)}", block)]
    assert not missing, f"docs/layout.md's map of serving/pipeline/ does not name {missing}"


def test_the_readme_is_a_landing_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


# `make run`'s own options: each ``runstack`` argument whose default is read from a ``MOTOR_*`` variable.
RUNSTACK = ROOT / "motorsite" / "launcher" / "management" / "commands" / "runstack.py"


def _runstack_defaults() -> dict[str, object]:
    """``MOTOR_*`` name -> default of each ``os.environ.get`` that is an ``add_argument`` default in runstack."""
    found: dict[str, object] = {}
    for node in ast.walk(ast.parse(RUNSTACK.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        for keyword in node.keywords:
            for call in ast.walk(keyword.value) if keyword.arg == "default" else ():
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "get"
                        and call.args and isinstance(call.args[0], ast.Constant)
                        and str(call.args[0].value).startswith("MOTOR_")):
                    default = call.args[1].value if len(call.args) > 1 and isinstance(call.args[1], ast.Constant) else None
                    found[call.args[0].value] = int(default) if isinstance(default, str) and default.isdigit() else default
    return found


def test_it_reads_make_runs_options_from_runstack() -> None:
    assert {"MOTOR_PORT": 8000, "MOTOR_ENGINES": "vllm"}.items() <= _runstack_defaults().items()


def _defaults_read_by_the_code() -> dict[str, object]:
    """``MOTOR_*`` name -> default, for every ``env_*`` call in the settings, ``_knob`` in the runtime
    and ``make run``'s options (``_runstack_defaults``)."""
    found: dict[str, object] = _runstack_defaults()
    for path, callers in ((ROOT / "motorsite" / "settings.py", {"env_str", "env_int", "env_bool"}),
                          (ROOT / "serving" / "runtime.py", {"_knob"})):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in callers
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith("MOTOR_")):
                default: object = None
                if len(node.args) > 1:
                    try:
                        default = eval(compile(ast.Expression(node.args[1]), str(path), "eval"), {})  # noqa: S307
                    except NameError:
                        default = None  # a path built from another setting
                found[node.args[0].value] = default
    return found


def _documented_settings() -> dict[str, str]:
    """The settings page's table: name -> its default cell, one name per ``/``-joined part."""
    rows: dict[str, str] = {}
    for names, default in SETTINGS_ROW.findall((DOCS / "settings.md").read_text()):
        parts = [p.strip() for p in default.split(" / ")]
        for i, name in enumerate(re.findall(r"MOTOR_[A-Z0-9_]+", names)):
            rows[name] = parts[i] if len(parts) > i else default
    return rows


def test_the_settings_page_lists_every_setting_the_code_reads() -> None:
    read = _defaults_read_by_the_code()
    assert len(read) >= 30  # the parser found the calls
    missing = sorted(read.keys() - _documented_settings().keys())
    assert not missing, f"add rows to docs/settings.md for {missing}"


def test_the_settings_page_lists_no_setting_the_code_does_not_read() -> None:
    code = "\n".join(p.read_text() for d in ("motorsite", "serving", "fleet", "catalog") for p in (ROOT / d).rglob("*.py"))
    unknown = sorted(n for n in _documented_settings() if f'"{n}"' not in code)
    assert not unknown, f"docs/settings.md lists settings nothing reads: {unknown}"


def test_the_settings_page_gives_the_code_s_numeric_defaults() -> None:
    read = _defaults_read_by_the_code()
    wrong = []
    for name, cell in _documented_settings().items():
        default = read.get(name)
        if isinstance(default, bool) or not isinstance(default, (int, float)):
            continue
        first = re.match(r"\s*([0-9][0-9.]*)", cell)
        if first is None or float(first.group(1)) != float(default):
            wrong.append(f"{name}: page says {cell!r}, code {default}")
    assert not wrong, wrong
