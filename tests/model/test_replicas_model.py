"""prompt_cache and llm model.py files with `redis_url` set: two "replicas" (two instances with
their own state dirs) against a real redis-server, run in-process on the pb_utils stand-in."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
import seals
from redis_server import RedisServer
from test_prompt_cache_model import envelope, flushed, make_request, output

from tiercache.exact.codec import CacheEntry, encode_entry
from tiercache.exact.leases import LeaseCoordinator
from tiercache.stages.seal import Sealer
from tiercache.vocabulary import Tier


def parameters(values: dict[str, str]) -> str:
    return json.dumps({"parameters": {k: {"string_value": v} for k, v in values.items()}})


@pytest.fixture
def replicas(
    load_model: Callable[[str], ModuleType],
    redis_server: RedisServer,
    redis_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[str, str], Any]]:
    # The replicas of one fleet share one server secret (a fleet's Redis refuses another one).
    monkeypatch.setenv("TIERCACHE_SECRET_FILE", str(tmp_path / "fleet_secret"))
    started: list[Any] = []

    def start(name: str, model: str = "prompt_cache") -> Any:
        instance = load_model(model).TritonPythonModel()
        values = {
            "state_dir": str(tmp_path / name),
            "redis_url": redis_server.url,
            "redis_prefix": redis_prefix,
        }
        instance.initialize({"model_config": parameters(values), "model_name": model,
                             "model_instance_name": f"{model}_0"})  # fmt: skip
        started.append(instance)
        return instance

    yield start
    for instance in started:
        instance.finalize()
    assert not [t for t in threading.enumerate() if t.name.startswith("tiercache-")]


@pytest.fixture
def sealer(replicas: Callable[..., Any], tmp_path: Path) -> Sealer:
    """The fleet's sealer (its shared secret file, which every replica's stages read)."""
    return seals.sealer_for(tmp_path / "a")


def test_an_answer_stored_on_one_replica_is_an_exact_hit_on_another(
    replicas: Callable[..., Any], pb_utils: ModuleType, sealer: Sealer
) -> None:
    a, b = replicas("a"), replicas("b")
    (miss,) = a.execute([make_request(pb_utils, tenant="acme")])
    digest = envelope(pb_utils, miss, sealer).digest
    a.stage.cache.cache.put(digest, "answer from a")
    (hit,) = b.execute([make_request(pb_utils, b" What is  Triton?", tenant="acme")])
    assert envelope(pb_utils, hit, sealer).status == "exact"
    assert output(pb_utils, hit, "CACHED_TEXT") == "answer from a"
    assert flushed(b).hits[Tier.L3].metric.value() == 1
    assert Tier.L3 in flushed(b).hits


def test_a_forged_l3_value_is_a_miss_and_exported_as_forged(
    replicas: Callable[..., Any],
    pb_utils: ModuleType,
    sealer: Sealer,
    redis_server: RedisServer,
    redis_prefix: str,
) -> None:
    """An answer written straight into Redis without the fleet's secret is never served: the
    replica misses, and tiercache_redis_forged_total{what="redis_values"} counts it."""
    a, b = replicas("a"), replicas("b")
    (miss,) = a.execute([make_request(pb_utils, tenant="acme")])
    digest = envelope(pb_utils, miss, sealer).digest
    client = redis.Redis.from_url(redis_server.url)
    client.set(f"{redis_prefix}e:{digest}", encode_entry(CacheEntry("planted", time.time() - 1)))
    client.close()
    (again,) = b.execute([make_request(pb_utils, tenant="acme")])
    assert envelope(pb_utils, again, sealer).status == "miss"
    assert output(pb_utils, again, "CACHED_TEXT") != "planted"
    family = flushed(b).metrics._families["tiercache_redis_forged_total"]
    forged = {m.labels["what"]: m.value() for m in family.metrics}
    assert forged == {"redis_values": 1.0, "invalidations": 0.0, "semantic_rows": 0.0}


def test_cache_control_tags_and_max_age_reach_the_llm_request(
    replicas: Callable[..., Any], pb_utils: ModuleType, sealer: Sealer
) -> None:
    a = replicas("a")
    control = "tag=kb:v3, max-age=30 tag=faq"
    (miss,) = a.execute([make_request(pb_utils, cache_control=control)])
    sent = envelope(pb_utils, miss, sealer)
    assert (sent.cache_tags, sent.max_age_s) == (("faq", "kb:v3"), 30.0)
    assert envelope(pb_utils, miss, sealer).semantic_lookup is False  # max-age: exact only
    (bad,) = a.execute([make_request(pb_utils, cache_control="max-age=-3")])
    assert bad.error().code() == pb_utils.TritonError.INVALID_ARG
    assert "max-age" in bad.error().message()


def test_unknown_redis_parameter_fails_the_load(
    load_model: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    from tiercache.errors import ConfigError

    instance = load_model("prompt_cache").TritonPythonModel()
    config = parameters({"state_dir": str(tmp_path), "lease_ttl_s": "5"})  # an llm parameter
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        instance.initialize({"model_config": config, "model_name": "prompt_cache"})


def test_llm_takes_leases_with_redis(replicas: Callable[..., Any]) -> None:
    llm = replicas("a", "llm")
    leases = llm.stage.core.leases
    assert isinstance(leases, LeaseCoordinator)
    assert (leases.ttl_s, leases.wait_s) == (10.0, 60.0)
