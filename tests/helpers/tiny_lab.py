"""A lab that exists only in the tests: one module (this one) and one folder of materials
(written by the test), graded end to end with nothing under ``attnlab.grading`` touched.
It is how a new lab is added: a :class:`~attnlab.labs.Lab`, its exercises, a folder."""

from __future__ import annotations

import torch

from attnlab.grading.exercise import Exercise, Verdict, mistake, tensor_verdict, value
from attnlab.grading.sandbox import Call
from attnlab.labs import Lab

LAB = Lab("99-tiny", "Scale the scores", "one exercise: scores divided by sqrt(d_k)", file="tiny.py",
          module=__name__, needs=(), rule="This tiny lab scales scores by hand: no torch.softmax")


def _prepare(g: torch.Generator):
    scores = torch.randn(3, 5, generator=g)
    return [Call("scale", (scores, 4))], scores


def _judge(scores, results, outcome) -> dict[str, Verdict]:
    got = value(results, 0)
    expected = scores.double() / 2.0  # sqrt(4)
    return {"value": tensor_verdict(got, expected, "scaled scores",
                                    [mistake("wrong_scale", "you divided by d_k, not sqrt(d_k)", scores / 4.0)])}


EXERCISES = [Exercise("ex1", "scale", "Scale the scores", {"value": 100.0}, _prepare, _judge)]
