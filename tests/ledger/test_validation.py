"""Every malformed field gets a clear error that names the call and the field."""

from __future__ import annotations

from typing import Any

import pytest

from tidal.ledger import LedgerError, make_call, make_outcome

from .helpers import call_dict

BAD_CALLS: list[tuple[dict[str, Any], str]] = [
    ({"session_id": 7}, "session_id must be a string"),
    ({"session_id": ""}, "session_id must be a string"),
    ({"call_id": "has space"}, "call_id must be a string"),
    ({"role": "Main!"}, "role must be a lowercase name"),
    ({"prompt_ids": "1 2 3"}, "prompt_ids must be a list of token ids"),
    ({"prompt_ids": [1, -2, 3]}, r"prompt_ids\[1\] is negative"),
    ({"prompt_ids": [1, 2.5]}, r"prompt_ids\[1\] must be an integer"),
    ({"prompt_ids": [1, True]}, r"prompt_ids\[1\] must be an integer"),
    ({"output_ids": [4, 2**40]}, "exceeds int32"),
    ({"output_ids": [4, 5, 6]}, "output_logprobs has 2 entries but output_ids has 3"),
    ({"output_logprobs": [-0.5]}, "output_logprobs has 1 entries"),
    ({"output_logprobs": [-0.5, "x"]}, r"output_logprobs\[1\] must be a number"),
    ({"output_logprobs": [-0.5, 0.7]}, "is not a log-probability"),
    ({"output_logprobs": [-0.5, float("nan")]}, "is not a log-probability"),
    ({"output_text": None}, "output_text must be a string"),
    ({"policy_version": -1}, "policy_version must be a non-negative integer"),
    ({"policy_version": "3"}, "policy_version must be a non-negative integer"),
    ({"finish_reason": ""}, "finish_reason must be a non-empty string"),
    ({"started_at": "noon"}, "started_at must be a finite number"),
    ({"ended_at": 50.0}, "ended_at .* is before started_at"),
    ({"raw_tool_calls": {"a": 1}}, "raw_tool_calls must be a string or null"),
    ({"tool_calls": "f()"}, "tool_calls must be a list of objects"),
    ({"parent_call_id": 3}, "parent_call_id must be a string"),
    ({"parent_session_id": "s1"}, "parent_session_id equals the call's own session_id"),
    ({"parent_call_id": "c0"}, "parent_call_id points at the call itself"),
    ({"sampling": [1]}, "sampling must be an object"),
]


@pytest.mark.parametrize(("override", "message"), BAD_CALLS)
def test_bad_call_field(override: dict[str, Any], message: str) -> None:
    with pytest.raises(LedgerError, match=message) as info:
        make_call(call_dict(**override))
    if "session_id" not in override and "call_id" not in override:
        assert "call 'c0' of session 's1'" in str(info.value)


def test_missing_fields_are_listed() -> None:
    d = call_dict()
    del d["output_ids"], d["policy_version"]
    with pytest.raises(LedgerError, match=r"missing required field.*output_ids, policy_version"):
        make_call(d)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"status": "done"}, "unknown status 'done'"),
        ({"reward": "1"}, "reward must be a finite number"),
        ({"reward": float("inf")}, "reward must be a finite number"),
        ({"partial_score": 1.5}, r"partial_score must be a number in \[0, 1\]"),
        ({"session_id": None}, "session_id must be a string"),
    ],
)
def test_bad_outcome(override: dict[str, Any], message: str) -> None:
    d = {"session_id": "s1", "status": "complete", "reward": 1.0, "partial_score": 1.0}
    d.update(override)
    with pytest.raises(LedgerError, match=message):
        make_outcome(d)


def test_good_call_normalises_arrays() -> None:
    c = make_call(call_dict())
    assert c.prompt_ids.dtype.name == "int32" and c.output_logprobs.dtype.name == "float32"
    assert c.context_len == 5
