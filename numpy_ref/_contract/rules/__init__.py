"""The bad-input contract of every public function, written once (SPEC section 3.16).

Each module here holds the validation sequence of the public functions of
one SPEC section, as a mixin class, composed from the rules for one argument
(``arguments.py``: :class:`~numpy_ref._contract.arguments.ArrayRules`, and
the messages) and the key tables (``tables.py``):

================ ===================== ========================================
module           mixin                 SPEC sections
================ ===================== ========================================
masks.py         ``MaskRules``         3.2 masks (3.19 alignment, 3.22 window)
attention.py     ``AttentionRules``    3.5-3.8 softmax, sdpa, additive, mha
variants.py      ``VariantRules``      3.23 rotary embedding, ALiBi
blockwise.py     ``BlockwiseRules``    3.22 blockwise attention
sharded.py       ``ShardedRules``      3.24 sharded attention
sharded_cache.py ``ShardedCacheRules`` 3.25 the sharded KV cache
layers.py        ``LayerRules``        3.9-3.15 layers, encoder layer and stack
recurrent.py     ``RecurrentRules``    3.17 recurrent networks, encoder-decoder
decoder.py       ``DecoderRules``      3.18-3.20 decoder, KV cache
transformer.py   ``TransformerRules``  3.21 Transformer, loss, decoding
backward.py      ``BackwardRules``     1.3 numpy_ref's backward passes
================ ===================== ========================================

:class:`Rules` is all of them over ``ArrayRules``: ``rules.mha`` is found in
``attention.py``, ``rules.decoder_step`` in ``decoder.py``. The rules read
only ``.shape``, ``.ndim`` and ``.dtype``, a dtype *kind* ("float", "bool",
"int", "other") and a few hooks, so one :class:`Rules` serves numpy arrays,
torch tensors and JAX arrays alike. Each mirror's ``_checks.py`` builds its
``rules`` from:

- ``kind(x)``: the dtype kind of one of its arrays;
- ``is_array(x)`` and ``array_name``: what counts as its array (a numpy
  array passed to ``torch_impl`` is a ``TypeError`` naming both kinds);
- ``device``: torch only, ``x -> device``; arrays of one call share it;
- ``is_concrete``: JAX only, False for a tracer; value rules (lengths within
  ``max_len``) then wait for concrete arrays, shape and dtype rules do not.

So the same bad call raises the same exception with the same message in
every package, and under ``jax.jit`` it raises while tracing.
"""
from __future__ import annotations

from ..arguments import ArrayRules
from .attention import AttentionRules
from .backward import BackwardRules
from .blockwise import BlockwiseRules
from .decoder import DecoderRules
from .layers import LayerRules
from .masks import MaskRules
from .recurrent import RecurrentRules
from .sharded import ShardedRules
from .sharded_cache import ShardedCacheRules
from .transformer import TransformerRules
from .variants import VariantRules

__all__ = ["Rules"]


class Rules(MaskRules, AttentionRules, VariantRules, BlockwiseRules, ShardedRules, ShardedCacheRules,
            LayerRules, RecurrentRules, DecoderRules, TransformerRules, BackwardRules, ArrayRules):
    """Every public function's validation, bound to one mirror's arrays (see the module docstring)."""
