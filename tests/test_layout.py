"""The house's size limits (issue 38's layout bar), held in CI: no Python file over 600 lines, no C++ file over 800,
no function over 120 lines in either. Long files and functions are where one job becomes several; the limit makes a
change that grows one past it split it instead. Python functions come from its own parser (ast); C++ functions from
the braces of the source with comments and literals blanked: a function is a block opened after a closing parenthesis
(or a constructor's initializer list) at namespace or class level, and lambdas count inside the function holding
them."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_PY_LINES, MAX_CPP_LINES, MAX_FUNCTION_LINES = 600, 800, 120


def python_files() -> list[Path]:
    return sorted((REPO / "python" / "kvflash_ggml").rglob("*.py"))


def cpp_files() -> list[Path]:
    return sorted(p for p in (REPO / "cpp").rglob("*") if p.suffix in (".cpp", ".h"))


def blank_comments_and_literals(src: str) -> str:
    """The source with comments, string and character literals emptied, line breaks kept (braces in them are text)."""
    keep_lines = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731
    src = re.sub(r'R"([^(\s]*)\((.*?)\)\1"', lambda m: '""' + keep_lines(m), src, flags=re.S)
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r"/\*.*?\*/", keep_lines, src, flags=re.S)
    src = re.sub(r'"(\\.|[^"\\\n])*"', '""', src)
    return re.sub(r"'(\\.|[^'\\\n])*'", "''", src)


SCOPE = re.compile(r"\b(namespace|class|struct|enum|union)\b[^()]*$|extern\s*\"\"\s*$")
# a parameter list's ')' and its qualifiers, or a constructor's initializer list (its last member's (...) or {...})
FUNCTION = re.compile(r"\)\s*(const|noexcept|override|final|->\s*[\w:<>&*, ]+|\s)*$|\)\s*:[\s\S]*[)}]\s*$")


def cpp_functions(src: str) -> list[tuple[int, int]]:
    """(first line, lines) of each function defined in C++ source."""
    src = blank_comments_and_literals(src)
    # the open blocks: scope (namespace, class), fn, or other (inside a function; an initializer's braces)
    stack: list[tuple[str, int, int]] = []
    found, line, last_semicolon = [], 1, -1
    for i, c in enumerate(src):
        if c == "\n":
            line += 1
        elif c == ";":
            last_semicolon = i
        elif c == "{":
            # what leads to this brace: from the last ';' or the innermost open block (closed ones, such as a member's
            # brace initializer, stay part of it)
            head = src[max(last_semicolon, stack[-1][2] if stack else -1) + 1:i]
            if any(kind == "fn" for kind, _, _ in stack):
                stack.append(("other", line, i))
            elif SCOPE.search(head):
                stack.append(("scope", line, i))
            else:
                stack.append(("fn" if FUNCTION.search(head) else "other", line, i))
        elif c == "}" and stack:
            kind, first, _ = stack.pop()
            if kind == "fn":
                found.append((first, line - first + 1))
    return found


def python_functions(src: str) -> list[tuple[str, int, int]]:
    return [(n.name, n.lineno, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_file_is_over_its_limit():
    long = [f"{p.relative_to(REPO)}: {n} lines (at most {limit})"
            for files, limit in ((python_files(), MAX_PY_LINES), (cpp_files(), MAX_CPP_LINES))
            for p in files if (n := len(p.read_text().splitlines())) > limit]
    assert not long, "\n".join(long)


def test_no_function_is_over_120_lines():
    long = [f"{p.relative_to(REPO)}:{line} {name}: {n} lines" for p in python_files()
            for name, line, n in python_functions(p.read_text()) if n > MAX_FUNCTION_LINES]
    long += [f"{p.relative_to(REPO)}:{line}: {n} lines" for p in cpp_files()
             for line, n in cpp_functions(p.read_text()) if n > MAX_FUNCTION_LINES]
    assert not long, "\n".join(long)


def test_the_cpp_reader_finds_functions_and_only_functions():
    # The check above can fail only if this reader sees functions: planted ones, among what must not count.
    body = "\n".join(f"    x += {i};" for i in range(130))
    src = f"""namespace kvf {{
struct Pool {{
    int size() const {{ return 1; }}
    Pool(int n) : n_(n), m_{{0}} {{
{body}
    }}
    int n_, m_;
}};
// a comment with a brace {{ and a string below with one too
const char * text = "{{";
int helper(int a) {{
    auto f = [&](int b) {{ return a + b; }};
    if (a) {{ return f(a); }}
    return 0;
}}
}}  // namespace kvf
"""
    found = cpp_functions(src)
    assert [(first, n) for first, n in found] == [(3, 1), (4, 132), (140, 5)]
    # and the live tree has many (a reader that saw none would pass the test above vacuously)
    assert sum(len(cpp_functions(p.read_text())) for p in cpp_files()) > 500
