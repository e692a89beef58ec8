"""The docs agree with the repository: every ``DESIGN.md §X`` citation resolves to a heading of
docs/DESIGN.md, every relative link and backticked repository path in the Markdown files
exists, and the tables of docs/DESIGN.md equal the code they describe."""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from hicache import errors
from hicache.backends import transfer
from hicache.backends.stores import STORE_KINDS
from hicache.backends.stores.base import PageStatus
from hicache.core.controller import WritePolicy
from hicache.core.metrics import Levels, Metrics
from hicache.spec import request_invariants
from hicache.spec.invariants import INVARIANTS, REPORTS
from hicache.spec.model import TABLE, Event, RunState
from hicache.spec.request import REQUEST_TABLE, ReqEvent, ReqState

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "DESIGN.md"
# The contract's numbering, kept so that old citations still land on the right section.
SECTIONS = ["1", "2", "3", "4", "4b", "5", "6", "6b", "7", "8", "9", "10", "11"]

_PRUNE = {"__pycache__", "node_modules", "build", "dist"}
_HEADING = re.compile(r"^#{2,3} (\d+[a-z]?)\. ", re.M)
_ANY_HEADING = re.compile(r"^#{1,3} ", re.M)
_CITATION = re.compile(r"DESIGN\.md(?:'s)?\W{0,3}?((?:§\s?\d+[a-z]?(?:\s*(?:,|and|or|/|&)\s*)?)+)")
_SECTION = re.compile(r"§\s?(\d+[a-z]?)")
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
_REPO_PATH = re.compile(r"^(?:hicache|bench|docs|scripts|tests|\.ci)/[\w./-]*$")


# -- reading the repository ----------------------------------------------------------------


def _files(*suffixes: str) -> Iterator[Path]:
    """Repository files with these suffixes (hidden folders, the venv and caches left out)."""
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in _PRUNE and not d.startswith("."))
        for name in sorted(names):
            if name.endswith(suffixes):
                yield Path(top) / name


def _anchors() -> set[str]:
    return set(_HEADING.findall(DESIGN.read_text()))


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def citations(path: Path) -> list[tuple[int, str]]:
    """``(line, section)`` of every DESIGN.md citation in ``path``. In code and in DESIGN.md
    itself a bare ``§X`` cites DESIGN.md too; other Markdown files may number their own."""
    text = path.read_text(errors="replace")
    if path.suffix in (".py", ".sh") or path == DESIGN:
        return [(_line(text, m.start()), m.group(1)) for m in _SECTION.finditer(text)]
    return [(_line(text, m.start()), s) for m in _CITATION.finditer(text) for s in _SECTION.findall(m.group(1))]


def _prose(text: str) -> str:
    """``text`` with fenced code blocks blanked (line numbers kept)."""
    out: list[str] = []
    fence: str | None = None
    for line in text.split("\n"):
        mark = line.lstrip()[:3]
        if fence is None and mark in ("```", "~~~"):
            fence = mark
            out.append("")
        elif fence is not None:
            fence = None if mark == fence else fence
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def broken_references(md: Path, root: Path = ROOT) -> list[str]:
    """Relative links and backticked repository paths (any word of a code span that starts
    with a top folder of ours) in ``md`` that do not exist."""
    text = _prose(md.read_text())
    bad: list[str] = []
    for m in _CODE_SPAN.finditer(text):
        for word in m.group(2).split():
            path = word.split(":")[0].rstrip(".,;)")  # file.py::test_name, file.py:123
            if any(c in path for c in "*?<>{}$[") or not _REPO_PATH.match(path):
                continue
            if not (root / path).exists() and not (md.parent / path).exists():
                bad.append(f"{md.relative_to(root)}:{_line(text, m.start())}: `{path}`")
    no_code = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)
    for m in _LINK.finditer(no_code):
        target = m.group(1).split("#")[0].split("?")[0]
        if not target or re.match(r"^[A-Za-z][\w+.-]*:", target):
            continue  # an anchor in the same file, or a URL
        if not (md.parent / target).exists():
            bad.append(f"{md.relative_to(root)}:{_line(text, m.start())}: ({m.group(1)})")
    return bad


# -- reading docs/DESIGN.md ----------------------------------------------------------------------


def section(number: str) -> str:
    """The text of ``## number.`` (or ``### number.``) up to the next heading."""
    text = DESIGN.read_text()
    starts = {m.group(1): m.end() for m in _HEADING.finditer(text)}
    if number not in starts:
        raise AssertionError(f"docs/DESIGN.md has no section {number}")
    start = starts[number]
    nxt = _ANY_HEADING.search(text, start)
    return text[start : nxt.start() if nxt else len(text)]


def table(number: str, header: tuple[str, ...]) -> list[list[str]]:
    """The body rows of the table in section ``number`` whose header is ``header``."""
    found: list[list[list[str]]] = []
    rows: list[list[str]] = []
    for line in [*section(number).split("\n"), ""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
        elif rows:
            found.append(rows)
            rows = []
    for t in found:
        if tuple(t[0]) == header:
            return [r for r in t[1:] if not all(re.fullmatch(r":?-+:?", c) for c in r)]
    raise AssertionError(f"docs/DESIGN.md §{number} has no table headed {header}")


def ticked(cell: str) -> list[str]:
    """The backticked names in a table cell, in order."""
    return re.findall(r"`([^`]+)`", cell)


def _one(cell: str) -> str:
    names = ticked(cell)
    assert len(names) == 1, cell
    return names[0]


# -- (a) citations -------------------------------------------------------------------------------


def test_design_keeps_the_contract_numbering() -> None:
    """docs/DESIGN.md has exactly the contract's numbered sections, in order."""
    assert _HEADING.findall(DESIGN.read_text()) == SECTIONS


def test_every_design_citation_resolves() -> None:
    """Every ``DESIGN.md §X`` (and every bare ``§X`` in code) names a heading of docs/DESIGN.md."""
    anchors = _anchors()
    bad = [
        f"{path.relative_to(ROOT)}:{line}: §{s}"
        for path in _files(".py", ".sh", ".md")
        for line, s in citations(path)
        if s not in anchors
    ]
    assert not bad, "citations of sections docs/DESIGN.md does not have:\n" + "\n".join(bad)


def test_the_citation_scan_finds_citations(tmp_path: Path) -> None:
    """The scanner reads lists (``§4, §4b``), bare ``§X`` in code and none in other prose."""
    s = "\u00a7"  # not written out: this file's own citations are checked too
    code = tmp_path / "x.py"
    code.write_text(f'"""See DESIGN.md {s}4, {s}4b and {s}12."""\n# {s}7\n')
    prose = tmp_path / "x.md"
    prose.write_text(f"Our {s}3 and DESIGN.md {s}6b.\n")
    assert citations(code) == [(1, "4"), (1, "4b"), (1, "12"), (2, "7")]
    assert citations(prose) == [(1, "6b")]


# -- (b) links and paths -------------------------------------------------------------------------


def test_every_linked_or_quoted_repository_path_exists() -> None:
    """Relative links and backticked repository paths in every Markdown file exist."""
    bad = [b for md in _files(".md") for b in broken_references(md)]
    assert not bad, "missing paths:\n" + "\n".join(bad)


def test_the_path_scan_finds_missing_paths(tmp_path: Path) -> None:
    """A missing link or backticked path is reported; fenced code, URLs, anchors, globs and
    test ids of existing files are not."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    (tmp_path / "docs").mkdir()
    md = tmp_path / "docs" / "X.md"
    md.write_text(
        "See [x](nothing-here.md), [web](https://example.org/a.md), [me](#top), `hicache/nope.py`,\n"
        "`tests/test_x.py::test_y`, `bench/results/*.json`, [up](../tests/test_x.py#L1),\n"
        "`python bench/soak.py --n 1` and ``[no](link.md)``.\n"
        "```\n`hicache/also_nope.py`\n```\n"
    )
    assert broken_references(md, tmp_path) == [
        "docs/X.md:1: `hicache/nope.py`",
        "docs/X.md:3: `bench/soak.py`",
        "docs/X.md:1: (nothing-here.md)",
    ]


# -- (c) docs/DESIGN.md against the code ------------------------------------------------------------


def _tiers(cell: str) -> set[str]:
    return set() if cell in ("–", "-", "") else set(cell.split())


def test_page_run_table_is_the_compiled_table() -> None:
    """§4's state table lists every RunState once with its R, F and exactly its transitions."""
    rows = table("4", ("state", "R", "F", "event → state"))
    assert [_one(r[0]) for r in rows] == [s.name for s in RunState]
    for name, r, f, cell in rows:
        s = RunState[_one(name)]
        assert _tiers(r) == {t.name for t in s.resident}, s
        assert _tiers(f) == {d.name for d in s.in_flight}, s
        doc = dict(re.findall(r"`(\w+)` → `(\w+)`", cell))
        code = {e.value: t.name for (src, e), t in TABLE.items() if src is s}
        assert doc == code, s


def test_page_run_counts_in_the_text_are_the_code_s() -> None:
    """§4 states the numbers of states, events and transitions the model has."""
    text = section("4")
    assert f"{len(RunState)} states, {len(Event)} events and **{len(TABLE)} transitions**" in text


def test_invariant_table_names_every_invariant_and_report() -> None:
    """§4's invariant table names the checked invariants (and ``ordering``) and every report."""
    rows = table("4", ("#", "invariant", "reports", "says"))
    names = [_one(r[1]) for r in rows]
    assert sorted(names) == sorted([*INVARIANTS, "ordering"])
    codes = {f"{_one(r[1])}.{code}" for r in rows for code in ticked(r[2])}
    assert codes == set(REPORTS)


def test_request_states_are_the_code_s() -> None:
    """§4b lists exactly the ReqState values, in order."""
    rows = table("4b", ("state", "the request holds"))
    assert [_one(r[0]) for r in rows] == [s.value for s in ReqState]


def test_request_transition_table_is_the_compiled_table() -> None:
    """§4b's transition table is REQUEST_TABLE, and the text gives its size."""
    rows = table("4b", ("from", "event", "to", "when"))
    doc = [(ReqState(_one(a)), ReqEvent(_one(e)), ReqState(_one(b))) for a, e, b, _ in rows]
    assert len(doc) == len(set(doc))
    assert set(doc) == {(a, e, b) for (a, e), b in REQUEST_TABLE.items()}
    assert f"The {len(REQUEST_TABLE)} transitions" in section("4b")


def test_request_invariants_are_the_code_s() -> None:
    """§4b names every invariant ``request_invariants`` reports, and no other."""
    code = {c.partition(".")[0] for c in request_invariants.REQUEST_REPORTS}
    rows = table("4b", ("invariant", "says"))
    assert {_one(r[0]) for r in rows} == code


def test_write_policies_are_the_code_s() -> None:
    """§5's write-policy table lists exactly the WritePolicy values."""
    assert [_one(r[0]) for r in table("5", ("policy", "backs up"))] == [p.value for p in WritePolicy]


def test_transfer_paths_are_the_code_s() -> None:
    """§6's path table lists exactly the transfer engine's paths."""
    rows = table("6", ("path", "taken when", "how"))
    assert sorted(_one(r[0]) for r in rows) == sorted(typing.get_args(transfer.Path))


def test_store_kinds_and_page_statuses_are_the_code_s() -> None:
    """§6b lists exactly the store kinds and names every PageStatus."""
    rows = table("6b", ("kind", "what", "keyed", "shared"))
    assert [_one(r[0]) for r in rows] == list(STORE_KINDS)
    text = section("6b")
    assert [s.name for s in PageStatus if f"`{s.name}`" not in text] == []


def test_metrics_table_is_the_exposition() -> None:
    """§8's table is every metric family ``prometheus()`` exports, with its type and labels."""
    levels = Levels({"L1": 1}, {"L1": 2}, 0, 0, 0)
    text = Metrics().prometheus({"L1": 0}, levels=levels)
    code = {
        (f.name, f.type, ", ".join(sorted({k for s in f.samples for k in s.labels if k != "le"})))
        for f in text_string_to_metric_families(text)
    }
    rows = table("8", ("metric", "type", "labels"))
    doc = {(_one(r[0]), r[1], r[2]) for r in rows}
    assert len(rows) == len(doc)
    assert doc == code


def test_error_table_is_the_hierarchy() -> None:
    """§9's table lists every error class of ``hicache.errors`` with its bases."""
    code = {
        name: [b.__name__ for b in cls.__bases__]
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, errors.HiCacheError)
    }
    rows = table("9", ("error", "base", "raised for"))
    assert {_one(r[0]): ticked(r[1]) for r in rows} == code
