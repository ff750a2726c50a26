"""Admission control (router/admission.py): the two bounds, the retry hint, releasing places."""

from __future__ import annotations

import pytest

from router.admission import Admission, AdmissionLimits, Refused
from router.openai_protocol import grpc_error


def test_requests_beyond_the_limit_are_refused_until_one_finishes():
    adm = Admission(AdmissionLimits(max_requests=2, max_queued_prompt_tokens=1000))
    a, b = adm.admit(10), adm.admit(10)
    with pytest.raises(Refused, match=r"router\.max_requests") as err:
        adm.admit(10)
    assert 0.05 <= err.value.retry_after_s <= 30 and "retry after" in str(err.value)
    a.started()
    a.release()
    a.release()  # twice is once
    assert adm.requests == 1
    adm.admit(10)


def test_prompt_tokens_waiting_for_prefill_are_bounded_but_a_huge_prompt_alone_gets_in():
    adm = Admission(AdmissionLimits(max_requests=100, max_queued_prompt_tokens=100))
    big = adm.admit(500)  # nothing waits: admitted, or it could never be
    with pytest.raises(Refused, match=r"router\.max_queued_prompt_tokens"):
        adm.admit(1)
    big.started()  # its first token: its prompt no longer waits
    assert adm.queued_prompt_tokens == 0
    small = [adm.admit(50), adm.admit(50)]
    with pytest.raises(Refused):
        adm.admit(1)
    small[0].release()  # ended before its first token: its tokens leave the queue too
    adm.admit(50)
    assert adm.queued_prompt_tokens == 100


def test_the_hint_follows_request_durations_and_the_http_429_carries_it():
    adm = Admission(AdmissionLimits(max_requests=1))
    adm._duration_s = 4.2
    adm.admit(1)
    with pytest.raises(Refused) as err:
        adm.admit(1)
    assert err.value.retry_after_s == pytest.approx(4.2)
    assert grpc_error("RESOURCE_EXHAUSTED", str(err.value), None, err.value.retry_after_s).headers["Retry-After"] == "5"
    assert grpc_error("RESOURCE_EXHAUSTED", "x").headers["Retry-After"] == "1"


def test_limits_must_be_positive():
    with pytest.raises(ValueError):
        AdmissionLimits(max_requests=0)
