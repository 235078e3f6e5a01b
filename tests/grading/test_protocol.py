"""What crosses from a sandboxed child to the grader (attnlab.grading.sandbox.protocol): safetensors
and bounded JSON. Every attack on the parser that issue 23 measured is refused before any
allocation: shared nested references, a re-packed DEFLATE zip, a header of 4000 '[', a
tensor that claims more than its bytes."""

from __future__ import annotations

import io
import json
import resource
import struct
import time

import pytest
import torch

from attnlab.grading.sandbox.protocol import (MAX_ELEMENTS, BadPayload, bounded_json, decode_message, encode_message)


def raw(header: dict, data: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


def message_with(value) -> dict:
    return {"status": "ok", "results": [{"value": value}], "violations": []}


def test_a_message_round_trips_with_every_dtype_and_shape():
    tensors = [torch.randn(3, 4), torch.randn(2, 0, 5), torch.tensor(1.5, dtype=torch.float64),
               torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.tensor([True, False]),
               torch.randn(4, dtype=torch.bfloat16), torch.randn(2, 2).half(), torch.randn(5, 5).t()]
    msg = {"status": "ok", "results": [{"value": {"__seq__": tensors, "__tuple__": True}}, {"value": float("nan")},
                                       {"error": "ValueError: x", "traceback": "", "memory": False}],
           "violations": ["a"], "message": "é\u2028"}
    back = decode_message(encode_message(msg))
    got = back["results"][0]["value"]["__seq__"]
    assert all(torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape for a, b in zip(tensors, got))
    assert back["results"][1]["value"] != back["results"][1]["value"]  # NaN survives
    assert back["results"][2] == msg["results"][2] and back["message"] == msg["message"]


def test_the_format_is_the_safetensors_librarys():
    safetensors = pytest.importorskip("safetensors.torch")  # in the dev environment (transformers needs it)
    t = {"a": torch.randn(3, 2), "b": torch.arange(4, dtype=torch.int32)}
    ours = encode_message(message_with(t["a"]))
    assert torch.equal(safetensors.load(ours)["t0"], t["a"])  # the library reads what the child sends
    theirs = safetensors.save(t, metadata={"message": json.dumps(message_with({"__tensor__": "b"}))})
    assert torch.equal(decode_message(theirs)["results"][0]["value"], t["b"])  # and we read the library's


@pytest.mark.parametrize("payload,words", [
    (b"\x00" * 4, "too short"),
    (struct.pack("<Q", 1 << 62) + b"{}", "a header of"),
    (raw({"t0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "__metadata__"),
    (raw({"__metadata__": {"message": "{}", "x": "y"}}), "other fields"),
    (raw({"__metadata__": {"message": "[" * 4000 + "]" * 4000}}), "nested deeper"),
    (raw({"__metadata__": {"message": "{}"}, "t0": {"dtype": "BOOL", "shape": [10**12], "data_offsets": [0, 1]}},
         b"\0"), "tensor elements"),
    (raw({"__metadata__": {"message": "{}"}, "t0": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}},
         b"\0" * 16), "bytes at"),
    (raw({"__metadata__": {"message": "{}"}, "t0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "t1": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12), "gaps or overlaps"),
    (raw({"__metadata__": {"message": "{}"}}, b"extra"), "after the last tensor"),
    (raw({"__metadata__": {"message": "{}"}, "t0": {"dtype": "c64", "shape": [1], "data_offsets": [0, 8]}},
         b"\0" * 8), "dtype"),
    (raw({"__metadata__": {"message": "{}"}, "t0": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}),
     "shape"),
    (raw({"__metadata__": {"message": '{"v": {"__tensor__": "t9"}}'}}), "does not hold"),
    (raw({"__metadata__": {"message": '{"a": 1' + "9" * 5000 + "}"}}), "not valid JSON"),
])
def test_a_malformed_payload_is_refused_with_the_reason(payload, words):
    with pytest.raises(BadPayload, match=words):
        decode_message(payload)


def test_shared_nested_references_cannot_expand():
    """torch.load rebuilt a 1 KB pickle of shared references into 64^6 nodes and the grader
    hung walking them; JSON has no shared references, so the same shape must be written out
    in full, and the node budget refuses it at its size, in linear time."""
    text = "[" + ",".join(["0"] * 64) + "]"
    for _ in range(2):
        text = "[" + ",".join([text] * 64) + "]"  # 64^3 leaves written out: 530 KB, under the size cap
    assert len(text) < 1 << 20
    t0 = time.process_time()
    with pytest.raises(BadPayload, match="more than 100000 values"):
        bounded_json(text.encode())
    assert time.process_time() - t0 < 5.0  # CPU time, not wall: one linear scan (~0.05 s here)


def test_a_deflate_zip_is_never_opened():
    """The torch.save zip re-packed as DEFLATE took the grader to 2 GB: the parser does not read
    zips at all, so its RSS does not move."""
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data/0", b"\0" * (256 << 20))  # 256 MB that compresses to ~250 KB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(BadPayload):
        decode_message(buf.getvalue())
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KB: nothing was inflated


def test_the_header_budget_of_the_server():
    assert bounded_json(b'{"status": "ok", "code": 0, "elapsed": 0.1}', max_depth=1, max_nodes=16)["code"] == 0
    for bad in (b"[" * 4000, b'{"a": {"b": 1}}', b'{"a": "' + b"x" * 5000 + b'"}'):
        with pytest.raises(BadPayload):
            bounded_json(bad, max_bytes=4096, max_depth=1, max_nodes=16)


def test_element_budget_counts_all_tensors_together():
    t = torch.zeros(MAX_ELEMENTS // 2 + 1, dtype=torch.bool)
    with pytest.raises(BadPayload, match="tensor elements"):
        decode_message(encode_message(message_with([t, t.clone()])))


def test_a_huge_sparse_file_is_refused_before_it_is_read(tmp_path):
    """A 2 GiB sparse attention.py took the grader to 2.3 GB of RSS: now its size is read first."""
    from attnlab.grading import grade

    huge = tmp_path / "attention.py"
    with open(huge, "wb") as f:
        f.truncate(2 << 30)  # sparse: no disk used
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = grade(huge, sandbox="none")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KB
    assert report.score == 0 and "a lab file is at most 1,048,576" in report.problem
