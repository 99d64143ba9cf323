"""The ``-k`` selection grammar: which case names an expression selects.

pytest's: substrings joined by ``and``/``or``/``not`` and parentheses. Used
by ``python -m conformance -k``, by the pytest plugin, and by a backend's
declared differences (``Difference.cases``), so it sits below all of them.
"""
from __future__ import annotations

import re
from typing import Callable

__all__ = ["parse_select", "matches"]

_TOKEN = re.compile(r"\s*(\(|\)|[^\s()]+)")


def parse_select(expr: str) -> Callable[[str], bool]:
    """A predicate on case names from a pytest-style ``-k`` expression.

    Substrings joined by ``and``/``or``/``not`` and parentheses; a bare word
    matches when it is a substring of the name.

    Raises:
      ValueError: ``"-k: ..."`` naming what is wrong with the expression.
    """
    tokens = _TOKEN.findall(expr)
    if not tokens:
        raise ValueError(f"-k: empty expression {expr!r}")
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def fail(what):
        raise ValueError(f"-k: {what} in {expr!r}")

    def parse_or():
        terms = [parse_and()]
        while peek() == "or":
            take()
            terms.append(parse_and())
        return lambda n: any(t(n) for t in terms)

    def parse_and():
        terms = [parse_not()]
        while peek() == "and":
            take()
            terms.append(parse_not())
        return lambda n: all(t(n) for t in terms)

    def parse_not():
        if peek() == "not":
            take()
            inner = parse_not()
            return lambda n: not inner(n)
        return parse_atom()

    def parse_atom():
        token = peek()
        if token is None:
            fail("expression ends early")
        if token == "(":
            take()
            inner = parse_or()
            if peek() != ")":
                fail("missing ')'")
            take()
            return inner
        if token in (")", "and", "or"):
            fail(f"unexpected {token!r}")
        take()
        return lambda n, word=token: word in n

    predicate = parse_or()
    if pos != len(tokens):
        fail(f"unexpected {tokens[pos]!r} (join words with and/or)")
    return predicate


def matches(expr: str, name: str) -> bool:
    """pytest-style ``-k``: substrings joined by ``and``/``or``/``not`` and parentheses.

    >>> matches("mha and not cross", "mha/self/causal")
    True
    """
    return parse_select(expr)(name)
