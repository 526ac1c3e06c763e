"""gateway.serving.admissions: the requests a gateway is still admitting, counted per model once
their model is known, and each counted until it ends, once."""

from __future__ import annotations

from gateway.serving.admissions import Admissions


def test_a_request_counts_for_every_model_until_its_model_is_known_then_for_that_one() -> None:
    admissions = Admissions()
    first, second = admissions.begin(), admissions.begin()
    assert admissions.behind("a") == admissions.behind("b") == admissions.total == 2
    first.route("a")
    assert (admissions.behind("a"), admissions.behind("b"), admissions.total) == (2, 1, 2)
    first.route("b")  # a request has one model
    assert (admissions.behind("a"), admissions.behind("b")) == (2, 1)
    second.route("b")
    assert (admissions.behind("a"), admissions.behind("b")) == (1, 1)


def test_each_admission_ends_once_whatever_ends_it_first() -> None:
    admissions = Admissions()
    routed, unread = admissions.begin(), admissions.begin()
    routed.route("a")
    routed.end()
    routed.end()  # its Generate went out, then the request's teardown ended it again
    assert (admissions.behind("a"), admissions.total) == (1, 1)
    unread.end()  # refused before its model was read
    unread.route("a")  # too late to count
    assert (admissions.behind("a"), admissions.behind("b"), admissions.total) == (0, 0, 0)
