"""The canary's comparison rule (router/shadow.py): equal tokens agree; a first difference at a near-tie
(within the tolerance in the shadow's own distribution) is excused and ends the comparison; any other
difference is a divergence."""

from __future__ import annotations

from proto.pdserve.v1 import pdserve_pb2 as pb
from router.shadow import compare


def lp(token: int, logprob: float, *alternatives: tuple[int, float]) -> pb.Logprob:
    return pb.Logprob(token_id=token, logprob=logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in alternatives])


SHADOW = [lp(5, -0.1, (5, -0.1), (6, -3.0)), lp(7, -0.6931, (7, -0.6931), (8, -0.6935)), lp(9, -0.2, (9, -0.2))]


def test_equal_tokens_agree():
    assert compare([5, 7, 9], SHADOW, 1e-3) == compare([5, 7], SHADOW, 1e-3)
    assert not compare([5, 7, 9], SHADOW, 1e-3).diverged


def test_a_near_tie_is_excused_and_ends_the_comparison():
    result = compare([5, 8, 1234], SHADOW, 1e-3)  # 8 was 0.0004 behind 7: after it the runs go separate ways
    assert not result.diverged and result.position == 1


def test_a_confident_difference_diverges():
    assert compare([6, 7, 9], SHADOW, 1e-3).diverged  # 6 was 2.9 behind
    assert compare([5, 7, 4], SHADOW, 1e-3).diverged  # 4 not among the shadow's top tokens
    assert compare([5, 8, 9], SHADOW, 1e-5).diverged  # a tie wider than the tolerance is no tie
