"""Hypothesis strategies and the driver the hostile-input tests share (test_fuzz, test_fuzz_fastpath)."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
}

# Every character a UTF-8 string can carry (controls, private use, unassigned): protobuf strings and
# header JSON are UTF-8, so lone surrogates cannot reach the server at all.
any_char = st.characters(exclude_categories=("Cs",))
texts = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=any_char, max_size=200),
    st.sampled_from(["", "/", "../x", "a/b", "\x00", "\n", "name\x7f", " x", "aaaaaaaa", "a" * 64 + "/" + "b" * 64]),
    st.builds(lambda n: "x" * n, st.integers(0, 100_000)),
)


def fuzz(examples: int, strategy, check) -> None:
    settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))(given(strategy)(check))()
