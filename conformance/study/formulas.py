"""The formulas of each page, as MathML written by hand (no renderer, no network).

``FORMULAS[slug]`` is a list of ``(label, mathml)``; ``mathml`` is the inside of
a ``<math display="block">`` element. The tiny builders below keep them readable.
"""
from __future__ import annotations

import html

__all__ = ["FORMULAS", "math_block"]


def i(x):  # identifier
    return f"<mi>{x}</mi>"


def n(x):  # number
    return f"<mn>{x}</mn>"


def o(x):  # operator
    return f"<mo>{x}</mo>"


def t(x):  # text; MathML trims the spaces at its ends, so they become no-break spaces
    stripped = x.strip(" ")
    lead, trail = len(x) - len(x.lstrip(" ")), len(x) - len(x.rstrip(" "))
    return f"<mtext>{'&#xA0;' * lead}{stripped}{'&#xA0;' * trail}</mtext>"


def row(*xs):
    return "<mrow>" + "".join(xs) + "</mrow>"


def sub(a, b):
    return f"<msub>{a}{b}</msub>"


def sup(a, b):
    return f"<msup>{a}{b}</msup>"


def subsup(a, b, c):
    return f"<msubsup>{a}{b}{c}</msubsup>"


def frac(a, b):
    return f"<mfrac>{a}{b}</mfrac>"


def sqrt(a):
    return f"<msqrt>{a}</msqrt>"


def paren(*xs):
    return row(o("("), *xs, o(")"))


def under(a, b):
    return f"<munder>{a}{b}</munder>"


def fn(name, *args):
    return row(i(name) if len(name) == 1 else f'<mi mathvariant="normal">{name}</mi>', o("&#x2061;"), paren(*args))


SUM = o("&#x2211;")
T = i("&#x22A4;")  # transpose
DOT = o("&#x22C5;")
HAD = o("&#x2299;")  # Hadamard product
EQ, PLUS, MINUS, LE, LT = o("="), o("+"), o("&#x2212;"), o("&#x2264;"), o("&lt;")
SOFTMAX = '<mi mathvariant="normal">softmax</mi>'


def math_block(body: str, label: str) -> str:
    return f"<math display=\"block\" aria-label=\"{html.escape(html.unescape(label))}\">{body}</math>"


_sdpa = row(fn("Attention", i("Q"), o(","), i("K"), o(","), i("V")), EQ,
            SOFTMAX, paren(frac(row(i("Q"), sup(i("K"), T)), sqrt(sub(i("d"), i("k")))), PLUS, i("B"),
                           o(";"), i("M")), i("V"))

FORMULAS = {
    "masks": [
        ("padding: key j of sequence b is kept while j is shorter than its length",
         row(sub(i("M"), row(i("b"), o(","), i("j"))), EQ, o("["), i("j"), LT, sub(i("&#x2113;"), i("b")), o("]"))),
        ("look-ahead (causal): query i sees keys up to i plus the alignment offset",
         row(sub(i("M"), row(i("i"), o(","), i("j"))), EQ, o("["), i("j"), LE, i("i"), PLUS, i("o"), o("]"), o(","),
             o("&#x2003;"), i("o"), EQ, n("0"), t(" (top-left) or "), sub(i("L"), i("k")), MINUS, sub(i("L"), i("q")),
             t(" (bottom-right)"))),
        ("sliding window around the query's position p = i + o",
         row(sub(i("M"), row(i("i"), o(","), i("j"))), EQ, o("["), i("p"), MINUS, sub(i("w"), i("l")), LE, i("j"),
             LE, i("p"), PLUS, sub(i("w"), i("r")), o("]"))),
        ("combined masks, and the additive bias form",
         row(i("M"), EQ, sub(i("M"), n("1")), o("&#x2227;"), sub(i("M"), n("2")), o(","), o("&#x2003;"),
             sub(i("B"), row(i("i"), o(","), i("j"))), EQ, n("0"), t(" where "), i("M"), t(", "), MINUS,
             i("&#x221E;"), t(" elsewhere"))),
    ],
    "positional": [
        ("the sinusoidal table, sin and cos interleaved",
         row(sub(i("PE"), row(i("p"), o(","), n("2"), i("i"))), EQ,
             fn("sin", frac(i("p"), sup(n("10000"), row(n("2"), i("i"), o("/"), i("D"))))), o(","), o("&#x2003;"),
             sub(i("PE"), row(i("p"), o(","), n("2"), i("i"), PLUS, n("1"))), EQ,
             fn("cos", frac(i("p"), sup(n("10000"), row(n("2"), i("i"), o("/"), i("D"))))))),
        ("added to the embeddings; the gradient passes through unchanged",
         row(i("y"), EQ, i("x"), PLUS, sub(i("PE"), row(n("0"), o(":"), i("L"))), o(","), o("&#x2003;"),
             frac(row(o("&#x2202;"), i("&#x2113;")), row(o("&#x2202;"), i("x"))), EQ,
             frac(row(o("&#x2202;"), i("&#x2113;")), row(o("&#x2202;"), i("y"))))),
    ],
    "softmax": [
        ("masked, stable softmax: m is the largest valid entry; invalid entries (and fully masked rows) give 0",
         row(sub(i("p"), i("j")), EQ, frac(row(sub(i("M"), i("j")), sup(i("e"), row(sub(i("x"), i("j")), MINUS, i("m")))),
                                           row(under(SUM, row(i("k"), o(":"), sub(i("M"), i("k")))),
                                               sup(i("e"), row(sub(i("x"), i("k")), MINUS, i("m"))))))),
        ("backward",
         row(sub(i("dx"), i("j")), EQ, sub(i("p"), i("j")), paren(sub(i("dp"), i("j")), MINUS,
                                                                   under(SUM, i("k")), sub(i("p"), i("k")), sub(i("dp"), i("k"))))),
    ],
    "sdpa": [
        ("scaled dot-product attention (B: optional bias, M: mask; softcap c: s &#x2192; c tanh(s / c))", _sdpa),
        ("backward, with S the scaled scores and P = softmax(S)",
         row(i("dV"), EQ, sup(i("P"), T), i("dO"), o(","), o("&#x2003;"), i("dP"), EQ, i("dO"), sup(i("V"), T), o(","),
             o("&#x2003;"), i("dS"), EQ, i("P"), HAD, paren(i("dP"), MINUS, t("rowsum"), paren(i("P"), HAD, i("dP"))),
             o(","), o("&#x2003;"), i("dQ"), EQ, frac(row(i("dS"), i("K")), sqrt(sub(i("d"), i("k")))), o(","),
             o("&#x2003;"), i("dK"), EQ, frac(row(sup(i("dS"), T), i("Q")), sqrt(sub(i("d"), i("k")))))),
    ],
    "additive": [
        ("Bahdanau's additive score, weights and context",
         row(sub(i("e"), row(i("i"), o(","), i("j"))), EQ, sup(i("v"), T), fn("tanh", sub(i("k"), i("j")), sub(i("W"), n("1")),
                                                                             PLUS, sub(i("q"), i("i")), sub(i("W"), n("2"))),
             o(","), o("&#x2003;"), i("&#x3B1;"), EQ, SOFTMAX, paren(i("e"), o(";"), i("M")), o(","), o("&#x2003;"),
             sub(i("c"), i("i")), EQ, under(SUM, i("j")), sub(i("&#x3B1;"), row(i("i"), o(","), i("j"))), sub(i("k"), i("j")))),
    ],
    "mha": [
        ("each head attends in its own projection (GQA: key/value heads shared by groups of query heads)",
         row(sub(i("head"), i("h")), EQ, fn("Attention", i("X"), subsup(i("W"), i("q"), i("h")), o(","),
                                             i("X"), subsup(i("W"), i("k"), i("h")), o(","), i("X"), subsup(i("W"), i("v"), i("h"))))),
        ("the heads concatenated and projected back to d_model",
         row(fn("MHA", i("X")), EQ, fn("Concat", sub(i("head"), n("1")), o(","), o("&#x2026;"), o(","), sub(i("head"), i("H"))),
             sub(i("W"), i("o")), PLUS, sub(i("b"), i("o")))),
    ],
    "layers": [
        ("layer norm (biased variance, &#x3B5; inside the root)",
         row(fn("LN", i("x")), EQ, i("&#x3B3;"), HAD, frac(row(i("x"), MINUS, i("&#x3BC;")), sqrt(row(sup(i("&#x3C3;"), n("2")), PLUS, i("&#x3B5;")))),
             PLUS, i("&#x3B2;"))),
        ("position-wise feed-forward (relu or exact gelu)",
         row(fn("FFN", i("x")), EQ, fn("act", i("x"), sub(i("W"), n("1")), PLUS, sub(i("b"), n("1"))), sub(i("W"), n("2")), PLUS, sub(i("b"), n("2")))),
        ("inverted dropout: kept entries scaled up, so inference is the identity",
         row(fn("drop", i("x")), EQ, frac(row(i("m"), HAD, i("x")), row(n("1"), MINUS, i("p"))), o(","), o("&#x2003;"),
             sub(i("m"), i("j")), o("&#x223C;"), fn("Bernoulli", n("1"), MINUS, i("p")))),
    ],
    "encoder": [
        ("post-norm encoder layer (pre-norm: LN inside the residual branch)",
         row(i("h"), EQ, sub(i("LN"), n("1")), paren(i("x"), PLUS, fn("MHA", i("x"), o(","), i("x"), o(","), i("x"), o(";"), i("M"))),
             o(","), o("&#x2003;"), i("y"), EQ, sub(i("LN"), n("2")), paren(i("h"), PLUS, fn("FFN", i("h"))))),
    ],
    "decoder": [
        ("post-norm decoder layer: masked self-attention, cross-attention on the memory m, feed-forward",
         row(sub(i("h"), n("1")), EQ, sub(i("LN"), n("1")), paren(i("x"), PLUS, fn("MHA", i("x"), o(","), i("x"), o(","), i("x"), o(";"), sub(i("M"), t("causal")))),
             o(","), o("&#x2003;"), sub(i("h"), n("2")), EQ, sub(i("LN"), n("2")), paren(sub(i("h"), n("1")), PLUS, fn("MHA", sub(i("h"), n("1")), o(","), i("m"), o(","), i("m"))),
             o(","), o("&#x2003;"), i("y"), EQ, sub(i("LN"), n("3")), paren(sub(i("h"), n("2")), PLUS, fn("FFN", sub(i("h"), n("2")))))),
    ],
    "cache": [
        ("a decoding step appends its key and value and attends over everything cached so far",
         row(sub(i("K"), row(n("1"), o(":"), i("t"))), EQ, o("["), sub(i("K"), row(n("1"), o(":"), i("t"), MINUS, n("1"))), o(";"),
             sub(i("x"), i("t")), sub(i("W"), i("k")), o("]"), o(","), o("&#x2003;"), sub(i("o"), i("t")), EQ, SOFTMAX,
             paren(frac(row(sub(i("q"), i("t")), sup(sub(i("K"), row(n("1"), o(":"), i("t"))), T)), sqrt(sub(i("d"), i("k"))))),
             sub(i("V"), row(n("1"), o(":"), i("t"))))),
    ],
    "blockwise": [
        ("online softmax over key blocks j: the running maximum m, sum &#x2113; and output O are rescaled",
         row(sup(i("m"), o("&#x2032;")), EQ, fn("max", i("m"), o(","), t("rowmax"), paren(sub(i("S"), i("j")))), o(","), o("&#x2003;"),
             sup(i("&#x2113;"), o("&#x2032;")), EQ, sup(i("e"), row(i("m"), MINUS, sup(i("m"), o("&#x2032;")))), i("&#x2113;"), PLUS,
             t("rowsum"), paren(sup(i("e"), row(sub(i("S"), i("j")), MINUS, sup(i("m"), o("&#x2032;"))))))),
        ("the output, normalised once at the end",
         row(sup(i("O"), o("&#x2032;")), EQ, sup(i("e"), row(i("m"), MINUS, sup(i("m"), o("&#x2032;")))), i("O"), PLUS,
             sup(i("e"), row(sub(i("S"), i("j")), MINUS, sup(i("m"), o("&#x2032;")))), sub(i("V"), i("j")), o(","), o("&#x2003;"),
             i("out"), EQ, frac(i("O"), i("&#x2113;")))),
    ],
    "variants": [
        ("RoPE (\"half\" convention): rotate by position times a per-pair frequency",
         row(sup(i("x"), o("&#x2032;")), EQ, i("x"), HAD, fn("cos", i("p"), i("&#x3B8;")), PLUS, fn("rotate_half", i("x")), HAD,
             fn("sin", i("p"), i("&#x3B8;")), o(","), o("&#x2003;"), sub(i("&#x3B8;"), i("i")), EQ,
             sup(i("base"), row(MINUS, n("2"), i("i"), o("/"), sub(i("D"), i("h")))))),
        ("ALiBi: a linear distance penalty per head, slopes 2^(-8(h+1)/H)",
         row(sub(i("B"), row(i("h"), o(","), i("i"), o(","), i("j"))), EQ, MINUS, sub(i("m"), i("h")), paren(sub(i("p"), i("i")), MINUS, i("j")),
             o(","), o("&#x2003;"), sub(i("m"), i("h")), EQ, sup(n("2"), row(MINUS, n("8"), paren(i("h"), PLUS, n("1")), o("/"), i("H"))))),
        ("softcap on the scores, and GQA's sharing of key/value heads",
         row(sup(i("s"), o("&#x2032;")), EQ, i("c"), fn("tanh", i("s"), o("/"), i("c")), o(","), o("&#x2003;"),
             t("kv head of query head "), i("h"), EQ, o("&#x230A;"), i("h"), o("/"), paren(i("H"), o("/"), sub(i("H"), t("kv"))), o("&#x230B;"))),
    ],
    "sharded": [
        ("merging partial attentions by their log-sum-exp",
         row(i("lse"), EQ, fn("log", under(SUM, i("i")), sup(i("e"), sub(i("lse"), i("i")))), o(","), o("&#x2003;"),
             i("out"), EQ, under(SUM, i("i")), sup(i("e"), row(sub(i("lse"), i("i")), MINUS, i("lse"))), sub(i("out"), i("i")))),
    ],
}
