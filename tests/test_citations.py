"""A map that cannot drift (issue 38 item 6): every repository path and every docs/DESIGN.md section that the code and
the docs cite exists, docs/DESIGN.md stays short, and its layer drawing holds the code's own imports and includes.

How to cite, so that these checks can read it:
- a file or folder of this repository by its path from the root (`cpp/kv/pooled_kv.h`, `tests/test_split.py`); in
  C++ sources a path from cpp/ (`kv/pooled_kv.h`), anywhere a path from the package (`server/scheduler.py`);
- a file of another tree with its owner before it: "llama.cpp's common/arg.cpp", "THUDM/slime scripts/x.sh", or
  `third_party/llama.cpp/...` (the fetched tree, not checked: it is not committed);
- a section of the map as `docs/DESIGN.md, section "Invariants"` or `docs/DESIGN.md § Invariants` (in docs/:
  `DESIGN.md § Invariants` or a link `DESIGN.md#invariants`). A bare `DESIGN.md` outside docs/ is refused: it could
  as well mean a file that is not in the repository."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "DESIGN.md"
PACKAGE = REPO / "python" / "kvflash_ggml"
SCANNED = ["python", "cpp", "tests", "scripts", "experiments", "docs", ".ci"]
SUFFIXES = {".py", ".h", ".cpp", ".md", ".sh", ".txt", ".patch", ".toml", ".cmake", ""}
MAX_DESIGN_LINES, MAX_DESIGN_WIDTH = 150, 160

TOP = r"(?:cpp|python|tests|scripts|experiments|docs|\.ci|third_party)"
REPO_PATH = re.compile(r"(?<![\w./-])(" + TOP + r"/[\w.*/-]*[\w*/])")
CPP_ROOMS = "bindings|snapshot|runtime|model|scorer|kv|pager|common|reference"
CPP_PATH = re.compile(r"(?<![\w./-])((?:" + CPP_ROOMS + r")/[\w/-]+\.(?:h|cpp))\b")
PACKAGE_PATH = re.compile(r"(?<![\w./-])((?:server|commands|bench|testing|convert)/[\w/-]+\.py)\b")
# what comes right before a path of another tree: "llama.cpp's common/arg.cpp", "THUDM/slime scripts/x.sh",
# "git show 57b61a2:docs/x"
OTHER_TREE = re.compile(r"(?:(?:llama\.cpp|ggml|libllama|llama-cpp-python)'s(?: own)?\s+"
                        r"|(?<![\w./-])[A-Za-z0-9_-]+/[A-Za-z0-9_-]+\s+|\b[0-9a-f]{7,40}:)$")
DESIGN_MENTION = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*)DESIGN(\.md)?\b")
SECTION = re.compile(r",?\s*§\s*|,?\s+section\s+[\"“]")


def scanned_files() -> list[Path]:
    """Every text file of the scanned folders, but this one: its examples of bad citations are planted on purpose
    (test_checkers_refuse_planted_bad_citations checks them)."""
    files = [REPO / "README.md", REPO / "CMakeLists.txt"]
    for folder in SCANNED:
        files += sorted(p for p in (REPO / folder).rglob("*")
                        if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts)
    return [f for f in files if f != Path(__file__).resolve()]


def read(f: Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def design_headings(text: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)]


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def design_citation_problems(text: str, headings: list[str], in_docs: bool) -> list[str]:
    """Each mention of DESIGN(.md) in text: a section it names (after '§', 'section' or '#') must be a heading of
    docs/DESIGN.md; outside docs/ the file must be named by its path (docs/DESIGN.md); 'rule N' / 'item N' name
    nothing the map has."""
    problems = []
    anchors = {heading_anchor(h) for h in headings}
    by_length = sorted(headings, key=len, reverse=True)
    for m in DESIGN_MENTION.finditer(text):
        folder, md = m.group(1), m.group(2)
        rest = text[m.end():m.end() + 200]
        cited = text[m.start():m.end() + 40].split("\n")[0]
        if md is None and not re.match(r"\s*§", rest):
            continue   # the word DESIGN, not a citation
        if md and (folder not in ("docs/", "") or (folder == "" and not in_docs)):
            problems.append(f"{cited!r}: cite the map by its path, docs/DESIGN.md")
            continue
        if rest.startswith("#"):
            anchor = re.match(r"#([\w-]*)", rest).group(1)
            if anchor not in anchors:
                problems.append(f"{cited!r}: no heading of docs/DESIGN.md has the anchor #{anchor}")
            continue
        section = SECTION.match(rest)
        if section:
            name = rest[section.end():]
            if not any(name.lower().startswith(h.lower()) and not name[len(h):len(h) + 1].isalnum() for h in by_length):
                problems.append(f"{cited!r}: docs/DESIGN.md has no section {' '.join(name.split()[:4])!r}")
        elif re.match(r",?\s+(rules?|items?)\s+\d", rest):
            problems.append(f"{cited!r}: docs/DESIGN.md has no numbered rules; cite a section")
    return problems


def _exists(path: str, base: Path) -> bool:
    if "*" in path:
        return any(base.glob(path))
    full = base / path
    return full.exists() or (full.suffix == "" and any(full.parent.glob(full.name + ".*")))


def path_citation_problems(text: str, source: str) -> list[str]:
    """Repository paths named in text (source: the citing file, relative to the repository) that do not exist."""
    found = [(m, REPO) for m in REPO_PATH.finditer(text)]
    if source.startswith("cpp/"):
        found += [(m, REPO / "cpp") for m in CPP_PATH.finditer(text)]
    found += [(m, PACKAGE) for m in PACKAGE_PATH.finditer(text)]
    problems = []
    for m, base in found:
        path = m.group(1)
        line_start = text.rfind("\n", 0, m.start()) + 1
        if OTHER_TREE.search(text[line_start:m.start()]) or path.startswith("third_party/"):
            continue
        if not _exists(path, base):
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"{source}:{line}: {path} does not exist"
                            + ("" if base == REPO else f" (read as {base.relative_to(REPO) / path})"))
    return problems


def design_file_name_problems(text: str) -> list[str]:
    """The map's short names, as its rule says: a `.py` name is relative to the package; any other bare name
    (`graph.cpp`, `host_memory.h`) lies in the folder of the path before it in its line."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        folder = None
        for span in re.findall(r"`([^`\n]+)`", line):
            if re.fullmatch(TOP + r"/[\w./-]*", span):
                folder = (REPO / span).parent if (REPO / span).suffix else REPO / span
            elif re.fullmatch(r"[\w./-]+\.py", span) and not (PACKAGE / span).exists():
                problems.append(f"docs/DESIGN.md:{n}: `{span}` is not python/kvflash_ggml/{span}")
            elif re.fullmatch(r"[\w.-]+\.(?:h|cpp|sh|patch)", span) and not (folder and (folder / span).exists()):
                where = folder.relative_to(REPO).as_posix() if folder else "no folder: no path before it in its line"
                problems.append(f"docs/DESIGN.md:{n}: `{span}` is not a file of {where}")
    return problems


# ---- the layer drawing ----------------------------------------------------------------------------------------

def layer_drawing(text: str) -> list[str]:
    section = text[text.index("## Layers"):]
    return section[section.index("```") + 3:].split("```", 1)[0].strip("\n").splitlines()


def cpp_ranks(drawing: list[str]) -> dict[str, int]:
    ranks: dict[str, int] = {}
    for row, line in enumerate(drawing):
        for room in re.findall(r"\bcpp/(\w+)", line):
            ranks.setdefault(room, row)
    return ranks


def cpp_includes() -> dict[str, set[str]]:
    """room -> the rooms its files include (#include "room/...")."""
    out: dict[str, set[str]] = {}
    for f in (REPO / "cpp").rglob("*"):
        if f.suffix in (".h", ".cpp"):
            room = f.relative_to(REPO / "cpp").parts[0]
            found = re.findall(r'^\s*#\s*include\s+"(\w+)/', read(f), re.M)
            out.setdefault(room, set()).update(r for r in found if (REPO / "cpp" / r).is_dir())
    return out


def cpp_layer_problems(drawing: list[str], includes: dict[str, set[str]]) -> list[str]:
    ranks = cpp_ranks(drawing)
    problems = [f"cpp/{room} is not in the drawing" for room in sorted(includes) if room not in ranks]
    for room, used in sorted(includes.items()):
        for other in sorted(used):
            if room in ranks and other in ranks and ranks[other] < ranks[room]:
                problems.append(f"cpp/{room} includes cpp/{other}, which the drawing puts above it")
    return problems


def package_units() -> set[str]:
    """The package's modules and subpackages (its first level), by name."""
    units = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    return units - {"__init__"}


def python_rows(drawing: list[str], units: set[str]) -> tuple[dict[str, int], set[str]]:
    """(unit -> row, units placed 'beside') from the drawing's Python rows (those above the pybind11 line)."""
    ranks: dict[str, int] = {}
    beside: set[str] = set()
    for row, line in enumerate(drawing):
        if "pybind11" in line:
            break
        words = re.findall(r"[A-Za-z_]\w*", re.sub(r"\([^)]*\)", "", line.replace("python/kvflash_ggml", "")))
        for w in (w for w in words if w in units):
            (beside.add(w) if "beside" in line else ranks.setdefault(w, row))
    return ranks, beside


def python_imports(units: set[str]) -> dict[str, set[str]]:
    """unit -> the other units its files import (relative or absolute imports of kvflash_ggml, lazy ones too)."""
    out: dict[str, set[str]] = {}
    for f in PACKAGE.rglob("*.py"):
        rel = f.relative_to(PACKAGE).with_suffix("").parts
        unit = rel[0]
        package = list(rel[:-1])   # where a relative import starts (a package's __init__ too)
        for node in ast.walk(ast.parse(read(f))):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                mod = base + (node.module.split(".") if node.module else [])
                targets = [mod] if mod else [[a.name] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvflash_ggml."):
                targets = [node.module.split(".")[1:]]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".")[1:] for a in node.names if a.name.startswith("kvflash_ggml.")]
            for t in targets:
                if t and t[0] in units and t[0] != unit:
                    out.setdefault(unit, set()).add(t[0])
    return out


def python_layer_problems(drawing: list[str], units: set[str], imports: dict[str, set[str]]) -> list[str]:
    ranks, beside = python_rows(drawing, units)
    problems = [f"kvflash_ggml.{u} is not in the drawing" for u in sorted(units - set(ranks) - beside)]
    for unit, used in sorted(imports.items()):
        for other in sorted(used):
            if unit in ranks and other in ranks and ranks[other] < ranks[unit]:
                problems.append(f"kvflash_ggml.{unit} imports kvflash_ggml.{other}, which the drawing puts above it")
    return problems


# ---- the tests ---------------------------------------------------------------------------------------------------

def test_design_is_short():
    # issue 38 item 6: the map is under 150 lines of reasonable width; detail lives at the top of the files it names
    lines = read(DESIGN).splitlines()
    assert len(lines) <= MAX_DESIGN_LINES, f"docs/DESIGN.md has {len(lines)} lines (at most {MAX_DESIGN_LINES})"
    wide = [i + 1 for i, line in enumerate(lines) if len(line) > MAX_DESIGN_WIDTH]
    assert not wide, f"docs/DESIGN.md lines wider than {MAX_DESIGN_WIDTH} characters: {wide}"


def test_cited_design_sections_exist():
    # issue 38 item 6: code cited DESIGN sections that did not exist ("DESIGN.md measured facts", "rule 12")
    headings = design_headings(read(DESIGN))
    problems = []
    for f in scanned_files():
        rel = f.relative_to(REPO).as_posix()
        problems += [f"{rel}: {p}" for p in design_citation_problems(read(f), headings,
                                                                      in_docs=rel.startswith("docs/"))]
    assert not problems, "\n".join(problems)


def test_cited_repository_paths_exist():
    # issue 38 item 6: a path named in a comment or a page must not outlive a move or a rename
    problems = []
    for f in scanned_files():
        problems += path_citation_problems(read(f), f.relative_to(REPO).as_posix())
    assert not problems, "\n".join(problems)


def test_design_names_real_files():
    # issue 38 item 6: the map's short file names (`graph.cpp`, `fit.py`) drift like its paths, and name a folder
    problems = design_file_name_problems(read(DESIGN))
    assert not problems, "\n".join(problems)


def test_layer_drawing_holds_the_code():
    # issue 38 item 6: the drawing no longer matched the code; now no include or import may run up a row of it
    drawing = layer_drawing(read(DESIGN))
    units = package_units()
    problems = cpp_layer_problems(drawing, cpp_includes())
    problems += python_layer_problems(drawing, units, python_imports(units))
    assert not problems, "\n".join(problems)


def test_checkers_refuse_planted_bad_citations():
    # guards the checkers themselves: each must flag a bad example and pass a good one, or the tests above prove nothing
    headings = ["Words", "Invariants", "Measured facts"]
    map_ = "docs/DESIGN.md"
    bad = [f"({map_}, section \"Prefill modes\")", f"{map_} § No such part", f"(DESIGN.md measured facts)",
           f"{map_} rule 12", f"{map_}#prefill-modes", "DESIGN §Threads"]
    for text in bad:
        assert design_citation_problems(text, headings, in_docs=False), text
    good = [f"({map_}, section \"Measured facts\")", f"{map_} § Invariants.", f"[map]({map_}#measured-facts)",
            f"see {map_}: the map", "DESIGN §Words", "the DESIGN of it", f"every {map_} section that is cited"]
    for text in good:
        assert not design_citation_problems(text, headings, in_docs=False), text
    assert not design_citation_problems("[the map](DESIGN.md#words)", headings, in_docs=True)

    root = "cpp/kv/"
    assert path_citation_problems(f"see {root}no_such_file.h", "x.py")
    assert path_citation_problems("see `python/kvflash_ggml/no_such.py`.", "docs/x.md")
    assert path_citation_problems("see kv/no_such_file.h", "cpp/x.cpp")
    assert path_citation_problems("see server/no_such_module.py", "docs/x.md")
    assert path_citation_problems("scripts/gpu_session.sh", "tests/x.py")   # moved to experiments/
    for text in [f"{root}pooled_kv.h", "cpp/model/device_split.*", "cpp/model/quant_matmul", "kv/kv_graph.h",
                 "llama.cpp's own common/no_such.cpp", "THUDM/slime scripts/models/x.sh", "git show 57b61a2:docs/gone",
                 "third_party/llama.cpp/common/arg.cpp", "https://example.org/docs/nothing.md"]:
        assert not path_citation_problems(text, "cpp/x.cpp"), text
    assert design_file_name_problems("`cpp/model/model.h`, `graph.cpp`; `fit.py`, `server/app.py`") == []
    assert design_file_name_problems("`graph.cpp`")   # which folder?
    assert design_file_name_problems("`cpp/kv/pooled_kv.h` / `graph.cpp`")   # not beside pooled_kv.h
    assert design_file_name_problems("`no_such_module.py`")

    drawing = layer_drawing(read(DESIGN))
    swapped = [line.replace("cpp/kv", "cpp/TMP").replace("cpp/model", "cpp/kv").replace("cpp/TMP", "cpp/model")
               for line in drawing]
    assert "cpp/model includes cpp/kv, which the drawing puts above it" in cpp_layer_problems(swapped, cpp_includes())
    assert "cpp/pager is not in the drawing" in cpp_layer_problems([s for s in drawing if "cpp/pager" not in s],
                                                                   cpp_includes())
    units, leaves = package_units(), next(i for i, line in enumerate(drawing) if "pybind11" in line)
    sunk = [line.replace("engine.py", "") for line in drawing[:leaves]] + ["engine.py"] + drawing[leaves:]
    assert ("kvflash_ggml.engine imports kvflash_ggml.options, which the drawing puts above it"
            in python_layer_problems(sunk, units, python_imports(units)))


def test_scan_sees_citations():
    # guards the scan: patterns that matched nothing would pass every file
    text = read(REPO / "cpp" / "runtime" / "session.cpp")
    assert "Measured facts" in text and DESIGN_MENTION.search(text)
    found = {m.group(1) for f in scanned_files() for m in REPO_PATH.finditer(read(f))}
    assert {"cpp/pager/kv_pager.h", "tests/test_split.py"} <= found
