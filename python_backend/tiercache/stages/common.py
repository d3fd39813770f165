"""What every stage's assembly shares: its metrics registry, the exporters of the exact
cache's Redis link and invalidation listener, the engines' draft metrics, and the sealed
internal calls (to the engine and to lora_cache's admin ops)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tiercache.stages.parts import ExactTiers
from tiercache.stages.seal import ADMIN_LABEL, ENGINE_INPUTS, ENGINE_LABEL, Sealer, seal_tensors
from tiercache.triton import io
from tiercache.triton import metrics as tm
from tiercache.vocabulary import DraftSource, choices


def status_counters(
    metrics: tm.Metrics, name: str, description: str, label: str, values: Iterable[str]
) -> dict[str, tm._DeferredMetric]:
    """One counter per value of `label` (statuses, outcomes, tiers), plus none other."""
    return {value: metrics.counter(name, description, **{label: value}) for value in values}


def export_late_calls(
    metrics: tm.Metrics, deadline: Any, name: str, description: str
) -> dict[str, tm._DeferredMetric]:
    """Counters `name{event="timed_out"|"refused"}` that follow a `Deadline` or
    `StreamDeadline`'s counts (`deadline.timed_out`, `.refused`) at each flush; none (an empty
    dict) without a deadline."""
    if deadline is None:
        return {}
    late = status_counters(metrics, name, description, "event", ["timed_out", "refused"])
    timed_out = tm.DeltaCounter(late["timed_out"])
    refused = tm.DeltaCounter(late["refused"])

    def count() -> None:
        timed_out.update(deadline.timed_out)
        refused.update(deadline.refused)

    metrics.on_flush(count)
    return late


def export_redis(metrics: tm.Metrics, tiers: ExactTiers) -> bool:
    """Redis health and invalidation-listener metrics for tiers with L3; False (and nothing
    exported) without L3."""
    if tiers.link is None:
        return False
    tm.RedisMetrics(metrics, tiers.link)
    if tiers.listener is not None:
        tm.InvalidationMetrics(metrics, tiers.listener)
    return True


def engine_inputs(sealer: Sealer, values: dict[str, str | bytes]) -> list[Any]:
    """An engine call's tensors (torch_llm's inputs have no batch dimension) and ENGINE_SEAL
    over all of them; torch_llm refuses a call whose seal does not verify."""
    tensors = [io.bytes_tensor(name, [value], batched=False) for name, value in values.items()]
    seal = seal_tensors(sealer, ENGINE_LABEL, ENGINE_INPUTS, dict(values))
    tensors.append(io.bytes_tensor("ENGINE_SEAL", [seal], batched=False))
    return tensors


def admin_seal(sealer: Sealer, admin: str) -> str:
    """The ADMIN_SEAL of a call of lora_cache's admin ops (its answer's adapter files are
    closed for it, tiercache.stages.transport)."""
    return sealer.seal(ADMIN_LABEL, admin.encode("utf-8"))


def admin_inputs(sealer: Sealer, admin: str) -> list[Any]:
    """A call of lora_cache's internal admin ops: ADMIN and its ADMIN_SEAL."""
    seal = admin_seal(sealer, admin)
    return [io.bytes_tensor("ADMIN", [admin]), io.bytes_tensor("ADMIN_SEAL", [seal])]


# Upper bounds of the accepted-draft-tokens-per-step histogram: a step drafts MAX_DRAFT_TOKENS
# at most, the prefill pass that verifies a cached answer MAX_PREFILL_DRAFT_TOKENS (256).
ACCEPTED_PER_STEP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


class DraftMetrics:
    """Speculative decoding's metrics, by draft source (vocabulary.DraftSource): draft tokens
    verified, those kept, and the kept ones per verification step (the seeds' spec-hit-depth).
    torch_llm records its generations', llm those of TensorRT-LLM's speculative steps."""

    def __init__(self, metrics: tm.Metrics) -> None:
        sources = choices(DraftSource)
        self.drafted = status_counters(
            metrics,
            "tiercache_engine_draft_tokens_total",
            "Draft tokens verified by speculative decoding, by draft source",
            "source",
            sources,
        )
        self.accepted = status_counters(
            metrics,
            "tiercache_engine_draft_accepted_tokens_total",
            "Draft tokens the model agreed with (each a decoding step saved), by draft source",
            "source",
            sources,
        )
        self.per_step = {
            source: metrics.histogram(
                "tiercache_engine_draft_accepted_per_step",
                "Draft tokens accepted per verification step, by draft source",
                list(ACCEPTED_PER_STEP_BUCKETS),
                source=source,
            )
            for source in sources
        }

    def record(self, steps: Iterable[tuple[str, int, int]]) -> None:
        """One generation's (source, proposed, accepted) per verification step."""
        for source, proposed, accepted in steps:
            self.drafted[source].increment(proposed)
            self.accepted[source].increment(accepted)
            self.per_step[source].observe(accepted)
