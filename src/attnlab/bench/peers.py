"""``attnlab bench --peers``: attnlab and torch against the attention ops of two inference
engines, float32 forward, interleaved in one run (issue 33, item 7):

* OpenVINO's ``ScaledDotProductAttention`` (opset 13), compiled for the CPU with
  ``INFERENCE_PRECISION_HINT=f32`` and torch's thread count;
* ONNX Runtime's ONNX ``Attention`` (opset 23, SDPA's layout and ``is_causal``), and its
  ``com.microsoft`` ``MultiHeadAttention`` (the contrib op most exporters emit; it takes
  ``(B, L, H*E)``, so its inputs are laid out that way once, before the timing), each in a
  session with ``intra_op_num_threads`` = torch's threads.

Each peer's output is compared with a float64 SDPA on the same inputs, so a row is only a
speed when it is also the same attention. The peers are an extra (``pip install
'attnlab[peers]'``); a peer that is not installed gets no row and is named in ``missing``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Callable, Optional

import torch

from attnlab.bench.machine import fma_peak
from attnlab.bench.timing import interleaved_medians

if TYPE_CHECKING:
    import numpy as np

__all__ = ["PEERS", "missing_peers", "peers_benchmark"]

# peer name -> the module it needs
PEERS = {"OpenVINO SDPA": "openvino", "ONNX Runtime Attention (opset 23)": "onnxruntime",
         "ONNX Runtime MultiHeadAttention": "onnxruntime"}
_ONNX_PEERS = ("ONNX Runtime Attention (opset 23)", "ONNX Runtime MultiHeadAttention")


def missing_peers() -> dict[str, str]:
    """Peer name -> the ``pip install`` line that brings it, for each peer not installed here."""
    missing = {}
    for name, module in PEERS.items():
        needs = [module] + (["onnx"] if module == "onnxruntime" else [])
        absent = [m for m in needs if importlib.util.find_spec(m) is None]
        if absent:
            missing[name] = f"pip install 'attnlab[peers]' (or: pip install {' '.join(absent)})"
    return missing


def _openvino(shape: tuple[int, int, int, int], causal: bool, threads: int) -> Callable[..., np.ndarray]:
    import numpy as np
    import openvino as ov
    import openvino.opset13 as opset

    params = [opset.parameter(list(shape), np.float32, name=name) for name in ("q", "k", "v")]
    model = ov.Model([opset.scaled_dot_product_attention(*params, causal=causal)], params)
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                      "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()
    return lambda q, k, v: request.infer([q, k, v])[0]


def _onnx_session(node, inputs: list, output, opsets: list, threads: int):
    import onnxruntime as ort
    from onnx import helper

    graph = helper.make_graph([node], "attention", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # its threads would otherwise spin after each run and slow the next implementation's turn
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _ort_attention(shape: tuple[int, int, int, int], causal: bool, threads: int) -> Callable[..., np.ndarray]:
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shape)) for n in ("Q", "K", "V")]
    output = helper.make_tensor_value_info("Y", TensorProto.FLOAT, list(shape))
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=int(causal))
    session = _onnx_session(node, inputs, output, [("", 23)], threads)
    return lambda q, k, v: session.run(None, {"Q": q, "K": k, "V": v})[0]


def _ort_mha(shape: tuple[int, int, int, int], causal: bool, threads: int) -> Callable[..., np.ndarray]:
    from onnx import TensorProto, helper

    B, H, L, E = shape
    flat = [B, L, H * E]  # (B, L, H*E): the op's own layout
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, flat) for n in ("Q", "K", "V")]
    output = helper.make_tensor_value_info("Y", TensorProto.FLOAT, flat)
    attrs = {"num_heads": H, **({"unidirectional": 1} if causal else {})}
    node = helper.make_node("MultiHeadAttention", ["Q", "K", "V"], ["Y"], domain="com.microsoft", **attrs)
    session = _onnx_session(node, inputs, output, [("", 17), ("com.microsoft", 1)], threads)
    return lambda q, k, v: session.run(None, {"Q": q, "K": k, "V": v})[0]


def _bshd(x: torch.Tensor) -> np.ndarray:
    """(B, H, L, E) -> (B, L, H*E), contiguous: MultiHeadAttention's input layout."""
    B, H, L, E = x.shape
    return x.permute(0, 2, 1, 3).reshape(B, L, H * E).contiguous().numpy()


def peers_benchmark(seq_lens: list[int], *, B: int = 1, H: int = 8, E: int = 64, causals=(False, True),
                    repeats: int = 5, progress: Optional[Callable[[int, int, str], None]] = None) -> dict:
    """Median forward time of torch's SDPA, attnlab's tiled path and each installed peer, float32,
    ``(B, H, L, E)`` for each L and causal flag, interleaved; with each output's max-abs error
    against a float64 SDPA. Returns ``{"rows": [...], "missing": missing_peers()}``."""
    import numpy as np
    import torch.nn.functional as F

    from attnlab import tiled

    missing = missing_peers()
    builders = {"OpenVINO SDPA": _openvino, "ONNX Runtime Attention (opset 23)": _ort_attention,
                "ONNX Runtime MultiHeadAttention": _ort_mha}
    threads = torch.get_num_threads()
    rows, done, total = [], 0, len(seq_lens) * len(causals)
    for L in seq_lens:
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(B, H, L, E, generator=g) for _ in range(3))
        arrays = tuple(t.numpy() for t in (q, k, v))
        flat = tuple(_bshd(t) for t in (q, k, v))
        for causal in causals:
            golden = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
            fns: dict[str, Callable[[], object]] = {
                "torch SDPA": lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                "attnlab tiled": lambda c=causal: tiled.flash_attention(q, k, v, is_causal=c),
            }
            for name, build in builders.items():
                if name in missing:
                    continue
                run = build((B, H, L, E), causal, threads)
                ins = flat if name == "ONNX Runtime MultiHeadAttention" else arrays
                fns[name] = lambda run=run, ins=ins: run(*ins)
            errors = {}
            with torch.no_grad():
                for name, fn in fns.items():
                    out = fn()  # the output to check (and a first warm-up)
                    out = torch.as_tensor(np.asarray(out)) if not isinstance(out, torch.Tensor) else out
                    if name == "ONNX Runtime MultiHeadAttention":
                        out = out.reshape(B, L, H, E).permute(0, 2, 1, 3)
                    errors[name] = (out.double() - golden).abs().max().item()
                medians = interleaved_medians(fns, repeats)
            torch_ms = medians["torch SDPA"] * 1e3
            flops = 4 * B * H * L * L * E * (0.5 if causal else 1.0)
            for name, sec in medians.items():
                ms = sec * 1e3
                rows.append({"shape": (B, H, L, E), "causal": causal, "impl": name, "ms": ms, "ratio": ms / torch_ms,
                             "gflops": flops / ms / 1e6, "max_err": errors[name]})
            done += 1
            if progress:
                progress(done, total, f"L={L} {'causal' if causal else 'full'}")
    return {"rows": rows, "missing": missing, "peak": fma_peak(), "threads": threads}
