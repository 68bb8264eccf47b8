"""Tiny stand-ins for campplus.onnx and speech_tokenizer_v{2,3}.onnx with the released call signatures.

Used by the model-directory builder when no fixture set (``fixtures/onnx``) is at hand, e.g. for
``--model demo-tiny`` on a fresh machine. campplus: input f32 [B, T, 80] -> output f32 [B, 192];
tokenizer: feats f32 [B, 128, T], feats_length i32 [B] -> indices i32 [B, ceil(T / 4)] in [0, 6561).
Deterministic functions of the input, so the same prompt gives the same tokens and embedding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def campplus(seed: int = 0) -> onnx.ModelProto:
    """Mean fbank over time, then a fixed random projection to 192 dims."""
    w = (np.random.default_rng(seed).standard_normal((80, 192)) / np.sqrt(80)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1], keepdims=0),  # opset 17: axes attr
        helper.make_node("MatMul", ["mean", "w"], ["output"]),
    ]
    inits = [numpy_helper.from_array(w, "w")]
    graph = helper.make_graph(
        nodes,
        "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["B", "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", 192])],
        inits,
    )
    return _model(graph)


def speech_tokenizer(seed: int = 1) -> onnx.ModelProto:
    """4-frame average of the log-mel, projected to one value per 40 ms and hashed into [0, 6561)."""
    w = np.random.default_rng(seed).standard_normal((128, 1)).astype(np.float32)
    nodes = [
        helper.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[4], strides=[4], ceil_mode=1),
        helper.make_node("Transpose", ["pooled"], ["frames"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["frames", "w"], ["proj"]),
        helper.make_node("Squeeze", ["proj", "last"], ["flat"]),
        helper.make_node("Abs", ["flat"], ["mag"]),
        helper.make_node("Mul", ["mag", "scale"], ["scaled"]),
        helper.make_node("Floor", ["scaled"], ["whole"]),
        helper.make_node("Mod", ["whole", "vocab"], ["wrapped"], fmod=1),
        helper.make_node("Cast", ["wrapped"], ["indices"], to=TensorProto.INT32),
    ]
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.array([2], np.int64), "last"),
        numpy_helper.from_array(np.array(1000.0, np.float32), "scale"),
        numpy_helper.from_array(np.array(6561.0, np.float32), "vocab"),
    ]
    graph = helper.make_graph(
        nodes,
        "speech_tokenizer_standin",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, ["B"]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, ["B", "N"])],
        inits,
    )
    return _model(graph)


def write_standins(out_dir: Path, family: str) -> None:
    version = "v3" if family == "cosyvoice3" else "v2"
    onnx.save(campplus(), str(out_dir / "campplus.onnx"))
    onnx.save(speech_tokenizer(), str(out_dir / f"speech_tokenizer_{version}.onnx"))
