"""The `feedback` model: a caller's good/bad on an answer it was served (tiercache.feedback).

The tenant is resolved as prompt_cache resolves it: with a key file, from the caller's API key
(a `tenant` input naming another tenant is refused); without one, the `tenant` input as sent
(NFKC-normalized and stripped). The answer id opens only under that tenant's scope. The stage
takes verdicts only while prompt_cache's published terms name the same key file and secret, so
a feedback model configured without prompt_cache's key file refuses rather than trusting the
`tenant` input."""

from __future__ import annotations

import unicodedata

from tiercache.config import FeedbackConfig
from tiercache.errors import Forbidden, InvalidRequest, TierCacheError, Unavailable
from tiercache.exact.answer_ids import AnswerIds, ServedAs
from tiercache.exact.invalidation import Invalidator
from tiercache.exact.keys import tenant_scope
from tiercache.exact.request import DEFAULT_LIMITS
from tiercache.exact.tenant_keys import KeyFile, key_from_parameter
from tiercache.feedback import Feedback, FeedbackReport, Verdict, parse_verdict
from tiercache.stages.common import export_redis
from tiercache.stages.contract import CALLER_TERMS, PROMPT_CACHE, ContractCheck, caller_terms
from tiercache.stages.parts import load_secret, open_exact_cache
from tiercache.triton import metrics as tm

MAX_ANSWER_ID_CHARS = 256  # far above an id's length: longer input is refused before decoding


class FeedbackStage:
    def __init__(
        self,
        feedback: Feedback,
        secret: bytes,
        metrics: tm.Metrics,
        keys: KeyFile | None = None,
        agrees: ContractCheck | None = None,
    ) -> None:
        """`agrees`: whether prompt_cache's published caller terms are this stage's (None: not
        checked, for tests of the stage alone)."""
        self.agrees = agrees
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
                served=s.name.lower(),
            )
            for v in Verdict
            for s in ServedAs
        }
        self.invalidations = m.counter(
            "tiercache_feedback_invalidations_total",
            "Entries invalidated by bad feedback (an answer already covered is not counted)",
        )
        self.refused = {
            reason: m.counter(
                "tiercache_feedback_refused_total",
                "Feedback refused: forbidden (no or another API key, an id of another tenant or "
                "deployment), invalid (not an answer id, an unknown verdict), unavailable (Redis "
                "down: applied on this host only)",
                reason=reason,
            )
            for reason in ("forbidden", "invalid", "unavailable")
        }

    def tenant_scope(self, tenant: str | None, authorization: object = None) -> str:
        """The caller's tenant scope (see the module's docstring)."""
        name = ""
        if tenant is not None:
            name = unicodedata.normalize("NFKC", tenant).strip()
            if len(name) > DEFAULT_LIMITS.max_tenant_chars:
                raise InvalidRequest(
                    f"tenant is longer than {DEFAULT_LIMITS.max_tenant_chars} characters"
                )
        if self.keys is not None:
            grant = self.keys.authorize(key_from_parameter(authorization))
            if tenant is not None and name != grant.tenant:
                raise Forbidden("the tenant input does not match the API key's tenant")
            name = grant.tenant
        return tenant_scope(self._secret, name)

    def give(
        self,
        answer_id: str | None,
        verdict: str | None,
        tenant: str | None = None,
        authorization: object = None,
    ) -> FeedbackReport:
        """One verdict; the typed errors of `Feedback.give` (and Forbidden for the API key)."""
        try:
            if self.agrees is not None and not self.agrees.holds():
                raise Unavailable(f"feedback is closed: {self.agrees.reason}")
            scope = self.tenant_scope(tenant, authorization)
            if not answer_id:
                raise InvalidRequest("answer_id is required (the answer_id of a response)")
            if len(answer_id) > MAX_ANSWER_ID_CHARS:
                raise InvalidRequest("answer_id is not an answer id (too long)")
            report = self.core.give(answer_id, parse_verdict(verdict), scope)
        except TierCacheError as exc:
            self.count_refusal(exc)
            raise
        self.taken[(report.verdict, report.served)].increment(1)
        if report.invalidated:
            self.invalidations.increment(1)
        return report

    def count_refusal(self, exc: BaseException) -> None:
        reason = (
            "forbidden"
            if isinstance(exc, Forbidden)
            else "invalid"
            if isinstance(exc, InvalidRequest)
            else "unavailable"
        )
        self.refused[reason].increment(1)

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
    stage = FeedbackStage(feedback, secret, metrics, keys, agrees)
    export_redis(metrics, tiers)
    metrics.start()
    return stage
