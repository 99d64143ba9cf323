"""The contract's tables: parameter keys, dropout sites, choices, widths.

What a parameter dict of each block holds (``MHA_KEYS``, ``FEED_FORWARD_KEYS``,
``LAYER_KEYS``, ...; SPEC section 2.1), the keep-mask sites of a layer
(``DROPOUT_SITES``, ``DECODER_DROPOUT_SITES``; SPEC 3.12), the choices an
argument may take (``ACTIVATIONS``, ``ALIGNS`` of SPEC 3.19,
``ROPE_CONVENTIONS`` of SPEC 3.23), the shape letters that are widths
(``WIDTHS``: never 0; SPEC 3.16) and, private to the rules, the letters of
every parameter's shape (``_MHA``, ``_FFN``, ...). Data only: this module
imports nothing, and every other module of the contract may read it.
"""
from __future__ import annotations

__all__ = [
    "MHA_KEYS", "ADDITIVE_KEYS", "LAYER_NORM_KEYS", "FEED_FORWARD_KEYS", "LAYER_KEYS",
    "ENCODER_KEYS", "DROPOUT_SITES", "ACTIVATIONS", "WIDTHS", "CELL_KEYS", "SEQ2SEQ_KEYS",
    "DECODER_LAYER_KEYS", "DECODER_DROPOUT_SITES", "TRANSFORMER_KEYS", "TRANSFORMER_DROPOUT_SITES",
    "ALIGNS", "ROPE_CONVENTIONS",
]

# --------------------------------------------------------------------------
# the parameter keys, dropout sites and choices

MHA_KEYS = ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "w_o", "b_o")
ADDITIVE_KEYS = ("w_1", "w_2", "v")
LAYER_NORM_KEYS = ("gamma", "beta")
FEED_FORWARD_KEYS = ("w_1", "b_1", "w_2", "b_2")
LAYER_KEYS = ("self_attn", "ffn", "norm1", "norm2")
ENCODER_KEYS = ("layers",)  # and "norm", optional
DROPOUT_SITES = ("attention", "ffn", "residual_attn", "residual_ffn")
ACTIVATIONS = ("relu", "gelu")
CELL_KEYS = ("w_ih", "w_hh", "b_ih", "b_hh")  # an RNN or GRU cell
SEQ2SEQ_KEYS = ("src_embed", "tgt_embed", "encoder", "decoder", "out")  # and "attention", with attention
DECODER_LAYER_KEYS = ("self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3")
#: the decoder layer's keep-mask sites: the encoder's four, and the cross-attention's two
DECODER_DROPOUT_SITES = ("attention", "cross_attention", "ffn", "residual_attn", "residual_cross",
                         "residual_ffn")
TRANSFORMER_KEYS = ("src_embed", "tgt_embed", "encoder", "decoder", "out")
#: the transformer's dropout_masks keys: the two embedding sums, and each stack's list
TRANSFORMER_DROPOUT_SITES = ("src_embed", "tgt_embed", "encoder", "decoder")
#: where a causal mask puts the last query when Lq != Lk (SPEC 3.2)
ALIGNS = ("top_left", "bottom_right")
#: the two rotary-embedding pairings (SPEC 3.23): ``x[i]`` with ``x[i + Dh/2]``
#: (GPT-NeoX, Hugging Face ``rotate_half``) or ``x[2i]`` with ``x[2i + 1]`` (GPT-J, Meta)
ROPE_CONVENTIONS = ("half", "interleaved")

# --------------------------------------------------------------------------
# the shape letters: widths, and every parameter's shape

#: shape letters of widths: never 0 (a batch or length axis may be)
WIDTHS = frozenset({"D", "Dk", "Dv", "Dq", "Dh", "Dkv", "A", "F", "D_in", "D_out",
                    "I", "Hs", "3Hs", "2Hs", "E", "E+Hs", "Vs", "Vt", "V"})

_MHA = {k: ("D", "D") if k.startswith("w") else ("D",) for k in MHA_KEYS}
#: grouped-query attention: the key and value projections are ``Hkv`` heads wide
_MHA_GQA = {**_MHA, "w_k": ("D", "Dkv"), "b_k": ("Dkv",), "w_v": ("D", "Dkv"), "b_v": ("Dkv",)}
_FFN = {"w_1": ("D", "F"), "b_1": ("F",), "w_2": ("F", "D"), "b_2": ("D",)}
_NORM = {"gamma": ("D",), "beta": ("D",)}
_ADDITIVE = {"w_1": ("Dk", "A"), "w_2": ("Dq", "A"), "v": ("A",)}
#: a recurrent cell, G = Hs (RNN) or 3Hs (GRU: the gates [r | z | n] side by side)
_CELL = {"w_hh": ("Hs", "G"), "w_ih": ("I", "G"), "b_ih": ("G",), "b_hh": ("G",)}
_EMBED = {"src_embed": ("Vs", "E"), "tgt_embed": ("Vt", "E")}
_OUT = {"w": ("2Hs", "Vt"), "b": ("Vt",)}
_BAHDANAU = {"w_1": ("Hs", "A"), "w_2": ("Hs", "A"), "v": ("A",)}  # additive attention, Dk = Dq = Hs
#: the blocks of one layer and their leaf tables
_ENCODER_BLOCKS = {"self_attn": _MHA, "ffn": _FFN, "norm1": _NORM, "norm2": _NORM}
_DECODER_BLOCKS = {"self_attn": _MHA, "cross_attn": _MHA, "ffn": _FFN, "norm1": _NORM, "norm2": _NORM,
                   "norm3": _NORM}
_TOKEN_EMBED = {"src_embed": ("Vs", "D"), "tgt_embed": ("Vt", "D")}
_PROJECTION = {"w": ("D", "Vt"), "b": ("Vt",)}
_TIED_PROJECTION = {"b": ("Vt",)}  # logits = y @ tgt_embedᵀ + b
