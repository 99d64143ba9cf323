"""Source of a mirror's function as text, and a tiny Python highlighter.

The source is read from the package's file (never imported: showing the torch
or JAX mirror must not need torch or JAX), the function found with ``ast``,
and highlighted with ``tokenize`` into ``<span class="tok-...">`` (the colours
are in ``static/site.css``); no pygments.
"""
from __future__ import annotations

import ast
import builtins
import html
import io
import keyword
import token
import tokenize
from functools import lru_cache
from pathlib import Path

__all__ = ["ROOT", "function_source", "function_sources", "highlight"]

#: the folder holding numpy_ref/, torch_impl/, jax_impl/ (the repository or site-packages)
ROOT = Path(__file__).resolve().parents[2]

_BUILTINS = frozenset(n for n in dir(builtins) if not n.startswith("_"))


@lru_cache(maxsize=None)
def _module(package: str, module: str):
    """``(text, tree)`` of ``<ROOT>/<package>/<module>.py``, or None when the file is absent."""
    path = ROOT / package / f"{module}.py"
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    return text, ast.parse(text, filename=str(path))


def function_source(package: str, module: str, name: str):
    """``(source, first_line)`` of the top-level ``def name`` in ``package/module.py``, or None.

    Decorators are included; the text is the file's own lines (comments kept).
    """
    found = _module(package, module)
    if found is None:
        return None
    text, tree = found
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = text.splitlines()[start - 1:node.end_lineno]
            return "\n".join(lines) + "\n", start
    return None


def function_sources(package: str, module: str, name: str):
    """``[(name, source, first_line), ...]``: the function, then the module's private
    helpers (``_name``) it calls directly, in the order they are first called.

    Empty when the file or the function is absent.
    """
    found = _module(package, module)
    first = function_source(package, module, name)
    if found is None or first is None:
        return []
    _, tree = found
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    called = []
    for node in ast.walk(defs[name]):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            callee = node.func.id
            if callee.startswith("_") and callee in defs and callee not in called and callee != name:
                called.append(callee)
    out = [(name, *first)]
    for callee in called:
        out.append((callee, *function_source(package, module, callee)))
    return out


def _kind(tok: tokenize.TokenInfo, prev: tokenize.TokenInfo | None) -> str | None:
    if tok.type == tokenize.COMMENT:
        return "com"
    if tok.type == tokenize.STRING or tok.type in _FSTRING:
        return "str"
    if tok.type == tokenize.NUMBER:
        return "num"
    if tok.type == tokenize.NAME:
        if keyword.iskeyword(tok.string) or keyword.issoftkeyword(tok.string) and tok.string != "_":
            return "kw"
        if prev is not None and prev.type == tokenize.NAME and prev.string in ("def", "class"):
            return "def"
        if tok.string in _BUILTINS:
            return "bi"
        return None
    if tok.type == tokenize.OP:
        return "op"
    return None


_FSTRING = {getattr(token, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(token, n)}


def highlight(source: str) -> str:
    """HTML (escaped) of ``source`` with ``<span class="tok-KIND">`` around tokens.

    Whitespace and line breaks are kept exactly (the result goes in a
    ``<pre><code>``); a source tokenize cannot read comes back escaped, uncoloured.
    """
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def at(row_col):
        row, col = row_col
        return offsets[row - 1] + col if row - 1 < len(offsets) else len(source)

    out, pos, prev = [], 0, None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in (tokenize.ENDMARKER,):
                break
            start, end = at(tok.start), at(tok.end)
            if start < pos:  # fstring parts may overlap what we have written
                continue
            kind = _kind(tok, prev)
            out.append(html.escape(source[pos:start], quote=False))
            text = html.escape(source[start:end], quote=False)
            out.append(f'<span class="tok-{kind}">{text}</span>' if kind and text else text)
            pos = end
            if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT):
                prev = tok
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    out.append(html.escape(source[pos:], quote=False))
    return "".join(out)
