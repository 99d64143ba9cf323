"""The dimension sizes of the hand-built tests, declared once.

Every dimension has its own size, so a swapped axis cannot pass: batch B=2,
heads H=3, head width Dh=4, query length Lq=5, value width Dv=6, key length
Lk=7, additive attention width A=8, query and key widths of additive
attention Dq=9 and Dk=11, model width D = H * Dh = 12, feed-forward width
F=20, a positional table of MAX_LEN=13 rows. The catalog cases
(``conformance.catalog``) use the same sizes where they overlap (SPEC section 4).

``from tests.dims import B, H, LQ, LK`` in a test module.
"""
B, H, DH, LQ, DV, LK, A, DQ, DK = 2, 3, 4, 5, 6, 7, 8, 9, 11
D = H * DH  # 12
FF = 20
MAX_LEN = 13
