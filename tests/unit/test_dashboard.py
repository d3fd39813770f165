"""deploy/grafana/tiercache-dashboard.json is a Grafana dashboard model that imports: schema 39,
the DS_PROMETHEUS input behind a datasource variable, unique panel ids, panels inside the
24-column grid without overlaps, every target a PromQL query with its refId on the variable."""

from __future__ import annotations

from typing import Any

import pytest
from dashboard_queries import (
    load_dashboard,
    metric_names,
    missing_from_scrape,
    panels,
    targets,
)

GRID_COLUMNS = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return load_dashboard()


def test_imports_with_a_prometheus_input(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] == 39
    assert dashboard["uid"] and dashboard["title"]
    assert dashboard["id"] is None  # Grafana assigns it on import
    inputs = {i["name"]: i for i in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == "${DS_PROMETHEUS}"


def test_panel_ids_are_unique(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)


def test_panels_fit_the_grid_without_overlapping(dashboard: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["y"] >= 0 and pos["w"] >= 1 and pos["h"] >= 1, panel["title"]
        assert pos["x"] + pos["w"] <= GRID_COLUMNS, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_target_is_a_query_on_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    count = 0
    for panel in panels(dashboard):
        if panel["type"] == "row":
            assert not panel.get("targets")
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"], panel["title"]
            assert target["datasource"] == DATASOURCE, panel["title"]
            count += 1
    assert count >= 20


def test_rates_use_the_rate_interval(dashboard: dict[str, Any]) -> None:
    for panel, target in targets(dashboard):
        expr = target["expr"]
        assert expr.count("rate(") == expr.count("[$__rate_interval])"), panel["title"]
        assert expr.count("(") == expr.count(")"), panel["title"]


def test_covers_the_families_the_issue_asks_for(dashboard: dict[str, Any]) -> None:
    used = set().union(*(metric_names(t["expr"]) for _, t in targets(dashboard)))
    wanted = {
        "tiercache_prompt_cache_hits_total",
        "tiercache_prompt_cache_requests_total",
        "tiercache_embedding_cache_lookups_total",
        "tiercache_llm_requests_total",
        "tiercache_prompt_cache_lookup_seconds_bucket",
        "tiercache_embedding_cache_lookup_seconds_bucket",
        "tiercache_llm_time_to_first_token_seconds_bucket",
        "tiercache_llm_generation_seconds_bucket",
        "nv_inference_request_duration_us",
        "tiercache_cache_bytes",
        "tiercache_cache_entries",
        "tiercache_cache_evictions_total",
        "tiercache_lora_resident",
        "tiercache_engine_adapter_load_seconds_bucket",
        "tiercache_engine_adapter_swap_seconds_bucket",
        "tiercache_engine_kv_reused_tokens_total",
        "tiercache_engine_kv_computed_tokens_total",
        "tiercache_engine_kv_pool_bytes",
        "tiercache_engine_kv_evictions_total",
        "tiercache_redis_up",
        "tiercache_redis_errors_total",
        "tiercache_invalidations_received_total",
        "tiercache_invalidations_applied_total",
        "tiercache_invalidations_replayed_total",
        "tiercache_invalidation_dropped_entries_total",
        "tiercache_invalidation_lag_seconds_bucket",
        "tiercache_lease_acquisitions_total",
        "tiercache_lease_waits_total",
        "tiercache_lease_remote_hits_total",
        "tiercache_lease_takeovers_total",
    }
    assert wanted <= used, sorted(wanted - used)


def test_metric_names_read_from_promql() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le) (rate("
        'tiercache_llm_generation_seconds_bucket{model="llm"}[$__rate_interval])))'
        " / sum(rate(nv_inference_count[5m])) + tiercache_redis_up"
    )
    assert metric_names(expr) == {
        "tiercache_llm_generation_seconds_bucket",
        "nv_inference_count",
        "tiercache_redis_up",
    }


def test_missing_from_scrape_knows_histograms_from_counters() -> None:
    scrape = "\n".join(
        [
            "# TYPE x_seconds histogram",
            'x_seconds_bucket{le="1"} 0',
            "x_seconds_sum 0",
            "x_seconds_count 0",
            "# TYPE nv_inference_count counter",
            'nv_inference_count{model="m"} 3',
            "# TYPE y_total counter",
            "y_total 1",
        ]
    )
    names = {"x_seconds_bucket", "nv_inference_count", "y_total"}
    assert missing_from_scrape(names, scrape) == []
    assert missing_from_scrape({"z_total", "x_seconds_bucket"}, scrape) == ["z_total"]
