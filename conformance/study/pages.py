"""The pages of the study site: one per building block, what each shows."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BLOCKS", "Block"]


@dataclass(frozen=True)
class Block:
    """A block page.

    slug: file name (``<slug>.html``) and the key of formulas, shapes and figures.
    module: the file of its functions in every mirror (``numpy_ref/<module>.py``, ...).
    functions: whose source is shown (numpy's ``<name>_backward`` next to it when it exists).
    status: ``(label, predicate(case))`` rows of the badge table; default one per function.
    """

    slug: str
    title: str
    module: str
    functions: tuple
    intro: str
    status: tuple = field(default=())

    def status_rows(self):
        if self.status:
            return self.status
        return tuple((f, (lambda case, f=f: case.function == f)) for f in self.functions)


def _fn(name):
    return lambda case: case.function == name


BLOCKS = (
    Block("masks", "Masks", "masks",
          ("padding_mask", "causal_mask", "sliding_window_mask", "combine_masks", "mask_to_bias"),
          "Boolean masks (True = attend) for padding, look-ahead, sliding windows and their combination; "
          "the alignment decides where a shorter query block sits among the keys. mask_to_bias turns a mask "
          "into the additive form some frameworks take."),
    Block("positional", "Positional encoding", "positional", ("sinusoidal_encoding", "add_positional_encoding"),
          "The sinusoidal table of the original Transformer, added to the embeddings."),
    Block("softmax", "Softmax", "attention", ("softmax",),
          "The masked, numerically stable softmax: masked entries get exactly 0, and a fully masked row is all "
          "zeros (not NaN, not the uniform average the -1e9 trick gives)."),
    Block("sdpa", "Scaled dot-product attention", "attention", ("scaled_dot_product_attention",),
          "Scores, mask and bias, softmax, weighted sum of the values; with optional dropout and softcap."),
    Block("additive", "Additive attention", "attention", ("additive_attention",),
          "Bahdanau's attention: a small network scores each (query, key) pair."),
    Block("mha", "Multi-head attention", "attention", ("multi_head_attention",),
          "Project, split into heads, attend per head, merge and project back; grouped-query attention "
          "(num_kv_heads) and RoPE are options of the same function."),
    Block("layers", "Layer norm, feed-forward, dropout", "layers", ("linear", "layer_norm", "feed_forward", "dropout"),
          "The position-wise pieces around attention."),
    Block("encoder", "Encoder layer", "encoder", ("encoder_layer", "encoder"),
          "Self-attention and feed-forward with residuals and layer norms (post-norm or pre-norm)."),
    Block("decoder", "Decoder layer", "decoder", ("decoder_layer", "decoder"),
          "Causal self-attention, cross-attention on the encoder's memory, feed-forward."),
    Block("cache", "KV cache", "cache",
          ("self_attention_step", "self_attention_incremental", "decoder_step", "decoder_incremental"),
          "Incremental decoding: each step appends its keys and values to a cache and attends over it "
          "(bottom-right aligned causal mask); the incremental result equals the full pass.",
          status=(("self_attention_incremental", _fn("self_attention_incremental")),
                  ("decoder_step", _fn("decoder_step")), ("decoder_incremental", _fn("decoder_incremental")))),
    Block("blockwise", "Blockwise attention", "blockwise", ("blockwise_attention", "block_schedule"),
          "Attention over key blocks with an online softmax (the FlashAttention recurrence): never the full "
          "L x L matrix; blocks a causal or sliding-window mask hides entirely are skipped.",
          status=(("blockwise_attention", _fn("blockwise_attention")),)),
    Block("variants", "Modern variants: GQA, RoPE, ALiBi, softcap", "variants",
          ("rotary_embedding", "alibi_slopes", "alibi_bias"),
          "Rotary position embeddings, ALiBi's linear biases, grouped-query attention and logit softcapping "
          "(the last two are options of scaled_dot_product_attention and multi_head_attention: their cases "
          "are the GQA and softcap rows below).",
          status=(("rotary_embedding", _fn("rotary_embedding")), ("alibi_slopes", _fn("alibi_slopes")),
                  ("alibi_bias", _fn("alibi_bias")),
                  ("GQA cases (gqa/...)", lambda case: case.name.startswith("gqa/")),
                  ("softcap cases (softcap/...)", lambda case: case.name.startswith("softcap/")))),
    Block("sharded", "Sharded attention", "sharded",
          ("merge_attention", "ring_attention", "sharded_attention", "ring_schedule"),
          "Attention split over devices: partial results merged by their log-sum-exp, ring attention passing "
          "key/value shards around (contiguous or zigzag layout), batch and head sharding.",
          status=(("merge_attention", _fn("merge_attention")), ("ring_attention", _fn("ring_attention")),
                  ("sharded_attention", _fn("sharded_attention")))),
)
