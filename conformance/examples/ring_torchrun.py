"""Ring attention under ``torchrun``: each rank runs ``torch_impl.ring_attention``
on its shards, rank 0 checks the assembled result against numpy_ref.

    torchrun --standalone --nproc-per-node 4 -m conformance.examples.ring_torchrun
    torchrun --standalone --nproc-per-node 8 -m conformance.examples.ring_torchrun --device cuda --dtype float32

Every rank draws the same global ``q``, ``k``, ``v``, key-padding mask and
cotangents from one seed, keeps its shards (``shard_sequence(x, world,
layout=...)[rank]``), runs the ring forward and its backward (the reverse
ring, with cotangents on ``out`` and ``lse``), and sends its shards of
``out``, ``lse`` and the gradients to rank 0, which puts them back in
sequence order and compares them with ``numpy_ref.blockwise_attention`` and
its hand-derived backward in float64. Exit status 1 when the worst error
exceeds the dtype's bound (float64 1e-12; float32 1e-5 and bfloat16 3e-2,
relative to the largest value). gloo on the CPU, NCCL with one GPU per rank
(``--device cuda``: rank ``r`` uses ``cuda:r``, as ``LOCAL_RANK`` says).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

BOUND = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 3e-2}


def parse(argv=None):
    p = argparse.ArgumentParser(prog="torchrun ... -m conformance.examples.ring_torchrun",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=64, help="sequence length L (divisible by 2 x world for zigzag)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--layout", choices=("contiguous", "zigzag"), default="zigzag")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--dtype", choices=sorted(BOUND), default="float64")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    import numpy_ref
    import torch_impl

    args = parse(argv)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)

    rng = np.random.default_rng(0)  # the same draw on every rank
    B, H, Hkv, D, L = 2, args.heads, args.kv_heads, args.head_dim, args.length
    q, k, v = rng.standard_normal((B, H, L, D)), rng.standard_normal((B, Hkv, L, D)), rng.standard_normal((B, Hkv, L, D))
    mask = np.ones((B, 1, 1, L), dtype=bool)
    mask[0, ..., L - L // 3:] = False  # padding that ends inside a shard
    d_out, d_lse = rng.standard_normal((B, H, L, D)), rng.standard_normal((B, H, L))

    def local(x):
        part = numpy_ref.shard_sequence(x, world, layout=args.layout)[rank]
        return torch.from_numpy(np.ascontiguousarray(part)).to(device=device, dtype=dtype)

    q_r, k_r, v_r = (local(x).requires_grad_(True) for x in (q, k, v))
    out, lse = torch_impl.ring_attention(q_r, k_r, v_r, torch.from_numpy(mask).to(device),
                                         causal=args.causal, layout=args.layout)
    cot_lse = local(d_lse[..., None])[..., 0].to(lse.dtype)
    torch.autograd.backward([out, lse], [local(d_out).to(out.dtype), cot_lse])
    mine = [t.detach().double().cpu().numpy() for t in (out, lse, q_r.grad, k_r.grad, v_r.grad)]
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    status = 0
    if rank == 0:
        names = ("out", "lse", "q", "k", "v")
        got = {}
        for i, name in enumerate(names):
            axis = -1 if name == "lse" else -2
            got[name] = numpy_ref.unshard_sequence([g[i] for g in gathered], layout=args.layout, axis=axis)
        want_out, want_lse = numpy_ref.blockwise_attention(q, k, v, mask, causal=args.causal)
        grads = numpy_ref.blockwise_attention_backward((d_out, d_lse), q, k, v, mask, causal=args.causal)
        want = {"out": want_out, "lse": want_lse, **grads}
        print(f"ring attention on {world} rank(s) ({'nccl' if cuda else 'gloo'}, {args.dtype}, "
              f"{args.layout}, causal={args.causal}), B={B} H={H} Hkv={Hkv} L={L} D={D}:")
        for name in names:
            finite = np.isfinite(want[name])
            same_inf = np.array_equal(np.isfinite(got[name]), finite)
            scale = max(1.0, float(np.max(np.abs(want[name][finite]), initial=0.0)))
            err = float(np.max(np.abs(got[name][finite] - want[name][finite]), initial=0.0)) / scale
            ok = same_inf and err <= BOUND[args.dtype]
            status |= not ok
            print(f"  {name:4s} worst error {err:.1e} (relative to the largest, bound {BOUND[args.dtype]:.0e})"
                  f"{'' if same_inf else ', -inf in other places'}: {'ok' if ok else 'FAIL'}")
    flags = torch.tensor([status], device=device)
    dist.broadcast(flags, 0)
    dist.destroy_process_group()
    return int(flags.item())


if __name__ == "__main__":
    sys.exit(main())
