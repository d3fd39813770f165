"""The CPU engine's linear layers in oneDNN's prepacked layout (tiercache.packed_linear):
the same function as `nn.Linear` to float32 rounding, still an `nn.Linear` peft can wrap, and left
alone wherever the op cannot stand in for it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tiercache import packed_linear  # noqa: E402
from tiercache.packed_linear import PackedLinear, pack_linears  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(48, 32, bias=False)
        self.v_proj = torch.nn.Linear(48, 32)
        self.norm = torch.nn.LayerNorm(32)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(100, 48)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(48, 100, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's

    def forward(self, ids: Any) -> Any:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + torch.nn.functional.pad(block.norm(block.q_proj(x) + block.v_proj(x)), (0, 16))
        return self.head(x)


def test_a_packed_linear_computes_what_the_linear_does() -> None:
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 40)
    packed = PackedLinear(linear)
    for shape in ((1, 64), (5, 64), (2, 7, 64)):
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(packed(x), linear(x), rtol=0, atol=1e-5)
    # a non-contiguous input (an attention output is one, transposed) as well
    x = torch.randn(1, 64, 6).transpose(1, 2)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), rtol=0, atol=1e-5)
    assert isinstance(packed, torch.nn.Linear)
    assert torch.equal(packed.weight, linear.weight.detach())  # rebuilt from the packed copy
    assert packed.bias is linear.bias
    assert "packed" in repr(packed)
    with pytest.raises(AttributeError, match="cannot be replaced"):
        packed.weight = torch.nn.Parameter(torch.zeros(40, 64))


def test_pack_linears_packs_every_linear_and_the_model_computes_the_same() -> None:
    stock, model = Tiny().eval(), Tiny().eval()
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    assert pack_linears(model) == packed_linear.PackReport(5)
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    # the tied embedding keeps its plain weight; the head's packed copy holds the same values
    assert torch.equal(model.embed.weight, stock.embed.weight)
    assert torch.equal(model.head.weight, stock.embed.weight)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), stock(ids), rtol=0, atol=1e-4)
    # packing again finds nothing left to pack
    assert pack_linears(model) == packed_linear.PackReport(0, "no float32 linear layer on the CPU")


@pytest.mark.parametrize(
    ("targets", "dora"),
    [(["q_proj", "v_proj"], False), (["head"], False), (["q_proj", "head"], True)],
    ids=["q-v", "tied-head", "dora"],
)
def test_peft_injects_lora_around_packed_layers(targets: list[str], dora: bool) -> None:
    """As the engine loads an adapter (peft's functional API, low_cpu_mem_usage, then the
    state dict): the packed model computes what the stock one does with the same adapter."""
    from peft import (
        LoraConfig,
        get_peft_model_state_dict,
        inject_adapter_in_model,
        set_peft_model_state_dict,
    )

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=dora)
    stock, model = Tiny().eval(), Tiny().eval()
    pack_linears(model)
    inject_adapter_in_model(config, stock)
    inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
    torch.manual_seed(2)
    weights = {k: torch.randn_like(v) for k, v in get_peft_model_state_dict(stock).items()}
    set_peft_model_state_dict(stock, weights)
    loaded = set_peft_model_state_dict(model, weights, low_cpu_mem_usage=True)
    assert not loaded.unexpected_keys
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        adapted = model(ids)
        torch.testing.assert_close(adapted, stock(ids), rtol=0, atol=1e-4)
        assert not torch.allclose(adapted, Tiny().eval()(ids), atol=1e-2)  # the adapter acts
    wrapped = model.blocks[0].q_proj if "q_proj" in targets else model.head
    assert isinstance(wrapped.base_layer, PackedLinear)
    # packing again finds nothing: peft's layers (lora_A, lora_B: plain Linears) are left alone
    assert pack_linears(model).layers == 0


def test_bfloat16_layers_are_packed_when_asked_for_and_compute_the_same() -> None:
    """The pair verifier runs in bfloat16: its layers pack with `dtype=torch.bfloat16`, the model
    then computes what it did to bfloat16's rounding; float32 layers are left alone."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("torch's oneDNN has no bfloat16 on this CPU")
    stock, model = Tiny().eval().to(torch.bfloat16), Tiny().eval().to(torch.bfloat16)
    model.blocks[1].v_proj.float()  # one layer of another dtype: not packed
    stock.blocks[1].v_proj.float()
    assert pack_linears(model, torch.bfloat16) == packed_linear.PackReport(4)
    assert type(model.blocks[1].v_proj) is torch.nn.Linear
    assert isinstance(model.blocks[0].v_proj, PackedLinear)
    x = torch.randn(3, 48).to(torch.bfloat16)
    with torch.no_grad():
        got, want = model.blocks[0].q_proj(x), stock.blocks[0].q_proj(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
    assert pack_linears(Tiny(), torch.bfloat16).skipped == "no bfloat16 linear layer on the CPU"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pack_linears(Tiny(), torch.float16)


def test_nothing_is_packed_where_the_op_cannot_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    half = Tiny().to(torch.bfloat16)
    report = pack_linears(half)
    assert report == packed_linear.PackReport(0, "no float32 linear layer on the CPU")
    assert all(type(m) is not PackedLinear for m in half.modules())

    class NoOp:
        pass

    monkeypatch.setattr(packed_linear, "_OPS", NoOp())
    model = Tiny()
    assert pack_linears(model) == packed_linear.PackReport(0, "torch has no oneDNN linear")
    assert type(model.head) is torch.nn.Linear


def test_a_disagreeing_op_packs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    class Off:
        _reorder_linear_weight = staticmethod(lambda w: w.clone())

        @staticmethod
        def _linear_pointwise(x: Any, w: Any, b: Any, *_: Any) -> Any:
            return torch.nn.functional.linear(x, w, b) + 0.01

    monkeypatch.setattr(packed_linear, "_OPS", Off())
    model = Tiny()
    report = pack_linears(model)
    assert report.layers == 0 and "differs from F.linear by 0.01" in report.skipped
    assert type(model.blocks[0].q_proj) is torch.nn.Linear


def test_the_engine_packs_the_model_and_its_logits_stay_the_stock_models() -> None:
    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine

    state = Path(os.environ.get("TIERCACHE_STATE_DIR") or REPO / ".tiercache")
    stock = TorchEngine(resolve_model(), state / "models", "cpu", 1, packed_linears=False)
    packed = TorchEngine(resolve_model(), state / "models", "cpu", 1)
    config = packed.model.config
    # every projection of every layer (q, k, v, o, gate, up, down) and the LM head
    assert packed.packed_layers == 7 * config.num_hidden_layers + 1
    assert isinstance(packed.model.get_output_embeddings(), PackedLinear)
    assert stock.packed_layers == 0
    assert not any(isinstance(m, PackedLinear) for m in stock.model.modules())
    ids = torch.tensor([list(range(400, 460))])
    with torch.inference_mode():
        logits = packed.model(ids).logits
        torch.testing.assert_close(logits, stock.model(ids).logits, rtol=0, atol=2e-3)


def test_the_embedder_packs_its_model_and_its_vectors_stay_the_same() -> None:
    from tiercache.semantic.embedder import Embedder

    stock, packed = Embedder(packed_linears=False), Embedder()
    assert stock.packed_layers == 0 and packed.packed_layers > 0
    texts = ["How do I reset my password?", "What is the capital of France?"]
    difference = abs(packed.embed(texts) - stock.embed(texts)).max()
    assert difference < 1e-5
