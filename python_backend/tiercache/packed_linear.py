"""A CPU model's linear layers in oneDNN's prepacked layout (`pack_linears`).

torch runs a float32 `nn.Linear` on the CPU through MKL's sgemm, which on the AMD EPYC these
machines have is 2-7x slower than oneDNN's linear over a weight reordered once into oneDNN's
blocked layout: SmolLM2's LM head (49152 x 576) over 1 / 2 / 3 / 16 rows takes 9.6 / 22.4 / 33.4
/ 19.0 ms through `F.linear` and 4.5 / 4.8 / 4.3 / 5.6 ms prepacked (2 threads). With every linear
of the model packed, a one-token step goes from 59 to 38 ms and a pass over 16 tokens from 91 to
53 ms (docs/engine.md, `python -m tiercache_dev.bench.packed_linear`).

The op is `torch.ops.mkldnn._linear_pointwise` with a weight from
`torch.ops.mkldnn._reorder_linear_weight`, what torch's own compiler emits for a frozen CPU
linear; nothing public exposes it. `pack_linears` checks the op exists and agrees with `F.linear`
on the model's first layer before packing anything, and leaves the model as it was otherwise.

Our own module (one class): no library swaps a module's kernel and stays a `torch.nn.Linear`
for peft, which injects LoRA only around `nn.Linear` layers and reads their `weight` for its
device and dtype.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_OPS = torch.ops.mkldnn
AGREEMENT = 1e-3
"""Largest absolute difference from `F.linear` the self-check accepts on one layer (float32
sums in another order differ in their last bits, about 1e-5 on these layers)."""


class PackedLinear(torch.nn.Linear):
    """A `torch.nn.Linear` whose weight lives only in oneDNN's blocked layout.

    `weight` is rebuilt in the plain layout on each read (a copy; assigning it is refused): what
    peft reads when it injects an adapter, and what a DoRA adapter reads every pass (correct,
    but that pass pays for the copy). The bias stays a plain parameter."""

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


@dataclasses.dataclass(frozen=True)
class PackReport:
    """What `pack_linears` did: `layers` packed, or why none was (`skipped`)."""

    layers: int
    skipped: str = ""


def pack_linears(model: torch.nn.Module) -> PackReport:
    """Replace every float32 CPU `nn.Linear` in `model` (the LM head included, its weight still
    tied to the embedding's, which keeps the plain copy) with a `PackedLinear`, in place.

    Packs nothing and says why when the model is not on the CPU in float32, torch lacks oneDNN
    or the op, or the op does not agree with `F.linear` on the first layer. Call it before any
    adapter is injected: a layer peft already wraps is left as it is."""
    linears = list(_plain_linears(model))
    if not linears:
        return PackReport(0, "no linear layer")
    first = linears[0][2]
    if first.weight.device.type != "cpu" or first.weight.dtype != torch.float32:
        return PackReport(0, f"weights are {first.weight.dtype} on {first.weight.device.type}")
    if not torch.backends.mkldnn.is_available() or not hasattr(_OPS, "_linear_pointwise"):
        return PackReport(0, "torch has no oneDNN linear")
    problem = _disagreement(first)
    if problem:
        return PackReport(0, problem)
    with torch.no_grad():
        for parent, name, child in linears:
            setattr(parent, name, PackedLinear(child))
    return PackReport(len(linears))


def _plain_linears(
    parent: torch.nn.Module,
) -> Iterator[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, name, layer) of every plain `nn.Linear` under `parent`, not descending into
    peft's layers (their base layer and their lora_A / lora_B stay as peft made them)."""
    for name, child in parent.named_children():
        if type(child) is torch.nn.Linear:
            yield parent, name, child
        elif not hasattr(child, "base_layer"):
            yield from _plain_linears(child)


def _disagreement(linear: torch.nn.Linear) -> str:
    """Why the packed op cannot stand in for `linear`, or "" when it agrees with `F.linear`."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, linear.in_features, generator=generator)
    try:
        with torch.no_grad():
            packed = PackedLinear(linear)
            difference = float((packed(x) - F.linear(x, linear.weight, linear.bias)).abs().max())
    except RuntimeError as err:
        return f"torch's oneDNN linear failed: {err}"
    if not difference <= AGREEMENT:
        return f"torch's oneDNN linear differs from F.linear by {difference:.3g}"
    return ""
