"""The `feedback` model: a caller's good/bad on an answer it was served (tiercache.feedback).

The tenant is resolved as prompt_cache resolves it: with a key file, from the caller's API key
(a `tenant` input naming another tenant is refused); without one, the `tenant` input as sent
(NFKC-normalized and stripped). The answer id opens only under that tenant's scope. The stage
takes verdicts only while prompt_cache's published terms name the same key file and secret, so
a feedback model configured without prompt_cache's key file refuses rather than trusting the
`tenant` input."""

from __future__ import annotations

import logging

from tiercache.config import FeedbackConfig
from tiercache.errors import Forbidden, InvalidRequest, Unavailable
from tiercache.exact.answer_ids import AnswerIds
from tiercache.exact.invalidation import Invalidator
from tiercache.exact.keys import tenant_scope
from tiercache.exact.request import canonical_tenant
from tiercache.exact.tenant_keys import KeyFile, key_from_parameter
from tiercache.feedback import Feedback, Verdict, parse_verdict
from tiercache.stages.common import export_redis
from tiercache.stages.contract import (
    CALLER_TERMS,
    LLM,
    PROMPT_CACHE,
    ContractCheck,
    caller_terms,
)
from tiercache.stages.parts import load_secret, open_exact_cache
from tiercache.triton import metrics as tm

log = logging.getLogger(__name__)

MAX_ANSWER_ID_CHARS = 256  # far above an id's length: longer input is refused before decoding
MAX_VERDICT_BYTES = 16  # "good" or "bad", with room for blanks


class FeedbackStage:
    def __init__(
        self,
        feedback: Feedback,
        secret: bytes,
        metrics: tm.Metrics,
        keys: KeyFile | None = None,
        agrees: ContractCheck | None = None,
        unpadded: ContractCheck | None = None,
    ) -> None:
        """`agrees`: whether prompt_cache's published caller terms are this stage's (None: not
        checked, for tests of the stage alone); `unpadded`: whether llm publishes that it pads
        no tenant (else, or unknown, answers are masked: `FeedbackReport.to_json`; None: not
        masked)."""
        self.agrees = agrees
        self._closed_logged = ""  # the reason feedback refuses verdicts, as last logged
        self.unpadded = unpadded
        self.core = feedback
        self._secret = secret
        self.keys = keys  # None: the tenant input is trusted (no api_keys_file)
        self.metrics = m = metrics
        self.taken = {
            (v, s): m.counter(
                "tiercache_feedback_total",
                "Verdicts taken on served answers, by verdict and by how the answer was served "
                "(own: exact hit or generated; semantic: a neighbour's answer)",
                verdict=v.value,
                served=s,
            )
            for v in Verdict
            for s in ("own", "semantic")
        }
        self.invalidations = m.counter(
            "tiercache_feedback_invalidations_total",
            "Entries invalidated by bad feedback (an answer already covered is not counted)",
        )
        self.endorsements = m.counter(
            "tiercache_feedback_endorsements_total",
            "Good verdicts that raised a cached answer's endorsements in the shared tiers (an "
            "answer no longer cached, or already at the most kept, is not counted)",
        )
        self.refused = {
            reason: m.counter(
                "tiercache_feedback_refused_total",
                "Feedback refused: forbidden (no or another API key, a key without no-cache, an "
                "id of another tenant or deployment, an answer of an adapter the key may not "
                "use), invalid (not an answer id, an unknown "
                "verdict), closed (prompt_cache runs with another API key file or secret), "
                "unavailable (Redis down: a bad answer was invalidated on this host only)",
                reason=reason,
            )
            for reason in ("forbidden", "invalid", "closed", "unavailable")
        }

    def caller(
        self, tenant: str | None, authorization: object = None, bad: bool = False
    ) -> tuple[str, frozenset[str] | None]:
        """The caller's tenant scope (see the module's docstring), and the adapters its key may
        use (None: any; always None without a key file). A `bad` verdict makes the entry be
        generated again, as `cache_control: no-cache` would: a key that may not use that word
        may not give it (Forbidden)."""
        name = canonical_tenant(tenant)
        adapters = None
        if self.keys is not None:
            grant = self.keys.authorize(key_from_parameter(authorization))
            if tenant is not None and name != grant.tenant:
                raise Forbidden("the tenant input does not match the API key's tenant")
            if bad and grant.cache_control is not None and "no-cache" not in grant.cache_control:
                raise Forbidden(
                    "this API key may not use cache_control no-cache, which a bad verdict "
                    "amounts to (the answer is generated again)"
                )
            name = grant.tenant
            adapters = grant.adapters
        return tenant_scope(self._secret, name), adapters

    def give(
        self,
        answer_id: str | None,
        verdict: str | None,
        tenant: str | None = None,
        authorization: object = None,
    ) -> dict[str, object]:
        """One verdict's JSON answer (masked while some tenant is padded); the typed errors of
        `Feedback.give` (and Forbidden for the API key, Unavailable while closed)."""
        if self.agrees is not None and not self.agrees.holds():
            self.refused["closed"].increment(1)
            reason = self.agrees.reason  # it names files: for the operator, not the caller
            if reason != self._closed_logged:  # once while the reason stays the same
                self._closed_logged = reason
                log.warning("feedback refuses verdicts: %s", reason)
            raise Unavailable(
                "feedback is closed: this host's prompt_cache has not published the same API "
                "key file and secret (the server's log says why)"
            )
        try:
            judged = parse_verdict(verdict)
            scope, adapters = self.caller(tenant, authorization, bad=judged is Verdict.BAD)
            if not answer_id:
                raise InvalidRequest("answer_id is required (the answer_id of a response)")
            if len(answer_id) > MAX_ANSWER_ID_CHARS:
                raise InvalidRequest("answer_id is not an answer id (too long)")
            report = self.core.give(answer_id, judged, scope, adapters)
        except Unavailable as exc:
            self.refused["unavailable"].increment(1)
            # The invalidation's own message names Redis's address and the host log's error.
            log.warning("a verdict could not be acted on: %s", exc.message)
            raise Unavailable(
                "the bad verdict's invalidation was applied on this server only: it could not "
                "be recorded for the others (the server's log says why); send it again"
            ) from None
        except InvalidRequest as exc:  # Forbidden is one
            self.refused["forbidden" if isinstance(exc, Forbidden) else "invalid"].increment(1)
            raise
        self.taken[(report.verdict, report.served.kind)].increment(1)
        if report.invalidated:
            self.invalidations.increment(1)
        if report.endorsed:
            self.endorsements.increment(1)
        masked = self.unpadded is not None and not self.unpadded.holds()
        return report.to_json(masked)

    def close(self) -> None:
        self.metrics.close()
        self.core.invalidator.cache.close()


def open_feedback(config: FeedbackConfig, model_name: str) -> FeedbackStage:
    """The stage over the deployment's tiers (no L1), its Redis link and invalidation channel,
    its secret and API keys, with its metrics (started). It takes verdicts only while
    prompt_cache on this host has published the same API key file and secret
    (tiercache.stages.contract)."""
    tiers = open_exact_cache(config.cache())
    secret = load_secret(config.cache(), tiers.link)
    keys_path = config.api_keys_path()
    keys = KeyFile(keys_path) if keys_path is not None else None
    metrics = tm.Metrics(model_name)
    feedback = Feedback(AnswerIds(secret), Invalidator(tiers.cache, tiers.link))
    # Fail closed: a feedback model started without prompt_cache's API key file (or with
    # another secret) would trust tenant inputs prompt_cache refuses.
    terms = caller_terms(keys_path, secret)
    agrees = ContractCheck({PROMPT_CACHE: (config.state_path(), terms)}, compared=CALLER_TERMS)
    # Masked answers unless llm on this host says it pads nobody (llm_terms with no padding).
    unpadded = ContractCheck({LLM: (config.state_path(), {"padding": None})}, compared=("padding",))
    stage = FeedbackStage(feedback, secret, metrics, keys, agrees, unpadded)
    export_redis(metrics, tiers)
    metrics.start()
    return stage
