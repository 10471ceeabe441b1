"""The README and the documentation pages hold together: links resolve, every page is on the site,
every included table exists, and the README's set-up command is the one CI runs.

(`mkdocs build --strict` in .ci/run checks the site's own links, anchors and API references; the
README is not part of the site, so its links are checked here.)
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"', re.MULTILINE)


def _strip_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _strip_code(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", _strip_code_blocks(text))


def _anchors(markdown: str) -> set[str]:
    """GitHub/MkDocs-style slugs of the headings of a page."""
    slugs = set()
    for heading in re.findall(r"^#+\s+(.*)$", _strip_code_blocks(markdown), flags=re.MULTILINE):
        text = re.sub(r"[`*_]", "", heading).strip().lower()
        slugs.add(re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", text)))
    return slugs


def _broken_links(page: Path) -> list[str]:
    text = page.read_text()
    broken = []
    for target in LINK.findall(_strip_code(text)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    return broken


def test_readme_and_docs_links_resolve():
    pages = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = [b for page in pages for b in _broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_page_is_in_the_site_navigation_and_every_included_table_exists():
    config = (REPO / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?([\w./-]+\.md)\s*$", config, flags=re.MULTILINE))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"mkdocs.yml's nav names missing pages: {sorted(nav - pages)}"
    for page in DOCS.glob("*.md"):
        for included in SNIPPET.findall(page.read_text()):
            assert (REPO / included.partition(":")[0]).exists(), f"{page.name} includes missing {included}"


def test_readme_setup_is_the_one_ci_runs():
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text()
    installs = re.findall(r"^python3 -m venv \.venv && .*$", readme, flags=re.MULTILINE)
    assert len(installs) == 2, "README: the user install and the set-up command (python3 -m venv .venv && ...)"
    user, setup = installs
    assert setup in ci.splitlines(), f".ci/run does not run the README's set-up command:\n{setup}"
    for line in installs:  # the CPU build of torch first, or pip pulls the CUDA wheels
        assert line.index("torch==2.13.0") < line.index("-e "), line
    assert user.endswith("pip install -e ."), user
    apt = re.search(r"apt-get install -y ([\w .+-]+)$", readme, flags=re.MULTILINE)
    assert apt, "README: the apt-get install line is missing"
    ci_apt = re.search(r"apt-get install -y -qq ([\w .+-]+)$", ci, flags=re.MULTILINE)
    assert ci_apt and set(apt.group(1).split()) == set(ci_apt.group(1).split()), \
        "README and .ci/run install different system packages"
    assert "mkdocs build --strict" in readme and "mkdocs build --strict" in ci


def test_readme_test_commands_are_the_ones_ci_runs():
    """The suite's command (the first ``.venv/bin/python -m pytest`` of the README) and the breakage check
    run in .ci/run as the README writes them."""
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text().splitlines()
    suite = re.search(r"^(\.venv/bin/python -m pytest[^#\n]*?)\s*(#.*)?$", readme, flags=re.MULTILINE)
    assert suite, "README: the test command (.venv/bin/python -m pytest ...) is missing"
    assert suite.group(1) in ci, f".ci/run does not run the README's test command:\n{suite.group(1)}"
    assert ".venv/bin/python -m tests.breakage.run" in readme and ".venv/bin/python -m tests.breakage.run" in ci


def test_readme_docs_and_package_cite_no_issue_numbers_or_dates():
    """Issue numbers belong in the tracker and history in git: neither the README, the hand-written docs
    pages nor the package's code, docstrings and comments name an issue or a date (the generated pages
    in docs/generated/ are stamped with the date of their run, which is what they are)."""
    issue, date = re.compile(r"\bissues? #?\d+", re.IGNORECASE), re.compile(r"\b20\d\d-\d\d-\d\d\b")
    files = [REPO / "README.md", *(p for p in DOCS.rglob("*.md") if "generated" not in p.parts),
             *(REPO / "pyro2pfp").rglob("*.py")]
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if issue.search(line) or date.search(line)]
    assert not found, "\n".join(found)


def test_public_functions_document_their_parameters_in_one_style():
    """One docstring style (numpy) in the package: no Google ``Args:`` sections or Sphinx ``:param:``
    fields; every public function of ``pyro2pfp`` has a docstring whose Parameters section names each
    of its parameters."""
    import ast
    import inspect

    import pyro2pfp

    offenders = []
    for path in (REPO / "pyro2pfp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node) or ""
                if re.search(r"^\s*(Args|Arguments|Keyword Args):\s*$|:param \w+:", doc, flags=re.MULTILINE):
                    offenders.append(f"{path.relative_to(REPO)}:{getattr(node, 'name', '<module>')}")
    assert not offenders, f"Google- or Sphinx-style docstrings (the package uses numpy style): {offenders}"

    missing = []
    for name in pyro2pfp.__all__:
        obj = getattr(pyro2pfp, name)
        if not inspect.isfunction(obj):
            assert obj.__doc__, f"pyro2pfp.{name} has no docstring"
            continue
        doc = inspect.getdoc(obj) or ""
        params = [p for p in inspect.signature(obj).parameters if p != "self"]
        section = re.search(r"^Parameters\n-{10}\n(.*?)(?:^\S[^\n]*\n-{3,}\n|\Z)", doc, flags=re.MULTILINE | re.DOTALL)
        named = set()
        if section:
            for line in section.group(1).splitlines():
                if line and not line.startswith(" "):
                    named.update(part.strip() for part in line.split(","))
        missing += [f"pyro2pfp.{name}({p})" for p in params if p not in named]
    assert not missing, f"parameters missing from a Parameters section: {missing}"
