"""The ADMIN input's envelope, shared by the stages that take admin calls (cache_admin,
lora_cache): a JSON object whose `op` names one of the stage's ops and whose keys are that op's."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from tiercache.errors import InvalidRequest


def parse_admin(text: str, ops: Mapping[str, Collection[str]]) -> dict[str, Any]:
    """The ADMIN JSON object; InvalidRequest for bad JSON, an unknown op or unknown keys
    (`ops` maps each op to the keys it takes, `op` included)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # also numbers past int limits, deep nesting
        raise InvalidRequest(f"ADMIN is not valid JSON: {str(exc)[:200]}") from None
    # an op that is no string (a list, an object) cannot be looked up: it is no op either
    if not isinstance(data, dict) or not isinstance(data.get("op"), str) or data["op"] not in ops:
        raise InvalidRequest(f"ADMIN must be a JSON object with op one of {sorted(ops)}")
    unknown = set(data) - set(ops[data["op"]])
    if unknown:
        raise InvalidRequest(f"ADMIN op {data['op']!r}: unknown keys {sorted(unknown)}")
    return data
