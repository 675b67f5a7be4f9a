"""The documentation holds together: section references resolve, links resolve, the README stays short.

- every "§N" (or "§N.M") in the repository's .py and .md files names a `## N.` section of docs/design.md (a markdown
  file with numbered sections of its own, such as examples/SCALE.md, refers to those);
- every relative markdown link in README.md, CHANGELOG.md, docs/ and examples/ points at a file that exists, and its
  #anchor, if any, at a heading of that file;
- README.md is at most 200 lines and 12 KB;
- nothing refers to a top-level design file: the design lives in docs/design.md.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
SKIPPED_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache", "node_modules", ".mypy_cache"}
README_MAX_LINES, README_MAX_BYTES = 200, 12 * 1024
OLD_DESIGN_FILE = "DESIGN" + ".md"  # spelled in two parts so this file does not match itself

SECTION_REFERENCE = re.compile(r"§\s?(\d+)(?:\.\d+)*")
NUMBERED_HEADING = re.compile(r"^## (\d+)\. \S", re.M)
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def repository_files(*suffixes: str) -> list[Path]:
    """Files under the repository with one of `suffixes`, outside virtualenvs, git internals and build output."""
    found = []
    for directory, subdirectories, files in os.walk(REPO):
        subdirectories[:] = [d for d in subdirectories if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        found += [Path(directory) / name for name in files if Path(name).suffix in suffixes]
    return sorted(found)


def documentation_files() -> list[Path]:
    """The markdown files whose links must resolve: README.md, CHANGELOG.md, docs/*.md, examples/**/*.md."""
    files = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    return files + [p for p in repository_files(".md") if p.is_relative_to(REPO / "examples")]


def without_code(markdown: str) -> str:
    """`markdown` with fenced blocks and inline code blanked (line numbers kept): links and headings live outside."""
    blank_lines = lambda match: "\n" * match.group(0).count("\n")  # noqa: E731
    return INLINE_CODE.sub("", FENCE.sub(blank_lines, markdown))


def numbered_sections(markdown: str) -> set[int]:
    """N of every `## N. Title` heading."""
    return {int(n) for n in NUMBERED_HEADING.findall(without_code(markdown))}


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchor of every heading: lowercased, punctuation dropped, spaces to hyphens, repeats suffixed -1, -2."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", without_code(markdown), re.M):
        text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        anchor, repeat = slug, 0
        while anchor in anchors:
            repeat += 1
            anchor = f"{slug}-{repeat}"
        anchors.add(anchor)
    return anchors


def section_problems(path: Path, design_sections: set[int]) -> list[str]:
    """'file:line: §N ...' for each reference in `path` that names no section."""
    text = path.read_text(encoding="utf-8", errors="replace")
    own = numbered_sections(text) if path.suffix == ".md" and path != DESIGN else set()
    sections, where = (own, path.name) if own else (design_sections, "docs/design.md")
    problems = []
    for match in SECTION_REFERENCE.finditer(text):
        if int(match.group(1)) not in sections:
            line = text.count("\n", 0, match.start()) + 1
            problems.append(f"{path.relative_to(REPO)}:{line}: {match.group(0)} names no '## {match.group(1)}.' "
                            f"section in {where} (sections: {sorted(sections)})")
    return problems


def broken_links(path: Path) -> list[str]:
    """'file:line: [..](target) ...' for each relative link of the markdown file `path` that does not resolve."""
    text = without_code(path.read_text(encoding="utf-8"))
    problems = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^(https?:|mailto:|ftp:)", target, re.I):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        line = text.count("\n", 0, match.start()) + 1
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line}: link ({target})"
        if not resolved.exists():
            problems.append(f"{where} points at {file_part}, which does not exist")
        elif anchor and resolved.is_file() and resolved.suffix == ".md":
            if anchor.lower() not in heading_anchors(resolved.read_text(encoding="utf-8")):
                problems.append(f"{where}: {resolved.name} has no heading whose anchor is #{anchor}")
    return problems


def test_design_has_the_ten_numbered_sections_the_code_cites():
    assert DESIGN.is_file(), "docs/design.md is missing"
    assert numbered_sections(DESIGN.read_text(encoding="utf-8")) == set(range(1, 11)), (
        "docs/design.md must have the top-level sections '## 1. Title' .. '## 10. Title'"
    )


def test_every_section_reference_names_a_design_section():
    design_sections = numbered_sections(DESIGN.read_text(encoding="utf-8"))
    problems = [p for path in repository_files(".py", ".md") for p in section_problems(path, design_sections)]
    assert not problems, "section references that resolve nowhere:\n" + "\n".join(problems)


def test_every_relative_link_in_the_docs_resolves():
    problems = [p for path in documentation_files() if path.is_file() for p in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_links_the_docs_and_the_changelog():
    text = without_code((REPO / "README.md").read_text(encoding="utf-8"))
    links = {link.partition("#")[0] for link in LINK.findall(text)}
    expected = {"CHANGELOG.md", *(f"docs/{name}.md" for name in ("drafting", "training", "results", "design", "errors"))}
    assert expected <= links, f"README.md does not link {sorted(expected - links)}"


def test_the_readme_is_short():
    readme = REPO / "README.md"
    lines, size = len(readme.read_text(encoding="utf-8").splitlines()), readme.stat().st_size
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}); move detail to docs/"
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}); move detail to docs/"


def test_nothing_refers_to_a_top_level_design_file():
    problems = []
    for path in repository_files(".py", ".md"):
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            if OLD_DESIGN_FILE in line:
                problems.append(f"{path.relative_to(REPO)}:{number}: refers to {OLD_DESIGN_FILE}; cite docs/design.md §N")
    assert not problems, "\n".join(problems)


def test_the_link_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## 2. The algorithm\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md) [fine too](other.md#2-the-algorithm) [web](https://example.com/x.md)\n"
        "[gone](missing/file.md)\n[no such heading](other.md#nowhere)\n"
        "```bash\n[inside a code block](not/checked.md)\n```\n"
    )
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert "page.md:4: link (missing/file.md)" in problems[0] and "does not exist" in problems[0]
    assert "page.md:5: link (other.md#nowhere)" in problems[1] and "#nowhere" in problems[1]


def test_the_section_checker_finds_a_reference_to_a_missing_section(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    sign = "\N{SECTION SIGN}"  # not written out, so this file's own references stay real ones
    source = tmp_path / "module.py"
    source.write_text(f'"""Follows design {sign}3 and {sign}6.2; also {sign}11."""\n')
    problems = section_problems(source, {1, 2, 3, 6})
    assert problems == [
        f"module.py:1: {sign}11 names no '## 11.' section in docs/design.md (sections: [1, 2, 3, 6])"
    ], problems
