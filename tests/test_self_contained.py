"""The repository is self-contained: it cites only its own files (issue 12, item 6).

The facts a reader needs are in `docs/` in the project's own words. Checked here, per tracked text file:

- every `<name>.md` it cites (a name followed by `§` or `#anchor`; in Markdown prose, any name outside code
  spans) is a file of the repository, written as its path from the repository root or, inside docs/, as a
  sibling page: a note that lives elsewhere cannot be cited;
- every `docs/<page>.md` mention names an existing page, its `#anchor` a heading of that page, and its
  `§N.M` section numbers headings of that page;
- in README.md and docs/*.md, every relative Markdown link resolves, anchors included, and no relative path
  (`../x`) leads out of the repository.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS_FILE = "tests/test_self_contained.py"

MD_NAME = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-][\w.-]*\.md)\b")  # a .md name, with the path before it
CITED_MD = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-][\w.-]*\.md)`?(?=\s*\(?§|#[\w-])")  # x.md §1, x.md#a
UP_PATH = re.compile(r"(?<![.\w])((?:\.\./)+[\w.-][\w./-]*)")  # ../x, ../../x (not the ellipsis .../x)
SECTIONS = r"(?:\s*(?:,|and)?\s*§\s*\d[\d.]*(?:\s*[–-]\s*§?\s*\d[\d.]*)?)*"  # "§1.2, §4.2", "§1.1–1.2", "§4–5"
DOCS_MENTION = re.compile(rf"\bdocs/([\w.-]+\.md)(#[\w-]+)?({SECTIONS})")
SECTION_NUMBER = re.compile(r"\d+(?:\.\d+)*")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def tracked_files() -> list[str]:
    """Repository files, relative to ROOT: `git ls-files`, or a walk of the tree outside a git checkout."""
    try:
        listing = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return sorted(line for line in listing.splitlines() if line)
    except (OSError, subprocess.CalledProcessError):
        skip_dirs = {".git", ".venv", "__pycache__", "build", "dist"}
        found = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in skip_dirs and not d.endswith(".egg-info")]
            found += [str((Path(folder) / name).relative_to(ROOT)) for name in files]
        return sorted(found)


def read_text(relative: str) -> str | None:
    """The file's text, or None for a binary file (a NUL byte or not UTF-8)."""
    data = (ROOT / relative).read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def text_files() -> list[str]:
    return [f for f in tracked_files() if f != THIS_FILE and (ROOT / f).is_file() and read_text(f) is not None]


def github_slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(page: Path) -> list[str]:
    in_code = False
    found = []
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (match := HEADING.match(line)):
            found.append(match.group(2))
    return found


def anchors(page: Path) -> set[str]:
    return {github_slug(text) for text in headings(page)}


def section_numbers(page: Path) -> set[str]:
    """'1', '1.1', ... for headings such as '## 1. The checkpoint' and '### 1.1 config.json'."""
    numbers = set()
    for text in headings(page):
        if match := re.match(r"(\d+(?:\.\d+)*)\.?\s", text):
            numbers.add(match.group(1))
    return numbers


def outside_mentions(relative: str, text: str) -> list[str]:
    """Each citation of a `.md` page that is not a file of the repository: everywhere, a name followed by `§` or
    `#anchor`; in Markdown prose (outside code blocks), every `.md` name outside `code spans`, and every `../` path leading out."""
    problems = []
    folder = (ROOT / relative).parent
    prose = relative.endswith(".md")
    in_code = False
    for number, line in enumerate(text.splitlines(), 1):
        if prose and line.startswith("```"):
            in_code = not in_code
        names = CITED_MD.findall(line)
        if prose and not in_code:  # every .md name of the prose; `code spans` may name other projects' files
            names += MD_NAME.findall(re.sub(r"`[^`]*`", "", line))
        for name in names:
            if not ((ROOT / name).is_file() or (relative.startswith("docs/") and (folder / name).is_file())):
                problems.append(f"{relative}:{number}: cites {name}, which is not a file of the repository")
        for path in UP_PATH.findall(line) if prose and not in_code else ():
            resolved = (folder / path).resolve()
            if resolved != ROOT and ROOT not in resolved.parents:
                problems.append(f"{relative}:{number}: {path} leads out of the repository")
    return problems


def docs_mentions(relative: str, text: str) -> list[str]:
    """Each `docs/<page>.md` mention whose page, anchor or § section does not exist."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in DOCS_MENTION.finditer(line):
            page = ROOT / "docs" / match.group(1)
            where = f"{relative}:{number}: {match.group(0).strip()}"
            if not page.is_file():
                problems.append(f"{where}: no such page")
                continue
            if match.group(2) and match.group(2)[1:] not in anchors(page):
                problems.append(f"{where}: no heading with anchor {match.group(2)}")
            for section in SECTION_NUMBER.findall(match.group(3) or ""):
                if section.rstrip(".") not in section_numbers(page):
                    problems.append(f"{where}: no section {section} in docs/{match.group(1)}")
    return problems


def markdown_links(relative: str, text: str) -> list[str]:
    """Each relative Markdown link (README.md, docs/*.md) whose file or anchor does not exist."""
    problems = []
    source = ROOT / relative
    for number, line in enumerate(text.splitlines(), 1):
        for target in MARKDOWN_LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (source.parent / path).resolve() if path else source
            where = f"{relative}:{number}: ({target})"
            if not resolved.exists():
                problems.append(f"{where}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


def problems_in(relative: str) -> list[str]:
    text = read_text(relative) or ""
    problems = outside_mentions(relative, text) + docs_mentions(relative, text)
    if relative == "README.md" or (relative.startswith("docs/") and relative.endswith(".md")):
        problems += markdown_links(relative, text)
    return problems


@pytest.mark.parametrize("relative", text_files())
def test_file_cites_only_the_repository(relative):
    problems = problems_in(relative)
    assert not problems, "\n".join(problems)


def test_checks_catch_each_kind_of_outside_citation(tmp_path):
    """The checks themselves: each kind of bad citation is reported, good ones are not."""
    bad = [
        "see notes/checkpoint-format.md §1.2",
        "(inference-notes.md §2)",
        "`nvfp4-notes.md` §4.1",
        "kernels.md §3 (a docs page cited without its path from the root)",
    ]
    for line in bad:
        assert outside_mentions("src/x.py", line), line
    good = ["docs/format.md §2.2", "docs/nvfp4.md §7", "README.md", "a .md file", "docs/development.md §4"]
    for line in good:
        assert not outside_mentions("src/x.py", line), line
    assert not outside_mentions("docs/quantize.md", "see kernels.md and [x](../README.md)")  # sibling pages
    assert outside_mentions("docs/quantize.md", "the notes in other-notes.md")
    assert not outside_mentions("docs/quantize.md", "their `docs/guide.md` and --markdown `table.md`")
    assert outside_mentions("docs/quantize.md", "the notes in ../../notes/format")
    assert docs_mentions("src/x.py", "docs/format.md §2.2, §4.3 and docs/kernels.md") == []
    assert docs_mentions("src/x.py", "docs/format.md §9.9")
    assert docs_mentions("src/x.py", "docs/format.md §1.1–1.9")
    assert docs_mentions("src/x.py", "docs/no-such-page.md")
    assert docs_mentions("src/x.py", "docs/architecture.md#no-such-heading")
    assert not docs_mentions("src/x.py", "docs/architecture.md#files-and-safety")
    assert markdown_links("README.md", "[x](docs/no-such.md)")
    assert markdown_links("README.md", "[x](docs/train.md#no-such-anchor)")
    assert not markdown_links("README.md", "[x](docs/train.md#many-gpus-torchrun) [y](https://example.com)")
