"""The engine's LoRA adapters (tiercache.engine.adapters) on the real model and committed adapters.

One TorchEngine is loaded for the module, plus a second copy of the base model wrapped in a plain
peft `PeftModel` holding the same adapters: the reference. Each test leaves the engine holding no
adapter and no slot (free slots are deleted), so each test's first load injects afresh. Runs on
one CPU thread, like tests/unit/test_adapters.py (same state directory rule: $TIERCACHE_STATE_DIR,
else the repository's `.tiercache/`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402 - after HF_HUB_OFFLINE

from tiercache.adapter_types import (  # noqa: E402
    NOT_IN_ENGINE_MARK,
    AdapterRef,
    AdapterWeights,
    adapter_digest,
    held_key,
)
from tiercache.engine import adapters as engine_adapters  # noqa: E402
from tiercache.engine.adapters import (  # noqa: E402
    GENERATE,
    LIST,
    LOAD,
    AdapterOrder,
    EngineAdapters,
)
from tiercache.errors import ConfigError, Forbidden, InvalidRequest, NotFound  # noqa: E402
from tiercache.eviction import LruPolicy  # noqa: E402
from tiercache.exact.request import GenerationRequest  # noqa: E402

# peft still asks transformers for the deprecated name.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = REPO / "adapters"
STYLES = ("french", "caps", "brief")
PROMPT = "How do I boil an egg?"
MAX_TOKENS = 6


def adapter_weights(style: str, task_id: int = 0, digest: str = "") -> AdapterWeights:
    config = (ADAPTERS / style / "adapter_config.json").read_text()
    weights = (ADAPTERS / style / "adapter_model.safetensors").read_bytes()
    digest = digest or adapter_digest(config.encode(), weights)
    task_id = task_id or STYLES.index(style) + 1
    return AdapterWeights(AdapterRef(style, task_id, digest), config, weights)


def variant(style: str, digest: str, **changes: Any) -> AdapterWeights:
    """The committed adapter with config fields changed, as another version (task 20)."""
    weights = adapter_weights(style, 20, digest)
    config = json.loads(weights.config_json)
    config.update(changes)
    return replace(weights, config_json=json.dumps(config))


def slot_names(model: torch.nn.Module) -> set[str]:
    """The peft adapters injected in the model, whatever they hold."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {
        name
        for module in model.modules()
        if isinstance(module, BaseTunerLayer)
        for name in getattr(module, "lora_A", {})
    }


@dataclass
class Bench:
    engine: Any  # TorchEngine
    reference: Any  # PeftModel over a second copy of the base model, holding STYLES
    input_ids: torch.Tensor
    base_logits: torch.Tensor  # the engine's, before any adapter was loaded
    base_text: str
    base_params: int

    @property
    def adapters(self) -> EngineAdapters:
        return self.engine.adapters

    def logits(self) -> torch.Tensor:
        with torch.inference_mode():
            return self.engine.model(input_ids=self.input_ids).logits[0, -1]

    def text(self, ref: AdapterRef | None = None) -> str:
        request = GenerationRequest(PROMPT, max_tokens=MAX_TOKENS)
        if ref is not None:
            request = replace(
                request, lora_name=ref.name, lora_task_id=ref.task_id, lora_digest=ref.digest
            )
        return "".join(event.text for event in self.engine.generate(request))

    def reference_text(self, style: str) -> str:
        self.reference.set_adapter(style)
        tokenizer = self.engine.tokenizer
        with torch.inference_mode():
            out = self.reference.generate(
                input_ids=self.input_ids,
                attention_mask=torch.ones_like(self.input_ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=sorted(self.engine.eos_token_ids),
                pad_token_id=tokenizer.pad_token_id,
            )
        kept = out[0, self.input_ids.shape[1] :].tolist()
        kept = kept[: next((i for i, t in enumerate(kept) if t in self.engine.eos_token_ids), None)]
        return str(tokenizer.decode(kept, skip_special_tokens=True))

    def reference_logits(self, style: str) -> torch.Tensor:
        self.reference.set_adapter(style)
        with torch.inference_mode():
            return self.reference(input_ids=self.input_ids).logits[0, -1]


@pytest.fixture(scope="module")
def bench() -> Iterator[Bench]:
    from peft import PeftModel

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine, load_model
    from tiercache.packed_linear import pack_linears

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    state = Path(os.environ.get("TIERCACHE_STATE_DIR") or REPO / ".tiercache")
    try:
        engine = TorchEngine(resolve_model(), state / "models", "cpu", lora_slots=4)
        _, base = load_model(resolve_model(), state / "models", "cpu")
        # the engine's kernels for the reference too: the engine packs its linears for oneDNN,
        # whose sums differ from MKL's in their last bits (tests/unit/test_packed_linear.py)
        assert pack_linears(base).layers == engine.packed_layers > 0
        reference = PeftModel.from_pretrained(base, str(ADAPTERS / STYLES[0]), STYLES[0])
        for style in STYLES[1:]:
            reference.load_adapter(str(ADAPTERS / style), adapter_name=style)
        reference.eval()
        input_ids = engine.prompt_ids(GenerationRequest(PROMPT))
        bench = Bench(engine, reference, input_ids, torch.empty(0), "", 0)
        bench.base_logits = bench.logits()
        bench.base_text = bench.text()
        bench.base_params = sum(p.numel() for p in engine.model.parameters())
        yield bench
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def adapters(bench: Bench) -> Iterator[EngineAdapters]:
    """The engine's adapters, emptied (and the slot bound restored) after each test."""
    yield bench.adapters
    bench.adapters.max_slots = 4
    bench.adapters.prepare(AdapterOrder(LIST))  # a budget a test left pending is applied
    bench.adapters.max_bytes = 0  # back to the slot bound alone
    for entry in bench.adapters.resident():
        bench.adapters.evict(entry["digest"])
    bench.adapters.activate(None)
    bench.adapters.remove_free_slots()
    assert slot_names(bench.engine.model) == set()
    assert sum(p.numel() for p in bench.engine.model.parameters()) == bench.base_params


@pytest.fixture(scope="module")
def rank4(bench: Bench) -> AdapterWeights:
    """A rank-4 adapter on q_proj and k_proj (the committed ones: rank 8, q_proj and v_proj),
    with dropout, built with peft on the reference model (where set_adapter("rank4") runs it)."""
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors.torch import save

    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj"],
        lora_dropout=0.1,
        init_lora_weights=False,  # random A and B: the adapter changes the logits
    )
    torch.manual_seed(0)
    bench.reference.add_adapter("rank4", config)
    bench.reference.eval()  # peft builds the new dropout modules in training mode
    tensors = get_peft_model_state_dict(bench.reference, adapter_name="rank4")
    config_json = json.dumps(
        config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)
    )
    contiguous = {k: t.contiguous() for k, t in tensors.items()}
    return AdapterWeights(AdapterRef("rank4", 40, "rank4-v1"), config_json, save(contiguous))


@pytest.mark.parametrize("style", STYLES)
def test_active_adapter_computes_what_peft_computes(
    bench: Bench, adapters: EngineAdapters, style: str
) -> None:
    weights = adapter_weights(style)
    assert adapters.load(weights) > 0
    assert adapters.holds(weights.ref)
    adapters.activate(weights.ref)
    torch.testing.assert_close(bench.logits(), bench.reference_logits(style), rtol=0, atol=1e-5)
    text = bench.text(weights.ref)
    assert text == bench.reference_text(style)
    assert text != bench.base_text


def test_base_model_is_unchanged_by_loaded_and_switched_adapters(
    bench: Bench, adapters: EngineAdapters
) -> None:
    refs = [adapter_weights(style).ref for style in STYLES]
    for style in STYLES:
        adapters.load(adapter_weights(style))
    assert torch.equal(bench.logits(), bench.base_logits)  # loading activates nothing
    adapters.activate(refs[1])
    adapters.activate(None)
    assert torch.equal(bench.logits(), bench.base_logits)
    assert bench.text() == bench.base_text  # a request without lora_digest runs the base model


def test_switching_back_reproduces_the_first_adapter(
    bench: Bench, adapters: EngineAdapters
) -> None:
    a, b = adapter_weights("french"), adapter_weights("caps")
    adapters.load(a)
    adapters.load(b)
    adapters.activate(a.ref)
    first = bench.logits()
    adapters.activate(b.ref)
    assert not torch.allclose(bench.logits(), first)
    switches = adapters.stats().switches
    adapters.activate(a.ref)
    assert torch.equal(bench.logits(), first)
    adapters.activate(a.ref)  # already active: counted as a use, not a switch
    stats = adapters.stats()
    assert (stats.switches, stats.active) == (switches + 1, a.ref)
    assert {e["name"]: e["uses"] for e in adapters.resident()} == {"french": 3, "caps": 1}


class RecordingLru(LruPolicy[tuple[int, str]]):
    """LRU that notes what the adapter slots tell and ask it (digests only)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def admit(
        self,
        key: tuple[int, str],
        size: int = 1,
        *,
        created_s: float = 0.0,
        cost_s: float = 0.0,
        group: int = 0,
    ) -> None:
        self.calls.append(("admit", key[1]))
        super().admit(key, size, created_s=created_s, cost_s=cost_s, group=group)

    def access(self, key: tuple[int, str]) -> None:
        self.calls.append(("access", key[1]))
        super().access(key)

    def remove(self, key: tuple[int, str]) -> None:
        self.calls.append(("remove", key[1]))
        super().remove(key)


def test_the_slots_tell_their_eviction_policy_and_evict_its_victim() -> None:
    """On a one-layer model (no engine needed): each load, use and drop reaches the injected
    policy, and a load into full slots drops the adapter it ranks first."""

    class OneLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(4, 4)

    config = json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    )
    tensors = {
        "base_model.model.q_proj.lora_A.weight": torch.ones(2, 4),
        "base_model.model.q_proj.lora_B.weight": torch.ones(4, 2),
    }
    from safetensors.torch import save

    def version(name: str, task_id: int) -> AdapterWeights:
        return AdapterWeights(AdapterRef(name, task_id, name), config, save(tensors))

    policy = RecordingLru()
    slots = EngineAdapters(OneLayer().eval(), max_slots=2, policy=policy)
    a, b, c = version("a", 1), version("b", 2), version("c", 3)
    slots.load(a)
    slots.load(b)
    slots.activate(a.ref)
    slots.load(c)
    assert policy.calls == [
        ("admit", "a"), ("admit", "b"), ("access", "a"), ("remove", "b"), ("admit", "c")
    ]  # fmt: skip
    assert [e["digest"] for e in slots.resident()] == ["a", "c"]  # the policy's order
    assert slots.stats().lru_evictions == 1


def test_listing_the_adapters_is_not_an_eviction_plan() -> None:
    """`resident` ranks by the policy's nomination; a removal of an adapter it listed (a new
    version's explicit eviction) then counted as an eviction under gdsf, raising its aging
    level to that adapter's value. The listing withdraws its offer."""
    from tiercache.eviction import GreedyDualFrequencyPolicy

    config = json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    )
    tensors = {
        "base_model.model.q_proj.lora_A.weight": torch.ones(2, 4),
        "base_model.model.q_proj.lora_B.weight": torch.ones(4, 2),
    }
    from safetensors.torch import save

    class OneLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(4, 4)

    policy: GreedyDualFrequencyPolicy[Any] = GreedyDualFrequencyPolicy(4)
    slots = EngineAdapters(OneLayer().eval(), max_slots=4, policy=policy)
    for i, name in enumerate(("a", "b", "c"), start=1):
        slots.load(AdapterWeights(AdapterRef(name, i, name), config, save(tensors)))
    assert len(slots.resident()) == 3
    assert slots.evict("b")  # an explicit eviction, not the policy's choice
    assert policy.inflation == 0.0


def test_a_load_into_full_slots_evicts_the_least_recently_used(
    bench: Bench, adapters: EngineAdapters
) -> None:
    adapters.max_slots = 2
    # The same files under a new digest are another version: held side by side.
    v1, v2 = adapter_weights("brief", 9, "v1"), adapter_weights("brief", 9, "v2")
    caps = adapter_weights("caps")
    adapters.load(v1)
    adapters.load(v2)
    adapters.activate(v1.ref)  # v2 is now the least recently used
    before = adapters.stats()
    adapters.load(caps)
    assert [e["digest"] for e in adapters.resident()] == ["v1", caps.ref.digest]
    assert not adapters.holds(v2.ref)
    stats = adapters.stats()
    assert (stats.evictions, stats.lru_evictions) == (
        before.evictions + 1,
        1 + before.lru_evictions,
    )
    assert adapters.load(v1) == 0.0  # held: idempotent, nothing loaded
    assert adapters.stats().loads == stats.loads


def test_evict_frees_the_adapter_and_keeps_its_slot_for_the_next_load(
    bench: Bench, adapters: EngineAdapters
) -> None:
    weights = adapter_weights("caps")
    adapters.load(weights)
    adapters.activate(weights.ref)
    assert slot_names(bench.engine.model) == {"slot0"}
    assert adapters.evict(weights.ref.digest)
    assert not adapters.evict(weights.ref.digest)
    assert not adapters.holds(weights.ref) and adapters.resident() == []
    stats = adapters.stats()
    assert (stats.active, stats.resident, stats.resident_bytes) == (None, 0, 0)
    assert torch.equal(bench.logits(), bench.base_logits)  # evicting the active one: base
    assert stats.injected_slots == 1 and slot_names(bench.engine.model) == {"slot0"}  # free
    assert adapters.remove_free_slots() == 1
    assert slot_names(bench.engine.model) == set() and adapters.stats().injected_slots == 0
    assert sum(p.numel() for p in bench.engine.model.parameters()) == bench.base_params


def test_a_recycled_slot_computes_what_a_fresh_injection_and_peft_compute(
    bench: Bench, adapters: EngineAdapters
) -> None:
    french, caps = adapter_weights("french"), adapter_weights("caps")
    adapters.load(french)  # injected: the first slot
    adapters.activate(french.ref)
    fresh = bench.logits()
    adapters.evict(french.ref.digest)
    recycled = adapters.stats().recycled_loads
    adapters.load(caps)  # same shapes: copied into the free slot
    adapters.activate(caps.ref)
    torch.testing.assert_close(bench.logits(), bench.reference_logits("caps"), rtol=0, atol=1e-6)
    assert bench.text(caps.ref) == bench.reference_text("caps")
    adapters.evict(caps.ref.digest)
    adapters.load(french)
    adapters.activate(french.ref)
    assert torch.equal(bench.logits(), fresh)
    torch.testing.assert_close(fresh, bench.reference_logits("french"), rtol=0, atol=1e-6)
    stats = adapters.stats()
    assert (stats.recycled_loads, stats.injected_slots) == (recycled + 2, 1)
    assert slot_names(bench.engine.model) == {"slot0"}
    adapters.activate(None)
    assert torch.equal(bench.logits(), bench.base_logits)


def test_a_regex_target_loads_as_the_modules_it_names(
    bench: Bench, adapters: EngineAdapters
) -> None:
    """A target_modules regex is matched here, with a timeout, and peft is handed the module
    names it matched: the same adapter as the list form, to the bit."""
    as_regex = variant("french", "regex", target_modules=r".*\.(q_proj|v_proj)")
    adapters.load(as_regex)
    adapters.activate(as_regex.ref)
    torch.testing.assert_close(bench.logits(), bench.reference_logits("french"), rtol=0, atol=0)
    adapters.activate(None)


def test_a_recycled_slot_takes_the_new_adapters_lora_alpha(
    bench: Bench, adapters: EngineAdapters
) -> None:
    louder = variant("french", "alpha32", lora_alpha=32)  # scaling 4 instead of 2
    adapters.load(louder)  # injected
    adapters.activate(louder.ref)
    fresh = bench.logits()
    adapters.evict(louder.ref.digest)
    french = adapter_weights("french")
    adapters.load(french)  # recycled, back to scaling 2
    adapters.activate(french.ref)
    torch.testing.assert_close(bench.logits(), bench.reference_logits("french"), rtol=0, atol=1e-6)
    adapters.evict(french.ref.digest)
    adapters.load(louder)  # recycled, scaling 4
    adapters.activate(louder.ref)
    assert torch.equal(bench.logits(), fresh)
    assert adapters.stats().injected_slots == 1


def test_loads_into_a_full_set_recycle_and_never_inject_more_than_max_slots(
    bench: Bench, adapters: EngineAdapters
) -> None:
    adapters.max_slots = 2
    before = adapters.stats()
    versions = [adapter_weights(s, 10 + i, f"v{i}") for i, s in enumerate(STYLES * 2)]
    for weights in versions:
        adapters.load(weights)
        adapters.activate(weights.ref)
        assert len(slot_names(bench.engine.model)) <= 2
    stats = adapters.stats()
    assert stats.loads - before.loads == 6
    assert stats.recycled_loads - before.recycled_loads == 4  # all but the first two
    assert stats.lru_evictions - before.lru_evictions == 4
    assert [e["digest"] for e in adapters.resident()] == ["v4", "v5"]
    assert (stats.injected_slots, stats.active) == (2, versions[-1].ref)
    torch.testing.assert_close(
        bench.logits(), bench.reference_logits(STYLES[-1]), rtol=0, atol=1e-6
    )


def test_a_byte_budget_takes_free_slots_first_then_victims_at_the_next_request(
    bench: Bench, adapters: EngineAdapters
) -> None:
    french, caps, brief = (adapter_weights(s) for s in STYLES)
    for weights in (french, caps, brief):
        adapters.load(weights)
    adapters.evict(brief.ref.digest)  # a free slot
    slot = adapters.stats().slot_bytes // 3
    assert slot > 0 and adapters.stats().slot_bytes == 3 * slot
    gained_before, _ = adapters.shadow_reading()
    dropped = adapters.stats().budget_evictions
    assert adapters.resize(2 * slot) == 2 * slot
    assert adapters.slot_bytes() == 3 * slot  # recorded: the engine thread applies it
    assert adapters.held_bytes() == 3 * slot  # all of it over the budget comes back
    adapters.prepare(AdapterOrder(LIST))
    stats = adapters.stats()
    assert (stats.slot_bytes, stats.max_bytes) == (2 * slot, 2 * slot)
    assert stats.budget_evictions == dropped
    assert {e["digest"] for e in adapters.resident()} == {french.ref.digest, caps.ref.digest}
    assert len(slot_names(bench.engine.model)) == 2  # the free slot went, nothing served lost

    adapters.activate(caps.ref)  # french is now the least recently used, but it is needed
    adapters.resize(slot)
    adapters.prepare(AdapterOrder(GENERATE, needs=french.ref))
    stats = adapters.stats()
    assert (stats.slot_bytes, stats.budget_evictions, stats.injected_slots) == (
        slot,
        dropped + 1,
        1,
    )
    assert [e["digest"] for e in adapters.resident()] == [french.ref.digest]
    assert slot_names(bench.engine.model) == {"slot0"}
    adapters.activate(french.ref)
    torch.testing.assert_close(bench.logits(), bench.reference_logits("french"), rtol=0, atol=1e-6)

    # caps asked for again: the shadow credits what this load took; french makes room
    adapters.prepare(AdapterOrder(LOAD, caps.ref, caps))
    gained_s, span = adapters.shadow_reading()
    assert gained_s - gained_before == pytest.approx(adapters.stats().last_load_s)
    assert span == slot  # french, dropped for bytes, now waits in the shadow
    assert [e["digest"] for e in adapters.resident()] == [caps.ref.digest]
    assert adapters.stats().budget_evictions == dropped + 2
    adapters.activate(caps.ref)
    torch.testing.assert_close(bench.logits(), bench.reference_logits("caps"), rtol=0, atol=1e-6)
    # lora_cache evicting french (its mirror still lists it) is no lost hit: out of the shadow
    assert not adapters.evict(french.ref.digest)
    assert adapters.shadow_reading()[1] == 0.0


def test_a_byte_budget_never_refuses_the_one_adapter_a_request_needs(
    bench: Bench, adapters: EngineAdapters
) -> None:
    french, caps = adapter_weights("french"), adapter_weights("caps")
    adapters.resize(1)  # smaller than any adapter
    adapters.prepare(AdapterOrder(LOAD, french.ref, french))
    assert adapters.holds(french.ref) and adapters.stats().slot_bytes > 1
    assert adapters.held_bytes() == 1  # the one that stays is not counted as coming back
    loads = adapters.stats().loads
    adapters.prepare(AdapterOrder(LOAD, french.ref, french))  # a load of the one held: kept
    assert adapters.holds(french.ref) and adapters.stats().loads == loads
    adapters.prepare(AdapterOrder(GENERATE, caps.ref, caps, needs=caps.ref))
    assert [e["digest"] for e in adapters.resident()] == [caps.ref.digest]  # alone, over it
    adapters.activate(caps.ref)
    torch.testing.assert_close(bench.logits(), bench.reference_logits("caps"), rtol=0, atol=1e-6)
    # the budget grows back: loads stop dropping one another
    adapters.resize(1 << 30)
    adapters.prepare(AdapterOrder(LOAD, french.ref, french))
    assert {e["digest"] for e in adapters.resident()} == {french.ref.digest, caps.ref.digest}
    with pytest.raises(ConfigError, match=">= 1 byte"):
        adapters.resize(0)


def test_an_adapter_of_another_shape_replaces_a_free_slot_by_injection(
    bench: Bench, adapters: EngineAdapters, rank4: AdapterWeights
) -> None:
    adapters.max_slots = 1
    french = adapter_weights("french")
    adapters.load(french)
    adapters.evict(french.ref.digest)  # a free rank-8 q/v slot
    before = adapters.stats()
    adapters.load(rank4)  # no slot of its shape: the free one is deleted, a new one injected
    stats = adapters.stats()
    assert (stats.recycled_loads, stats.injected_slots) == (before.recycled_loads, 1)
    assert len(slot_names(bench.engine.model)) == 1
    adapters.activate(rank4.ref)
    logits = bench.logits()
    assert torch.equal(bench.logits(), logits)  # its dropout is the identity in eval mode
    torch.testing.assert_close(logits, bench.reference_logits("rank4"), rtol=0, atol=1e-6)
    adapters.evict(rank4.ref.digest)
    again = replace(rank4, ref=AdapterRef("rank4", 41, "rank4-v2"))
    adapters.load(again)  # now a slot of its shape is free: recycled
    assert adapters.stats().recycled_loads == before.recycled_loads + 1
    adapters.activate(again.ref)
    assert torch.equal(bench.logits(), logits)
    adapters.activate(None)
    assert torch.equal(bench.logits(), bench.base_logits)


def test_a_failed_load_into_a_free_slot_leaves_it_free_and_the_others_serving(
    bench: Bench, adapters: EngineAdapters, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load, save

    french, caps, brief = (adapter_weights(s) for s in STYLES)
    adapters.load(french)
    adapters.load(caps)
    adapters.activate(caps.ref)
    caps_logits = bench.logits()
    adapters.evict(french.ref.digest)  # its slot is free, of the committed adapters' shape
    before = adapters.stats()

    tensors = load(french.weights)
    key = next(iter(tensors))
    tensors[key] = tensors[key][:-1].contiguous()  # one rank row short: another signature
    corrupt = AdapterWeights(AdapterRef("bad", 30, "bad"), french.config_json, save(tensors))
    with pytest.raises(InvalidRequest, match="does not fit the model"):
        adapters.load(corrupt)

    def copy_half_then_fail(pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        with torch.no_grad():
            for param, tensor in pairs[: len(pairs) // 2]:
                param.copy_(tensor)
        raise RuntimeError("copy failed half-way")

    monkeypatch.setattr(engine_adapters, "_copy_weights", copy_half_then_fail)
    with pytest.raises(RuntimeError, match="copy failed half-way"):
        adapters.load(brief)
    monkeypatch.undo()

    stats = adapters.stats()
    assert stats.load_failures == before.load_failures + 2
    assert stats.recycled_loads == before.recycled_loads  # neither load is counted
    assert not adapters.holds(corrupt.ref) and not adapters.holds(brief.ref)
    assert [e["name"] for e in adapters.resident()] == ["caps"]
    assert stats.injected_slots == 2 and len(slot_names(bench.engine.model)) == 2
    assert torch.equal(bench.logits(), caps_logits)  # the active adapter, as it was
    adapters.activate(None)
    assert torch.equal(bench.logits(), bench.base_logits)
    adapters.load(brief)  # into the half-copied free slot: every tensor is copied again
    assert adapters.stats().recycled_loads == before.recycled_loads + 1
    adapters.activate(brief.ref)
    torch.testing.assert_close(bench.logits(), bench.reference_logits("brief"), rtol=0, atol=1e-6)


def test_a_request_for_an_adapter_not_held_fails_before_generating(
    bench: Bench, adapters: EngineAdapters
) -> None:
    ref = adapter_weights("french").ref
    with pytest.raises(NotFound, match=NOT_IN_ENGINE_MARK) as caught:
        bench.text(ref)
    assert f"LoRA task {ref.task_id}" in caught.value.message


def with_tensor(key: str) -> AdapterWeights:
    """The committed adapter's file with one more tensor under `key` (zeros, the shape of the
    parameter it names, so that loading it would succeed), as another version."""
    from safetensors.torch import load, save

    weights = adapter_weights("french", 21, "e" * 64)
    tensors = load(weights.weights)
    like = next(t for k, t in tensors.items() if "lora_A" in k)
    shape = (576,) if key.endswith("norm.weight") else tuple(like.shape)
    tensors[key] = torch.zeros(shape, dtype=like.dtype)
    return replace(weights, weights=save(tensors))


def test_keys_as_peft_reads_them_and_copies_of_the_models_own_tensors_load(
    bench: Bench, adapters: EngineAdapters
) -> None:
    """Only stray tensors refuse an adapter: keys without the `base_model.model.` prefix (as
    peft's functional API saves them) are the adapter's own, and a copy of a base parameter
    the model holds as it is (an embedding `save_embedding_layers` put in the file) is left
    out; the answer is the committed adapter's."""
    from safetensors.torch import load, save

    reference = adapter_weights("french")
    adapters.load(reference)
    adapters.activate(reference.ref)
    expected = bench.logits()
    adapters.activate(None)
    adapters.evict(reference.ref.digest)
    tensors = load(reference.weights)
    bare = {key.removeprefix("base_model.model."): t for key, t in tensors.items()}
    params = dict(bench.engine.model.named_parameters(remove_duplicate=False))
    for name in ("model.norm.weight", "model.embed_tokens.weight"):
        bare["base_model.model." + name] = params[name].detach().clone()
    embedding = params["model.embed_tokens.weight"].detach().clone()
    bare["base_model.model.lm_head.weight"] = embedding  # tied: the head is the embedding
    variant = replace(reference, ref=AdapterRef("french", 22, "f" * 64), weights=save(bare))
    recycled = adapters.stats().recycled_loads
    adapters.load(variant)
    # the copies are not the adapter's: its bytes and its signature are the reference's, so
    # the reference's free slot took it
    assert adapters.stats().recycled_loads == recycled + 1
    adapters.activate(variant.ref)
    assert torch.equal(bench.logits(), expected)
    adapters.activate(None)
    assert torch.equal(bench.logits(), bench.base_logits)


def test_a_dora_adapter_as_peft_saves_it_loads_and_answers_as_peft(
    bench: Bench, adapters: EngineAdapters
) -> None:
    """peft saves a DoRA magnitude as `...lora_magnitude_vector`, without the `.weight` its
    parameter has: read as peft reads it, not a stray tensor. The engine's logits with it are
    peft's own (to the packed kernels' last bits: tests/unit/test_packed_linear.py)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import load_model

    state = Path(os.environ.get("TIERCACHE_STATE_DIR") or REPO / ".tiercache")
    _, base = load_model(resolve_model(), state / "models", "cpu")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    dora = get_peft_model(base, config).eval()
    torch.manual_seed(0)
    for name, param in dora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    tensors = {k: t.contiguous() for k, t in get_peft_model_state_dict(dora).items()}
    assert any(k.endswith(".lora_magnitude_vector") for k in tensors)
    config_json = json.dumps(config.to_dict(), default=sorted)
    weights = save(tensors)
    ref = AdapterRef("dora", 23, adapter_digest(config_json.encode(), weights))
    adapters.load(AdapterWeights(ref, config_json, weights))
    adapters.activate(ref)
    with torch.inference_mode():
        expected = dora(input_ids=bench.input_ids).logits[0, -1]
    assert torch.allclose(bench.logits(), expected, atol=2e-2)
    assert not torch.allclose(bench.logits(), bench.base_logits, atol=2e-2)  # it acts
    adapters.activate(None)


def bad_config(**changes: Any) -> AdapterWeights:
    weights = adapter_weights("french")
    config = json.loads(weights.config_json)
    config.update(changes)
    return replace(weights, config_json=json.dumps(config))


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (bad_config(peft_type="IA3"), "peft_type must be LORA"),
        (bad_config(r=0), "rank r must be a positive integer"),
        (bad_config(target_modules=["q_proj", "nope_proj"]), r"\['nope_proj'\] are not modules"),
        (bad_config(modules_to_save=["lm_head"]), "modules_to_save is not supported"),
        (bad_config(target_modules=r"(.|.)*\d\d\d"), "takes too long to match"),  # re: hours
        (bad_config(target_modules="(unclosed"), "not a valid regex"),
        (bad_config(target_modules=r".*\.nothing_proj"), "matches no module"),
        (bad_config(r=4), "does not fit the model"),  # weights are rank 8: fails mid-load
        (bad_config(target_modules=["q_proj", "k_proj", "v_proj"]), "weights missing"),
        (replace(adapter_weights("french"), weights=b"not safetensors"), "not valid safetensors"),
        (replace(adapter_weights("french"), config_json="{"), "not valid JSON"),
        (replace(adapter_weights("french"), config_json="[" * 100_000), "not valid JSON"),
        (with_tensor("base_model.model.model.norm.weight"), "neither LoRA weights"),  # base's
        (  # another slot's tensor, as peft names it in the model
            with_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.slot0.weight"),
            "neither LoRA weights",
        ),
    ],
    ids=[
        "ia3",
        "rank0",
        "target",
        "modules_to_save",
        "regex_backtracking",
        "regex_invalid",
        "regex_no_module",
        "shape",
        "missing",
        "bytes",
        "json",
        "nesting",
        "base_tensor",
        "other_slot",
    ],
)
def test_a_bad_adapter_is_rejected_and_the_model_keeps_serving(
    bench: Bench, adapters: EngineAdapters, weights: AdapterWeights, message: str
) -> None:
    good = adapter_weights("caps")
    adapters.load(good)
    adapters.activate(good.ref)
    good_logits = bench.logits()
    failures = adapters.stats().load_failures
    with pytest.raises(InvalidRequest, match=message):
        adapters.load(weights)
    assert adapters.stats().load_failures == failures + 1
    assert not adapters.holds(weights.ref)
    assert [e["name"] for e in adapters.resident()] == ["caps"]
    assert torch.equal(bench.logits(), good_logits)  # still the good adapter, as it was
    assert slot_names(bench.engine.model) == {"slot0"}  # the failed injection was removed
    adapters.activate(None)
    assert torch.equal(bench.logits(), bench.base_logits)


def test_an_order_evicts_then_loads_and_never_evicts_what_it_generates_with(
    adapters: EngineAdapters,
) -> None:
    french, caps = adapter_weights("french"), adapter_weights("caps")
    adapters.load(french)
    request = GenerationRequest(
        PROMPT, lora_name="caps", lora_task_id=caps.ref.task_id, lora_digest=caps.ref.digest
    )
    order = AdapterOrder.parse(
        config_json=caps.config_json,
        weights=caps.weights,
        evict=json.dumps([held_key(french.ref), held_key(caps.ref)]),
        request=request,
    )
    assert order.ref == order.needs == caps.ref
    done = adapters.prepare(order)
    assert done.evicted == (held_key(french.ref),) and done.load_s > 0
    assert [e["name"] for e in adapters.resident()] == ["caps"]
    evict_all = AdapterOrder.parse(op="evict", evict=json.dumps([caps.ref.digest]))
    assert adapters.prepare(evict_all).evicted == (held_key(caps.ref),)


def test_an_order_evicts_one_name_over_shared_files_and_a_digest_evicts_all(
    adapters: EngineAdapters,
) -> None:
    """Two names over identical files (an alias folder) are two adapters: an order naming one
    (`held_key`) leaves the other; a bare digest drops both; never the adapter generated
    with."""
    french = adapter_weights("french")
    alias = dataclasses.replace(french, ref=AdapterRef("french-alias", 9, french.ref.digest))
    adapters.load(french)
    adapters.load(alias)
    one = AdapterOrder.parse(op="evict", evict=json.dumps([held_key(alias.ref)]))
    assert adapters.prepare(one).evicted == (held_key(alias.ref),)
    assert [e["name"] for e in adapters.resident()] == ["french"]
    adapters.load(alias)
    request = GenerationRequest(
        PROMPT, lora_name="french", lora_task_id=1, lora_digest=french.ref.digest
    )
    keep = AdapterOrder.parse(evict=json.dumps([held_key(french.ref)]), request=request)
    assert keep.needs == french.ref and adapters.prepare(keep).evicted == ()
    both = AdapterOrder.parse(op="evict", evict=json.dumps([french.ref.digest]))
    assert sorted(adapters.prepare(both).evicted) == sorted(
        [held_key(french.ref), held_key(alias.ref)]
    )


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"op": "train"}, "LORA_OP must be one of"),
        ({}, "ENVELOPE is required"),
        ({"op": "load", "lora": "{}"}, "LORA must be JSON"),
        ({"op": "load", "config_json": "{}"}, "sent together"),
        ({"op": "load", "config_json": "{}", "weights": b""}, "need an adapter version"),
        ({"op": "load", "lora": AdapterRef("a", 1, "d").to_json()}, "load needs"),
        ({"op": "evict", "evict": '{"a": 1}'}, "JSON list of held adapters"),
        ({"op": "evict", "evict": '["x:"]'}, "is not <task id>:<digest>"),
        ({"op": "evict", "evict": '["one:d"]'}, "is not <task id>:<digest>"),
    ],
)
def test_bad_orders_are_rejected(inputs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        AdapterOrder.parse(**inputs)


def test_files_that_do_not_match_their_digest_are_never_loaded() -> None:
    """The engine recomputes an adapter's digest: files cannot be loaded under the identity
    (name, task id, digest) of another version."""
    caps, french = adapter_weights("caps"), adapter_weights("french")
    with pytest.raises(Forbidden, match="do not match its digest"):
        AdapterOrder.parse(
            op="load", lora=french.ref.to_json(), config_json=caps.config_json, weights=caps.weights
        )
    tampered = caps.weights[:-1] + bytes([caps.weights[-1] ^ 1])
    with pytest.raises(Forbidden, match="do not match its digest"):
        AdapterOrder.parse(
            op="load", lora=caps.ref.to_json(), config_json=caps.config_json, weights=tampered
        )
    order = AdapterOrder.parse(
        op="load", lora=caps.ref.to_json(), config_json=caps.config_json, weights=caps.weights
    )
    assert order.weights is not None and order.weights.matches()
