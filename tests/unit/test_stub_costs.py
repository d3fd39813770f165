"""tiercache_dev.diagnostics.stub_costs: the table is read from what the fixture model logs."""

from __future__ import annotations

from tiercache_dev.diagnostics.stub_costs import FIXTURE, parse, table


def test_reads_every_logged_operation_in_order_and_nothing_else() -> None:
    log = (
        "I1203 model.py loading\n"
        "STUB_COST_RUNS 5 2000\n"
        "STUB_COST Tensor, BYTES, one 5-byte value\t7.25\n"
        "W1203 something else 3.0\n"
        "STUB_COST InferenceResponse, 8 tensors\t1.70\n"
    )
    assert parse(log) == [
        ("Tensor, BYTES, one 5-byte value", 7.25),
        ("InferenceResponse, 8 tensors", 1.7),
    ]
    lines = table(log).splitlines()
    assert "median of 5 x 2,000 calls" in lines[0]
    assert lines[2:] == [
        "| Tensor, BYTES, one 5-byte value | 7.25 |",
        "| InferenceResponse, 8 tensors | 1.70 |",
    ]
    assert parse("no lines here") == [] and table("no lines here") == ""


def test_the_fixture_is_a_model_repository() -> None:
    assert (FIXTURE / "stub_costs" / "config.pbtxt").is_file()
    assert (FIXTURE / "stub_costs" / "1" / "model.py").is_file()
