"""What may cross between the grader and its sandbox, both ways: bounded JSON and safetensors, nothing else.

The child runs the learner's code, which may run anything, so every byte it sends is
hostile. The grader never unpickles it, never unzips it, and never lets it choose an
allocation: a message is one **safetensors** file (https://huggingface.co/docs/safetensors:
an 8-byte little-endian header length, a JSON header of ``{name: {dtype, shape,
data_offsets}}``, then the raw bytes), whose ``__metadata__`` holds the message itself as
JSON, with each tensor written as ``{"__tensor__": name}``.

:func:`decode_message` checks, before it allocates anything: the header length against the
bytes received and :data:`MAX_HEADER_BYTES`; the JSON's nesting depth and node count (a
scan of the text, so a header of 4000 ``[`` is refused without recursion, and JSON has no
shared references that could expand); each tensor's dtype (a fixed list), rank, shape and
byte count against its offsets, the offsets against the data (in order, no gaps, no
overlap), and the elements of all tensors together against :data:`MAX_ELEMENTS`. A tensor
is then a copy of exactly its own bytes. Any failure is a :class:`BadPayload`.

:func:`encode_message` is the child's side; the format is the safetensors library's own
(``tests/grading/test_protocol.py`` reads ours with it and its files with ours).

The grader's requests to the sandbox's server travel the same way (:func:`encode_request`,
:func:`decode_request`), so the server needs no class of attnlab's to read them and nothing
is unpickled on either side. This module is one of the runner's files (:mod:`.server`): it
imports only the standard library and torch.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

__all__ = ["BadPayload", "Frozen", "freeze", "encode_message", "decode_message", "bounded_json", "encode_request",
           "decode_request", "MAX_HEADER_BYTES", "MAX_ELEMENTS", "MAX_DEPTH", "MAX_NODES", "MAX_REQUEST_BYTES"]

MAX_HEADER_BYTES = 1 << 20  # the JSON header, the message included (a result's text is capped at 4000 chars)
MAX_ELEMENTS = 1 << 23  # tensor elements in one message, all tensors together (64 MB of float64)
# JSON nesting: a message is at most 16 deep (3 down to a value, 2 for each of _portable's 6 container
# levels, 1 for a leaf); 12 refused a learner's answer of lists 5 deep whole (issue 61's fuzz tier)
MAX_DEPTH = 20
MAX_NODES = 100_000  # JSON values in one message
MAX_REQUEST_BYTES = 1 << 26  # one request from the grader: a 1 MB source, or a task's inputs

# safetensors' dtype names; only those a lab's answer can be
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}


# --------------------------------------------------------------------------- #
# The trust boundary in the child (issue 61): what a learner's process can rebind is never called
# --------------------------------------------------------------------------- #
# Captured when this module is imported, in the zygote, before any learner code has run. A learner
# who rebinds torch.Tensor.detach, .clone, .numpy or .device (a store the static rule refuses, but a
# rule checked on the text is not a fence) changes torch.Tensor's own dict; these are the methods
# of torch._C.TensorBase, an immutable C type, and numpy's, another ("cannot set 'detach' attribute
# of immutable type"). They are called on an object whose type is exactly torch.Tensor, with
# __torch_function__ switched off: a mode on the stack (the grader's own recorder too) is handed the
# method as torch.Tensor's attribute *of that name*, the rebound one. The dispatch-level recorder
# stays on and sees the ATen kernels, which no Python name reaches.
_TENSOR = torch.Tensor
_BASE = torch._C.TensorBase
_DETACH, _CLONE, _CPU, _RESHAPE, _VIEW, _NUMPY = (_BASE.detach, _BASE.clone, _BASE.cpu, _BASE.reshape, _BASE.view,
                                                  _BASE.numpy)
_DTYPE, _SHAPE, _STRIDE, _NUMEL = (_BASE.__dict__["dtype"].__get__, _BASE.__dict__["shape"].__get__, _BASE.stride,
                                   _BASE.numel)
_DATA_PTR, _ELEMENT_SIZE = _BASE.data_ptr, _BASE.element_size
_TOBYTES = __import__("numpy").ndarray.tobytes
_UINT8, _CONTIGUOUS = torch.uint8, torch.contiguous_format
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
_type, _list, _int = type, list, int


class Frozen:
    """A tensor's answer as bytes: its dtype's safetensors name, its shape, its strides and its
    elements in row-major order, copied by the captured functions above (:func:`freeze`), with
    where the learner's tensor keeps its first element (``address``, ``itemsize``: lab 05 asks
    whether its kernels stored there). What leaves the child is this, never the learner's object."""

    __slots__ = ("dtype", "shape", "stride", "data", "address", "itemsize")

    def __init__(self, dtype: str, shape: list, stride: list, data: bytes, address: int = 0,
                 itemsize: int = 0) -> None:
        self.dtype, self.shape, self.stride, self.data = dtype, shape, stride, data
        self.address, self.itemsize = address, itemsize

    def __eq__(self, other: Any) -> bool:  # the same bytes: what _changed asks of an input
        return (_type(other) is Frozen and self.dtype == other.dtype and self.shape == other.shape
                and self.stride == other.stride and self.data == other.data)

    __hash__ = None  # type: ignore[assignment]


def freeze(value: Any) -> "Frozen | str":
    """``value``'s bytes as a :class:`Frozen` when its type is exactly ``torch.Tensor`` (on the CPU,
    of a dtype a message carries), else why not (a string). Calls nothing the learner can rebind."""
    if _type(value) is not _TENSOR:
        return f"a {_type(value).__name__[:60]}, not a plain torch.Tensor"
    dtype = _DTYPE(value)
    if dtype not in _NAMES:
        return f"a tensor of dtype {str(dtype)[:30]}"
    try:
        with _NO_TORCH_FUNCTION():
            flat = _CLONE(_CPU(_DETACH(value)), memory_format=_CONTIGUOUS)  # ours: the learner holds no alias
            data = _TOBYTES(_NUMPY(_VIEW(_RESHAPE(flat, (-1,)), _UINT8))) if _NUMEL(flat) else b""
            return Frozen(_NAMES[dtype], [_int(d) for d in _SHAPE(value)], _list(_STRIDE(value)), data,
                          _DATA_PTR(value), _ELEMENT_SIZE(value))
    except Exception as exc:  # sparse, quantised, meta, a storage freed: a tensor whose bytes cannot be read
        return f"a tensor whose elements cannot be read ({_type(exc).__name__[:40]})"


class BadPayload(ValueError):
    """The bytes are not a message this grader's child sends; the text says what was wrong."""


def bounded_json(data: bytes | str, *, max_bytes: int = MAX_HEADER_BYTES, max_depth: int = MAX_DEPTH,
                 max_nodes: int = MAX_NODES) -> Any:
    """``json.loads`` of untrusted text, refused (:class:`BadPayload`) when it is larger than
    ``max_bytes``, nests deeper than ``max_depth`` or holds more than ``max_nodes`` values,
    all found by one linear scan before the parser runs (so no RecursionError, no blow-up)."""
    if isinstance(data, bytes):
        if len(data) > max_bytes:
            raise BadPayload(f"{len(data)} bytes of JSON (at most {max_bytes})")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise BadPayload("JSON that is not UTF-8") from None
    else:
        text = data
        if len(text) > max_bytes:
            raise BadPayload(f"{len(text)} characters of JSON (at most {max_bytes})")
    depth = nodes = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
            nodes += 1
        elif ch in "[{":
            depth += 1
            nodes += 1
            if depth > max_depth:
                raise BadPayload(f"JSON nested deeper than {max_depth}")
        elif ch in "]}":
            depth -= 1
        elif ch == ",":
            nodes += 1
        if nodes > max_nodes:
            raise BadPayload(f"JSON with more than {max_nodes} values")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadPayload(f"not valid JSON: {str(exc)[:120]}") from None


def encode_message(message: Any) -> bytes:
    """The child's message as one safetensors file: every tensor (dense, contiguous, CPU)
    stored once, the rest as JSON in ``__metadata__["message"]``. Raises ``TypeError`` for a
    value JSON cannot hold."""
    tensors: list[Frozen] = []

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):  # the grader's own tensors (a request); a child sends Frozen only
            frozen = freeze(v if type(v) is torch.Tensor else v.detach().as_subclass(torch.Tensor))
            if not isinstance(frozen, Frozen):
                raise TypeError(f"cannot send {frozen}")
            v = frozen
        if isinstance(v, Frozen):
            tensors.append(v)
            return {"__tensor__": f"t{len(tensors) - 1}"}
        if isinstance(v, dict):
            return {str(k): walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if v == v and v not in (float("inf"), float("-inf")) else {"__float__": repr(v)}
        raise TypeError(f"cannot send a {type(v).__name__}")

    body = json.dumps(walk(message), allow_nan=False)
    header: dict[str, Any] = {"__metadata__": {"message": body}}
    offset = 0
    blobs = []
    for i, t in enumerate(tensors):
        raw = t.data
        header[f"t{i}"] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def decode_message(payload: bytes, *, max_elements: int = MAX_ELEMENTS) -> Any:
    """The message of :func:`encode_message`'s bytes, every tensor a copy of its own bytes;
    :class:`BadPayload` for anything else (see the module docstring for what is checked)."""
    if len(payload) < 8:
        raise BadPayload(f"{len(payload)} bytes: too short for a header")
    (n,) = struct.unpack("<Q", payload[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(payload):
        raise BadPayload(f"a header of {n} bytes in a message of {len(payload)}")
    header = bounded_json(payload[8:8 + n], max_depth=3)
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise BadPayload("the header is not a safetensors header with __metadata__")
    meta = header.pop("__metadata__")
    if set(meta) != {"message"} or not isinstance(meta["message"], str):
        raise BadPayload("__metadata__ holds other fields than the message")
    data = memoryview(payload)[8 + n:]
    tensors: dict[str, torch.Tensor] = {}
    spans = []
    budget = max_elements
    for name, entry in header.items():
        if not (isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}):
            raise BadPayload(f"tensor {name[:40]!r}: not a safetensors entry")
        dtype = _DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        shape, offsets = entry["shape"], entry["data_offsets"]
        if dtype is None:
            raise BadPayload(f"tensor {name[:40]!r}: dtype {str(entry['dtype'])[:20]!r} is not one a lab returns")
        if not (isinstance(shape, list) and len(shape) <= 8
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d for d in shape)):
            raise BadPayload(f"tensor {name[:40]!r}: a shape that is not up to 8 sizes >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise BadPayload(f"tensor {name[:40]!r}: data_offsets is not two integers")
        numel = 1
        for d in shape:
            numel *= d
            if numel > max_elements:
                break
        budget -= numel
        if budget < 0:
            raise BadPayload(f"more than {max_elements} tensor elements")
        start, end = offsets
        if not 0 <= start <= end <= len(data) or end - start != numel * dtype.itemsize:
            raise BadPayload(f"tensor {name[:40]!r}: {end - start} bytes at [{start}, {end}) for shape {shape} "
                             f"of {entry['dtype']} in {len(data)} bytes of data")
        spans.append((start, end))
        tensors[name] = (dtype, shape, start, end)
    spans.sort()
    position = 0
    for start, end in spans:  # safetensors: the tensors tile the data exactly, in order
        if start != position:
            raise BadPayload("tensor data with gaps or overlaps")
        position = end
    if position != len(data):
        raise BadPayload(f"{len(data) - position} bytes after the last tensor")
    built = {}
    for name, (dtype, shape, start, end) in tensors.items():
        raw = bytearray(data[start:end])  # a copy: the tensor owns exactly its bytes
        built[name] = (torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)).reshape(shape)
    message = bounded_json(meta["message"])

    def restore(v: Any) -> Any:
        if isinstance(v, dict):
            if set(v) == {"__tensor__"}:
                if v["__tensor__"] not in built:
                    raise BadPayload("a reference to a tensor the message does not hold")
                return built[v["__tensor__"]]
            if set(v) == {"__float__"} and v["__float__"] in ("nan", "inf", "-inf"):
                return float(v["__float__"])
            return {k: restore(x) for k, x in v.items()}
        if isinstance(v, list):
            return [restore(x) for x in v]
        return v

    return restore(message)


def _tag(value: Any) -> Any:
    """Tuples kept as tuples across JSON: ``{"__seq__": [...], "__tuple__": true}``."""
    if isinstance(value, tuple):
        return {"__seq__": [_tag(v) for v in value], "__tuple__": True}
    if isinstance(value, list):
        return [_tag(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _tag(v) for k, v in value.items()}
    return value


def encode_request(op: str, **fields: Any) -> bytes:
    """A request from the grader to the sandbox's server: ``load`` (``name``, ``source``
    bytes) or ``run`` (``calls``: ``[{"function", "args", "kwargs"}]``, ``policy``,
    ``limits``: a dict of numbers). Tensors in the calls' arguments go as safetensors."""
    if "source" in fields:
        fields["source"] = torch.frombuffer(bytearray(fields["source"]), dtype=torch.uint8) if fields["source"] \
            else torch.empty(0, dtype=torch.uint8)
    return encode_message(_tag({"op": op, **fields}))


def _untag(value: Any) -> Any:
    """Undo :func:`_tag`: tagged sequences become tuples again."""
    if isinstance(value, dict):
        if set(value) == {"__seq__", "__tuple__"}:
            return tuple(_untag(v) for v in value["__seq__"])
        return {k: _untag(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_untag(v) for v in value]
    return value


def decode_request(payload: bytes) -> dict:
    """The server's side of :func:`encode_request`: the request, its tuples tuples again."""
    request = _untag(decode_message(payload, max_elements=MAX_REQUEST_BYTES))
    if not isinstance(request, dict) or request.get("op") not in ("load", "run"):
        raise BadPayload("not a request of the grader's")
    return request
