"""The rules of the sharded KV cache (SPEC section 3.25).

``init_sharded_cache``, ``sharded_self_attention_step`` (the global view of
numpy_ref and jax_impl: the whole cache, its slot axis cut into
``num_shards`` blocks; ``local=True``: torch_impl's one rank, its own block)
and ``sharded_self_attention_incremental``. Everything a plain cache checks
(3.20), plus the shard count, the layout and a capacity the shards divide.
"""
from __future__ import annotations

from ..arguments import shape_str
from ..kv_shards import LAYOUTS

__all__ = ["ShardedCacheRules"]


class ShardedCacheRules:
    """The sharded KV cache's validation (a mixin of ``Rules``)."""

    def _cache_shards(self, num_shards, layout) -> int:
        """A positive shard count and a cache layout; returns ``N``."""
        N = self.count(num_shards, "num_shards", 1)
        self.choice(layout, "layout", LAYOUTS)
        return N

    def _capacity_shards(self, C, N) -> None:
        if C % N:
            raise ValueError(f"capacity: expected a multiple of num_shards={N} (each device holds C / {N} "
                             f"slots), got {C}")

    def init_sharded_cache(self, batch_size, num_heads, capacity, d_model, num_kv_heads, num_shards,
                           layout) -> tuple:
        """``init_sharded_cache``: :meth:`init_attention_cache`'s counts, ``Hkv``
        dividing ``H``, ``num_shards >= 1`` dividing the capacity, a layout.
        Returns ``(B, H, C, D, Hkv, N)``."""
        B, H, C, D = self.init_attention_cache(batch_size, num_heads, capacity, d_model)
        Hkv = self.kv_heads(num_kv_heads, H)
        N = self._cache_shards(num_shards, layout)
        self._capacity_shards(C, N)
        return B, H, C, D, Hkv, N

    def sharded_self_attention_step(self, x, params, num_heads, cache, num_kv_heads, rope, rope_base,
                                    softcap, alibi_slopes, num_shards, layout, local=False) -> tuple:
        """``sharded_self_attention_step``: :meth:`self_attention_step`'s ``x``,
        params and options; a cache of ``(B, Hkv, C, Dh)`` (``local``: this rank's
        block ``(B, Hkv, C / N, Dh)``) whose ``C`` the ``N`` shards divide, with
        room for ``T`` more tokens in the whole cache. Returns ``(Hkv, N)``, ``N`` a
        Python int (a 0-d array count read once: the mirrors key programs and meshes on it)."""
        N = self._cache_shards(num_shards, layout)
        B, T, D, H, Hkv = self._self_attention(x, params, num_heads, num_kv_heads, rope, rope_base, softcap,
                                               alibi_slopes)
        C = self._attention_cache(cache, "cache", x, B, Hkv, D // H, T, heads="Hkv" if Hkv != H else "H",
                                  devices=N if local else 1)
        if not local and C % N:
            raise ValueError(f"cache.k: expected shape (B, Hkv, C, Dh) with C divisible by {N} "
                             f"(num_shards={N}), got {shape_str(cache['k'].shape)}")
        return Hkv, N

    def sharded_self_attention_incremental(self, x, params, num_heads, chunks, num_kv_heads, rope, rope_base,
                                           softcap, alibi_slopes, num_shards, layout, capacity) -> tuple:
        """``sharded_self_attention_incremental``: :meth:`self_attention_incremental`'s
        arguments, the shards and layout, and a capacity of at least ``L`` that the
        shards divide (None: ``L`` rounded up to a multiple of ``N``). Returns
        ``(chunks, Hkv, N, C)``."""
        chunks, Hkv = self.self_attention_incremental(x, params, num_heads, chunks, num_kv_heads, rope,
                                                      rope_base, softcap, alibi_slopes)
        N = self._cache_shards(num_shards, layout)
        L = int(x.shape[1])
        if capacity is None:
            return chunks, Hkv, N, -(-L // N) * N
        C = self.count(capacity, "capacity")
        if C < L:
            raise ValueError(f"capacity: expected at least L={L} slots (every token is cached), got {C}")
        self._capacity_shards(C, N)
        return chunks, Hkv, N, C
