"""A training workload as the all-reduce sees it: the gradient split into DDP buckets, and the compute per step.

Model presets (parameter counts from the papers that introduced them; the exact count of the released weights
where the paper rounds):

- ``resnet50``: He et al., "Deep Residual Learning for Image Recognition", CVPR 2016 (arXiv:1512.03385), Table 1:
  3.8·10⁹ multiply-adds per 224×224 image; 25,557,032 parameters in the reference (torchvision) weights.
- ``bert-large``: Devlin et al., "BERT", NAACL 2019 (arXiv:1810.04805), §3: L=24, H=1024, A=16, 340M parameters.
- ``gpt2-xl``: Radford et al., "Language Models are Unsupervised Multitask Learners", 2019, Table 2: 1542M.
- ``llama2-7b`` / ``llama2-70b``: Touvron et al., "Llama 2", 2023 (arXiv:2307.09288), Table 1: 7B and 70B;
  6,738,415,616 and 68,976,648,192 parameters in the released weights.

Buckets follow ``torch.nn.parallel.DistributedDataParallel``: parameters are taken in reverse registration order
(the order backward produces their gradients), a bucket closes once it holds at least its cap, the first bucket's
cap is ``_DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) so the all-reduce starts early, the others' is ``bucket_cap_mb``
(25 MiB by default). A preset has no tensor boundaries, so its buckets are exactly 1 MiB, then the cap, then the
remainder.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DDP_BUCKET_CAP_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "GRADIENT_DTYPES",
    "MAX_BUCKETS",
    "PRESETS",
    "TRAINING_FLOPS_PER_PARAM_TOKEN",
    "Model",
    "bucket_count_bound",
    "ddp_buckets",
    "format_count",
    "model_from_module",
    "model_from_params",
    "preset",
]

MiB = 2**20
# torch.distributed._DEFAULT_FIRST_BUCKET_BYTES and DDP's default bucket_cap_mb.
DDP_FIRST_BUCKET_BYTES = 1 * MiB
DDP_BUCKET_CAP_BYTES = 25 * MiB
# Bytes per gradient element.
GRADIENT_DTYPES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
# Training FLOPs of a dense transformer per parameter and token: 2 forward + 4 backward (Kaplan et al. 2020, §2.1).
TRAINING_FLOPS_PER_PARAM_TOKEN = 6.0
# The most DDP buckets a plan takes. Each bucket is one all-reduce in the step's timeline and a column of the
# loss what-if's 1,000 sampled steps: llama2-70b in 5 MiB buckets (26,305 of them) took 700 MB and 20 s
# (`/usr/bin/time allreduce plan --model llama2-70b --gpus 16 --topology fat-tree:k=4 --compute-ms 100
# --bucket-mb 5`), about 27 KB per bucket.
MAX_BUCKETS = 1 << 15
BYTES_PER_BUCKET = 27_000
# Training costs forward + backward ≈ 3 forwards (backward computes gradients of inputs and of weights).
TRAINING_PER_FORWARD_FLOPS = 3.0


@dataclass(frozen=True)
class Model:
    """A model as a gradient: ``tensor_params`` in registration order.

    ``whole_tensors`` says the entries are real tensors, which DDP never splits across buckets; otherwise (a
    preset, a parameter count) the gradient is split wherever a bucket fills. ``forward_flops_per_sample`` is set
    for models whose compute is not 6·params·tokens (CNNs: per image).
    """

    name: str
    tensor_params: tuple[int, ...]
    forward_flops_per_sample: float | None = None
    whole_tensors: bool = False
    # per tensor (registration order): when backward finished its gradient, as a share of backward (measured)
    tensor_ready: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.tensor_params or any(p <= 0 for p in self.tensor_params):
            raise ValueError(f"model {self.name}: every parameter tensor must hold at least one element")
        if self.tensor_ready is not None and (
            len(self.tensor_ready) != len(self.tensor_params) or not self.whole_tensors
        ):
            raise ValueError(f"model {self.name}: ready times need one per tensor, of whole tensors")

    def bucket_ready(self, bucket_bytes: Sequence[int], element_bytes: int) -> tuple[float, ...] | None:
        """Each DDP bucket's ready time (the latest of its tensors'), as a share of backward; None when unmeasured.
        Buckets hold whole tensors in reverse registration order (:func:`ddp_buckets`)."""
        if self.tensor_ready is None:
            return None
        sizes = [p * element_bytes for p in reversed(self.tensor_params)]
        ready = list(reversed(self.tensor_ready))
        shares, i = [], 0
        for nbytes in bucket_bytes:
            filled, latest = 0, 0.0
            while filled < nbytes:
                filled += sizes[i]
                latest = max(latest, ready[i])
                i += 1
            shares.append(latest)
        return tuple(shares)

    @property
    def params(self) -> int:
        return sum(self.tensor_params)

    @property
    def is_transformer(self) -> bool:
        return self.forward_flops_per_sample is None


PRESETS: dict[str, Model] = {
    "resnet50": Model("resnet50", (25_557_032,), forward_flops_per_sample=2 * 3.8e9),
    "bert-large": Model("bert-large", (340_000_000,)),
    "gpt2-xl": Model("gpt2-xl", (1_542_000_000,)),
    "llama2-7b": Model("llama2-7b", (6_738_415_616,)),
    "llama2-70b": Model("llama2-70b", (68_976_648_192,)),
}


def preset(name: str) -> Model:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(PRESETS)}") from None


def format_count(n: float) -> str:
    """25_557_032 → '25.6M', 7e9 → '7B', 1.2e13 → '12T', 340 → '340', 1e18 → '1e+18' (three significant
    digits)."""
    if abs(n) >= 1e15:
        return f"{n:.3g}"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.3g}"


def model_from_params(params: float) -> Model:
    """A transformer of ``params`` parameters (``7e9``)."""
    if not (math.isfinite(params) and params >= 1 and params == math.floor(params)):
        raise ValueError(f"--params: the parameter count must be a whole number >= 1, got {params!r}")
    return Model(f"{format_count(params)}-parameter transformer", (int(params),))


def module_factory(spec: str, *, doing: str) -> Any:
    """The function that ``module:function`` names (torch must be installed: ``doing`` says why); errors name the
    spec and what is wrong."""
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"{spec!r}: write a module as module:function, e.g. torchvision.models:resnet50")
    try:
        import torch  # noqa: F401  (the factory builds a torch module)
    except ImportError:
        raise ValueError(f"{spec}: {doing} needs torch (pip install 'allreduce[torch]')") from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{spec}: cannot import {module_name} ({exc})") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ValueError(f"{spec}: {module_name} has no function {function_name}")
    return factory


def model_from_module(spec: str) -> Model:
    """The parameters of the ``torch.nn.Module`` that ``module:function`` returns (no forward pass)."""
    factory = module_factory(spec, doing="reading a torch module")
    import torch

    function_name = spec.partition(":")[2]
    net = factory()
    if not isinstance(net, torch.nn.Module):
        raise ValueError(f"{spec}: {function_name}() returned {type(net).__name__}, not a torch.nn.Module")
    sizes = tuple(int(p.numel()) for p in net.parameters() if p.requires_grad and p.numel() > 0)
    if not sizes:
        raise ValueError(f"{spec}: the module has no trainable parameters")
    return Model(spec, sizes, whole_tensors=True)


def bucket_count_bound(total_bytes: int, *, bucket_cap_bytes: int, first_bucket_bytes: int) -> int:
    """The most buckets :func:`ddp_buckets` makes of ``total_bytes``: every bucket but the last holds at least its
    cap (exactly, without whole tensors), so at most one first bucket and ceil(rest / cap) more."""
    first_cap = min(first_bucket_bytes, bucket_cap_bytes)
    rest = max(0, total_bytes - first_cap)
    return 1 + -(-rest // bucket_cap_bytes)


def ddp_buckets(
    tensor_bytes: Sequence[int],
    *,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
    whole_tensors: bool = True,
) -> tuple[int, ...]:
    """Bucket sizes in bytes, in the order DDP all-reduces them, for tensors given in registration order.

    With ``whole_tensors`` (DDP's rule) a bucket closes after the tensor that fills it; without, the bytes are
    split exactly where a bucket fills (a preset, whose tensor boundaries are unknown).
    """
    if bucket_cap_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError("bucket caps must be > 0 bytes")
    first_cap = min(first_bucket_bytes, bucket_cap_bytes)
    whole = whole_tensors
    buckets: list[int] = []
    filled = 0
    for nbytes in reversed(tensor_bytes):
        remaining = int(nbytes)
        while remaining > 0:
            cap = first_cap if not buckets else bucket_cap_bytes
            take = remaining if whole else min(remaining, cap - filled)
            filled += take
            remaining -= take
            if filled >= cap:
                buckets.append(filled)
                filled = 0
    if filled:
        buckets.append(filled)
    return tuple(buckets)
