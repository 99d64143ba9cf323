"""What the benchmark ran on: the machine's float32 matmul peak, and the
header of the report (versions, threads, BLAS, CPU, devices, load)."""
from __future__ import annotations

import datetime
import os
import pathlib
import platform

import numpy as np

from .runner_base import time_calls


def measure_matmul_peak(n, repeats, torch_device, jax_device, precision="highest"):
    """Best-of-``repeats`` GFLOP/s of an ``n x n`` float32 matmul per framework;
    ``peak_gflops`` keeps the best per device class ("cpu", "gpu")."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    rows = [_matmul_row("numpy", "cpu", lambda: a @ b, n, repeats)]
    try:
        import torch

        ta, tb = (torch.as_tensor(m, device=torch_device) for m in (a, b))
        sync = torch.cuda.synchronize if torch_device != "cpu" else (lambda: None)
        rows.append(_matmul_row("torch", "gpu" if torch_device != "cpu" else "cpu",
                                lambda: (ta @ tb, sync()), n, repeats))
    except ImportError:
        pass
    try:
        import jax

        device = jax_device or jax.devices()[0]
        ja, jb = (jax.device_put(m, device) for m in (a, b))
        with jax.default_matmul_precision(precision):
            mm = jax.jit(lambda x, y: x @ y).lower(ja, jb).compile()
        rows.append(_matmul_row("jax", device.platform,
                                lambda: mm(ja, jb).block_until_ready(), n, repeats))
    except ImportError:
        pass
    peak = {}
    for row in rows:
        peak[row["device"]] = max(peak.get(row["device"], 0.0), row["gflops"])
    return {"n": n, "dtype": "float32", "results": rows, "peak_gflops": peak}


def _matmul_row(framework, device, call, n, repeats):
    call()
    best = min(time_calls(call, 1) for _ in range(repeats))
    return {"framework": framework, "device": device, "best_s": best,
            "gflops": 2 * n**3 / best / 1e9}


def header(argv, args, torch_device, jax_device):
    header = {
        "command": " ".join(["python -m conformance bench", *argv]),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(),
        "loadavg_start": loadavg(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "cpus_usable": cpus_usable(), "cpu_simd": _cpu_simd(),
        "dtype": args.dtype, "matmul_precision": args.matmul_precision,
        "repeats": args.repeats, "warmup": args.warmup, "min_sample_s": args.min_time,
        "numpy": np.__version__, "numpy_blas": blas_info(),
        "env": {k: os.environ.get(k) for k in (
            "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XLA_FLAGS",
            "XLA_PYTHON_CLIENT_PREALLOCATE")},
        "torch": None, "torch_device": torch_device, "torch_num_threads": None,
        "jax": None, "jax_device": None,
    }
    try:
        import torch

        header.update(torch=torch.__version__, torch_num_threads=torch.get_num_threads())
        if torch_device != "cpu":
            header["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    try:
        import jax

        header.update(jax=jax.__version__, jax_device=str(jax_device or jax.devices()[0]))
    except ImportError:
        pass
    return header


def blas_info():
    try:
        from threadpoolctl import threadpool_info

        return {"source": "threadpoolctl", "pools": [
            {k: p.get(k) for k in ("internal_api", "version", "num_threads", "threading_layer")}
            for p in threadpool_info()]}
    except ImportError:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return {"source": "numpy.show_config (threadpoolctl not installed: thread count unknown)",
                "name": blas.get("name"), "version": blas.get("version"),
                "config": blas.get("openblas configuration")}


def cpu_model():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _cpu_simd():
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = set(next((l for l in text.splitlines() if l.startswith("flags")), "").split())
    return [f for f in ("avx512f", "avx2", "fma", "avx512_bf16", "amx_bf16") if f in flags]


def cpus_usable():
    """CPUs this process may run on (``taskset``, cgroups' cpusets), if the OS says."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def loadavg():
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on every platform
        return None
