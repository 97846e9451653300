"""The front door and the manual stay whole: every relative link in README.md and docs/*.md names a file of
the repository, the README stays short (house rule 13), and its test command is the one .ci/run runs."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# [text](target) or ![alt](target); the target ends at whitespace or ')' (a title after it is ignored)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def relative_links(page: Path) -> list[str]:
    """The page's link targets that name a file of the repository (no scheme, not a bare #anchor), without
    their #anchor; links inside code blocks and code spans are code, not links."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_name_existing_files(page):
    # the README was split into docs/ pages (house rule 13): a link to a moved or renamed page must not dangle
    broken = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not broken, f"{page.relative_to(REPO)} links to missing files: {broken}"


def test_link_check_sees_links():
    # guards the check itself: a pattern that matched nothing would pass every page
    assert "docs/python.md" in relative_links(REPO / "README.md")


def test_readme_is_short():
    # house rule 13: the README is the front door (under ~120 lines); the manual lives in docs/
    n_lines = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n_lines <= 120, f"README.md has {n_lines} lines; move detail into docs/"


def test_readme_test_command_is_what_ci_runs():
    # .ci/run says "keep the two identical": the README's test command is the line CI runs
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    marker = next(i for i, line in enumerate(ci) if "keep the two identical" in line)
    command = ci[marker + 1].strip()
    assert command.startswith("pip install ") and command.endswith("python -m pytest -v")
    readme_lines = [line.strip() for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines()]
    assert command in readme_lines
