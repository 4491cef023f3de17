"""The fetch child's errors cross the process boundary as one line each and come back as the type
the in-process fetch raises (rollout/fetch_process.py), so the worker handles them the same way;
and the rule that splits one fetch's tensors between its streams or children (split_by_bytes)."""

from __future__ import annotations

import grpc
import pytest

from broker.policy_client import ChecksumMismatch, FetchCancelled, FingerprintMismatch, split_by_bytes
from policy.manifest import DigestMismatch
from policy.manifest_check import ValuesRefused
from rollout.fetch_process import FetchRequest, error_from_line, error_line


@pytest.mark.parametrize(
    "error",
    [
        ChecksumMismatch("version 3: chunk 7 failed its xxh3 check 4 times"),
        DigestMismatch("manifest of version 3 has digest 0123456789abcdef, the signed pointer says fedcba9876543210"),
        ValuesRefused("policy version 3 refused: tensor lm_head.weight: values: 1 non-finite bf16 value(s) of 8"),
        FetchCancelled("version 3: fetch cancelled"),
        ValueError("127.0.0.1:1: connection refused (nothing listens there)"),
        OSError("cannot reserve 10 bytes of shared memory"),
    ],
)
def test_errors_come_back_as_their_type_and_text(error):
    line = error_line(error)
    assert "\n" not in line
    back = error_from_line(line)
    assert type(back) is type(error) and str(back) == str(error)


def test_fingerprint_mismatch_keeps_its_fields():
    back = error_from_line(error_line(FingerprintMismatch(expected="a" * 64, got="b" * 64, version=5)))
    assert isinstance(back, FingerprintMismatch) and (back.expected, back.got, back.version) == ("a" * 64, "b" * 64, 5)


def test_other_errors_become_one_line():
    class Boom(KeyError):
        pass

    back = error_from_line(error_line(Boom("x\ny")))
    assert type(back) is RuntimeError and "Boom" in str(back) and "\n" not in str(back)
    sub = error_from_line(error_line(FileNotFoundError(2, "gone")))  # a subclass: its base type, named
    assert type(sub) is OSError and "FileNotFoundError" in str(sub)
    assert type(error_from_line("NoSuchType what")) is RuntimeError


def test_grpc_errors_keep_their_status_code():
    class Rpc(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "connection reset\nby peer"

    back = error_from_line(error_line(Rpc()))
    assert isinstance(back, grpc.RpcError) and back.code() == grpc.StatusCode.UNAVAILABLE
    assert back.details() == "connection reset by peer"


def test_request_round_trips():
    req = FetchRequest(
        address="127.0.0.1:5", fingerprint="f" * 64, version=9, digest="d" * 64, fetch_timeout_s=3.0, streams=2
    )
    assert FetchRequest.from_bytes(req.to_bytes()) == req


def test_split_by_bytes_largest_first_onto_the_least_loaded():
    # By hand: a(5) -> g0 [5]; b(4) -> g1 [4]; c(3) -> g1 [7]; d(3) -> g0 [8]; e(1) -> g1 [8] (tie: lower).
    sizes = {"e": 1, "a": 5, "c": 3, "b": 4, "d": 3}
    assert split_by_bytes(sizes, 2) == [["a", "d"], ["e", "c", "b"]]  # each group in the order of `sizes`
    assert split_by_bytes(sizes, 1) == [list(sizes)]
    assert split_by_bytes({"x": 1, "y": 2}, 4) == [["y"], ["x"]]  # no empty group
