"""The edge layer: exact hits answered in the gateway from the host's tiers, never crossing Triton.

The gateway builds prompt_cache's own lookup (`tiercache.stages.parts.open_lookup`) from the
prompt_cache stage's parameters in the model repository Triton serves, with the same state
folder and environment. So it computes the same canonical digest under the same secret, maps an
API key to the same tenant grant, resolves an adapter to the same version, applies the same
limits, TTLs, invalidation watermarks (read from the host's log or Redis on every lookup, as
every stage does) and cache_control words, and reads the same L2 (and Redis, with `redis_url`)
behind an L1 of its own.

It answers a request only when that lookup says EXACT, the llm stage would not pad the tenant's
responses (padding hides a hit's timing, which an answer from here would reveal; the llm stage's
`hit_padding_ms` and `trusted_tenants` decide, read from its parameters; a padded tenant's
request is not even looked up here), and the running stages published the same terms as the
edge computed (tiercache.stages.contract: the API key file, the secret's fingerprint, the
engine, the limits, the padding policy), so a gateway started in another environment, or left
running across a restart that changed them, serves nothing. Everything else goes to the
ensemble, unchanged: misses, semantic lookups, bypasses, and any request the lookup refuses (bad
input, a refused key, an unknown adapter), whose error the ensemble gives in its own words.
"""

from __future__ import annotations

import dataclasses
import logging
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from tiercache.config import LlmConfig, PromptCacheConfig, parse_config
from tiercache.errors import ConfigError, Forbidden, TierCacheError
from tiercache.exact.answer_ids import AnswerIds, AnswerRef, ServedAs
from tiercache.exact.prompt_cache import PromptCache
from tiercache.exact.request import RawInputs
from tiercache.exact.tenant_keys import KeyFile, TenantGrant, key_from_parameter
from tiercache.padding import PaddingPolicy
from tiercache.stages.contract import (
    LLM,
    PROMPT_CACHE,
    ContractCheck,
    deployment_terms,
    llm_terms,
    prompt_cache_terms,
)
from tiercache.stages.parts import ExactTiers, kv_reuse_scope, open_lookup, padding_policy
from tiercache.vocabulary import CacheStatus

log = logging.getLogger(__name__)


def stage_parameters(repository: Path, model: str) -> dict[str, str]:
    """The `parameters` of `<repository>/<model>/config.pbtxt` as the stage reads them (key ->
    string_value); ConfigError when the file is missing or is not a model config."""
    path = repository / model / "config.pbtxt"
    try:
        config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except (OSError, text_format.ParseError) as exc:
        raise ConfigError(f"cannot read the {model} stage's config {path}: {exc}") from exc
    return {key: value.string_value for key, value in config.parameters.items()}


@dataclass(frozen=True, slots=True)
class EdgeHit:
    """An exact hit served at the edge: the answer, the tier that held it, and its stored
    token accounting (prompt tokens, completion tokens, 1 if it stopped at max_tokens)."""

    text: str
    tier: str
    tokens: tuple[int, int, int] = (0, 0, 0)
    answer_id: str | None = None  # as llm names an exact hit (tiercache.exact.answer_ids)


class EdgeCache:
    """prompt_cache's lookup in the gateway's process; `answer` is None for all but a hit the
    ensemble would serve as one, to a tenant it would not pad."""

    def __init__(
        self,
        lookup: PromptCache,
        padding: PaddingPolicy,
        contract: ContractCheck,
        keys: KeyFile | None = None,
        tiers: ExactTiers | None = None,
        ids: AnswerIds | None = None,
        kv_reuse_scope: str | None = None,
    ) -> None:
        """`ids`: the deployment's answer ids (None: hits served here carry no answer id);
        `kv_reuse_scope`: the one tenant scope llm serves (`trtllm_kv_reuse_tenant`; None:
        every tenant)."""
        self.lookup = lookup
        self.kv_reuse_scope = kv_reuse_scope
        self.ids = ids
        self.padding = padding
        self.contract = contract
        self.keys = keys  # None: the tenant input is trusted (no api_keys_file)
        # Redis reads are network round trips (up to redis_timeout_s): the gateway then runs
        # lookups on a worker thread instead of its event loop.
        self.blocking = tiers is not None and tiers.link is not None

    def refuses_key(self, authorization: str | None) -> str | None:
        """Why the key file prompt_cache uses refuses this Authorization header (no key, an
        unknown one), decided here before anything is parsed or sent to Triton; None when it
        would pass it, or when this process cannot tell (no key file; another one than
        prompt_cache's)."""
        if self.keys is None or not self.contract.holds():
            return None
        try:
            self.keys.authorize(key_from_parameter(authorization))
        except Forbidden as exc:
            return exc.message
        return None

    def answer(self, raw: RawInputs, authorization: str | None) -> EdgeHit | None:
        if not self.contract.holds():
            return None
        try:
            grant = None
            if self.keys is not None:
                grant = self.keys.authorize(key_from_parameter(authorization))
            if self.padding.enabled and self._padded(raw, grant):
                return None  # not looked up: the lookup's own timing would tell hit from miss
            result = self.lookup.lookup(raw, grant=grant)
        except TierCacheError:
            return None  # refused: the ensemble refuses it too, in its own words
        if result.status is not CacheStatus.EXACT or result.tier is None:
            return None
        scope = result.request.tenant_scope
        if self.padding.pads(scope):
            return None
        if self.kv_reuse_scope is not None and scope != self.kv_reuse_scope:
            return None  # llm refuses this tenant, hits included: the ensemble answers the 403
        answer_id = None
        if self.ids is not None and result.digest is not None:
            answer_id = self.ids.issue(
                AnswerRef(result.digest, ServedAs.CACHED), scope, result.request.lora_name
            )
        return EdgeHit(result.text, result.tier.value, result.tokens, answer_id)

    def _padded(self, raw: RawInputs, grant: TenantGrant | None) -> bool:
        """Whether llm pads the request's tenant: the grant's, else the `tenant` input as
        prompt_cache normalizes it (NFKC, stripped)."""
        if grant is not None:
            name = grant.tenant
        else:
            tenant = raw.tenant
            text = tenant.decode("utf-8", "replace") if isinstance(tenant, bytes) else tenant
            name = unicodedata.normalize("NFKC", text or "").strip()
        return self.padding.pads(self.lookup.scope(name))

    def close(self) -> None:
        self.lookup.cache.close()


def open_edge(repository: Path, state_dir: Path | None = None) -> EdgeCache:
    """The edge layer for the deployment served from `repository`: prompt_cache's lookup and
    the llm stage's padding policy, from their parameters there. `state_dir` stands in for a
    `state_dir` parameter the stage leaves empty (what `tiercache serve` gives Triton in its
    environment); None: the environment's, as the stages resolve it."""
    config = parse_config(PromptCacheConfig, stage_parameters(repository, PROMPT_CACHE))
    llm = parse_config(LlmConfig, stage_parameters(repository, LLM))
    if state_dir is not None:
        if not config.state_dir:
            config = dataclasses.replace(config, state_dir=str(state_dir))
        if not llm.state_dir:
            llm = dataclasses.replace(llm, state_dir=str(state_dir))
    # exact hits only: no semantic scopes
    lookup, tiers, secret = open_lookup(config, embedder_key="")
    keys_path = config.api_keys_path()
    keys = KeyFile(keys_path) if keys_path is not None else None
    padding = padding_policy(llm, secret)
    only = kv_reuse_scope(llm, secret)
    contract = ContractCheck(
        {
            PROMPT_CACHE: (
                config.state_path(),
                prompt_cache_terms(
                    keys_path, secret, lookup.engine, lookup.limits, deployment_terms(config)
                ),
            ),
            LLM: (llm.state_path(), llm_terms(padding, only)),
        }
    )
    return EdgeCache(lookup, padding, contract, keys, tiers, AnswerIds(secret), only)
