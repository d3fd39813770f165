"""A CPU model's linear layers in oneDNN's prepacked layout (`pack_linears`).

torch runs a float32 `nn.Linear` on the CPU through MKL's sgemm, which on the AMD EPYC these
machines have is 2-9x slower than oneDNN's linear over a weight reordered once into oneDNN's
blocked layout: SmolLM2's LM head (49152 x 576) over 1 / 2 / 3 / 16 rows takes 9.6 / 21.9 / 31.8
/ 17.5 ms through `F.linear` and 4.3 / 4.9 / 3.4 / 5.5 ms prepacked (2 threads). With every
linear of the model packed, a one-token step goes from 53.4 to 36.9 ms and a pass over 16
tokens from 85.0 to 50.8 ms (docs/engine.md, `python -m tiercache_dev.bench.packed_linear`).

The semantic pair verifier packs its layers the same way, float32 or, in bfloat16,
`pack_linears(model, torch.bfloat16)`.

The op is `torch.ops.mkldnn._linear_pointwise` with a weight from
`torch.ops.mkldnn._reorder_linear_weight`, what torch's own compiler emits for a frozen CPU
linear; nothing public exposes it. `pack_linears` checks that both exist and agree with
`F.linear` on the model's first layer before packing anything, and leaves the model as it was
otherwise.

Our own module (one class): no library swaps a module's kernel and stays a `torch.nn.Linear`
for peft, which injects LoRA only around `nn.Linear` layers.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_OPS = torch.ops.mkldnn
AGREEMENT = 1e-3
"""Largest absolute difference from `F.linear` the self-check accepts on one float32 layer
(float32 sums in another order differ in their last bits, about 1e-5 on these layers)."""
AGREEMENT_BF16 = 2e-2
"""The same for a bfloat16 layer, relative to the output's largest value (bfloat16 keeps 8
bits of mantissa: one rounding step is 0.4 % of a value)."""
PACKABLE = (torch.float32, torch.bfloat16)


class PackedLinear(torch.nn.Linear):
    """A `torch.nn.Linear` whose weight lives only in oneDNN's blocked layout.

    `weight` is a plain-layout copy made on each read: what peft reads when it injects an
    adapter (twice a targeted layer, for its device and dtype: an injection of a rank-8 q/v
    adapter 65 -> 89 ms, `tiercache_dev.bench.lora engine`), and what a DoRA adapter reads
    every pass (correct; that pass pays for the copies). Assigning `weight` is refused, but a
    write into the copy (`weight.data += ...`, as peft's `merge` does) is lost without an
    error: merge an adapter before packing, never after. The engine never merges. The bias
    stays a plain parameter."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        torch.nn.Module.__init__(self)  # not Linear's: it would allocate a weight
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed = _OPS._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.packed.to_dense()

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":  # Module.__setattr__ would register a parameter beside the property
            raise AttributeError(
                "a PackedLinear's weight cannot be replaced (merging or re-tying is not supported)"
            )
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OPS._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, packed"


@dataclasses.dataclass(frozen=True, slots=True)
class PackReport:
    """What `pack_linears` did: `layers` packed, or why none was (`skipped`)."""

    layers: int
    skipped: str = ""


def pack_linears(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> PackReport:
    """Replace every CPU `nn.Linear` of `dtype` (float32 or bfloat16; bfloat16 pays only on a
    CPU with native bfloat16, oneDNN emulates it elsewhere) in `model` (the LM head included,
    its weight still tied to the embedding's, which keeps the plain copy) with a
    `PackedLinear`, in place; then copy the parameters and buffers left into the process's own
    memory, so that a weights file mapped at load (safetensors) is unmapped with the plain
    weights, not kept whole by the embedding.

    Packs nothing and says why when the model has no such CPU linear layer, torch lacks
    oneDNN or the ops, or they do not agree with `F.linear` on the first layer. Call it before
    any adapter is injected: a layer peft already wraps is left as it is, and so are layers of
    another dtype or device."""
    if dtype not in PACKABLE:
        raise ValueError(f"pack_linears packs float32 or bfloat16 layers, not {dtype}")
    candidates = _plain_linears(model, dtype)
    first = next(candidates, None)
    if first is None:
        return PackReport(0, f"no {str(dtype).removeprefix('torch.')} linear layer on the CPU")
    if not torch.backends.mkldnn.is_available() or not all(
        hasattr(_OPS, op) for op in ("_linear_pointwise", "_reorder_linear_weight")
    ):
        return PackReport(0, "torch has no oneDNN linear")
    problem = _disagreement(first[2])
    if problem:
        return PackReport(0, problem)
    layers = 0
    with torch.no_grad():
        for parent, name, child in itertools.chain((first,), candidates):
            setattr(parent, name, PackedLinear(child))  # the plain layer dropped as it goes
            layers += 1
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.data = tensor.data.clone()
    return PackReport(layers)


def pack_and_log(model: torch.nn.Module, what: str, dtype: torch.dtype = torch.float32) -> int:
    """`pack_linears(model, dtype)`, logged as `what`'s (info when packed, a warning saying why
    when not); the layers packed."""
    packed = pack_linears(model, dtype)
    if packed.skipped:
        log.warning("%s: linear layers not packed for oneDNN: %s", what, packed.skipped)
    else:
        log.info("%s: %d linear layers packed for oneDNN", what, packed.layers)
    return packed.layers


def _plain_linears(
    parent: torch.nn.Module, dtype: torch.dtype
) -> Iterator[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, name, layer) of every plain CPU `nn.Linear` of `dtype` under `parent`, not
    descending into peft's layers (their base layer and their lora_A / lora_B stay as peft made
    them)."""
    for name, child in list(parent.named_children()):
        if type(child) is torch.nn.Linear:
            if child.weight.dtype == dtype and child.weight.device.type == "cpu":
                yield parent, name, child
        elif not hasattr(child, "base_layer"):
            yield from _plain_linears(child, dtype)


def _disagreement(linear: torch.nn.Linear) -> str:
    """Why the packed op cannot stand in for `linear`, or "" when it agrees with `F.linear`."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, linear.in_features, generator=generator).to(linear.weight.dtype)
    try:
        with torch.no_grad():
            packed = PackedLinear(linear)
            expected = F.linear(x, linear.weight, linear.bias).float()
            difference = float((packed(x).float() - expected).abs().max())
    except (RuntimeError, TypeError) as err:  # an op torch has but runs otherwise
        return f"torch's oneDNN linear failed: {err}"
    limit = AGREEMENT
    if linear.weight.dtype == torch.bfloat16:
        limit = AGREEMENT_BF16 * max(1.0, float(expected.abs().max()))
    if not difference <= limit:
        return f"torch's oneDNN linear differs from F.linear by {difference:.3g}"
    return ""
