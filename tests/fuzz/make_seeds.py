#!/usr/bin/env python3
"""Writes the hand-made seeds of corpus/<target>/ (run from this folder; the config seeds also
copy tests/config/data). Seeds are small inputs that reach each decoder's branches; libFuzzer
grows from them."""
import json, os, shutil, struct

def put(target, name, data):
    os.makedirs(f"corpus/{target}", exist_ok=True)
    with open(f"corpus/{target}/{name}", "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())

# ---- config: DeepSpeed-format JSON text
os.makedirs("corpus/config", exist_ok=True)
for f in sorted(os.listdir("../config/data")):
    shutil.copy(f"../config/data/{f}", f"corpus/config/{f}")
put("config", "empty_object.json", "{}")
put("config", "not_json.json", "{\"zero_optimization\": ")
put("config", "out_of_range.json", '{"gradient_clipping": 1e400}')
put("config", "duplicate.json", '{"zero_optimization": {"stage": 1, "stage": 2}}')
put("config", "deep.json", "[" * 64 + "]" * 64)
put("config", "zinf_keys.json", json.dumps({
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "bf16": {"enabled": True}, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "stage3_prefetch_bucket_size": "auto"},
    "zinf": {"device_mem": "2G", "checksum": True}}))

# ---- store_frames: a connection's byte stream (store.cc has the grammar)
def s(b):
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<I", len(b)) + b
def frame(payload):
    return struct.pack("<I", len(payload)) + payload
hello = frame(b"\x01" + struct.pack("<I", 1) + s("secret"))
put("store_frames", "hello", hello)
put("store_frames", "hello_set_get", hello + frame(b"\x02" + s("key") + s("value")) +
    frame(b"\x03" + struct.pack("<I", 1000) + s("key")))
put("store_frames", "hello_wait_add", hello +
    frame(b"\x04" + struct.pack("<II", 50, 3) + s("a") + s("b") + s("")) +
    frame(b"\x05" + struct.pack("<q", -7) + s("counter")))
put("store_frames", "set_before_hello", frame(b"\x02" + s("k") + s("v")))
put("store_frames", "hello_twice", hello + hello)
put("store_frames", "trailing_byte", hello + frame(b"\x02" + s("k") + s("v") + b"\x00"))
put("store_frames", "wait_too_many", hello + frame(b"\x04" + struct.pack("<II", 0, 1 << 20)))
put("store_frames", "big_preauth_length", struct.pack("<I", 1 << 20) + b"\x01")

# ---- safetensors_read: whole files
def safetensors(tensors, metadata={"format": "pt"}, pad=True):
    header, data, offset = {}, b"", 0
    for name, shape, values in tensors:
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":"))
    if pad:
        text += " " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + data
put("safetensors_read", "two_tensors", safetensors([("w", [2, 2], [1, 2, 3, 4]), ("b", [2], [5, 6])]))
put("safetensors_read", "scalar_and_empty", safetensors([("s", [], [1.5]), ("e", [0, 3], [])]))
put("safetensors_read", "metadata_only", safetensors([], metadata={"producer": "zinf"}))
put("safetensors_read", "truncated", safetensors([("w", [4], [1, 2, 3, 4])])[:-3])
put("safetensors_read", "bf16", safetensors([("w", [1], [1])]).replace(b'"F32"', b'"BF16"'))
put("safetensors_read", "not_an_object", struct.pack("<Q", 2) + b"[]")

# ---- safetensors_roundtrip: count, then per tensor: name length, name, rank, dims, how, floats
def tensor(name, dims, floats, how=1):
    name = name.encode() if isinstance(name, str) else name
    return (bytes([len(name)]) + name + bytes([len(dims)]) + bytes(dims) + bytes([how]) +
            struct.pack(f"<{len(floats)}f", *floats))
put("safetensors_roundtrip", "two", bytes([2]) + tensor("w", [2, 3], range(6)) + tensor("b", [3], [1, 2, 3]))
put("safetensors_roundtrip", "empty_and_scalar", bytes([3]) + tensor("e", [0], []) +
    tensor("s", [], [7]) + tensor("f", [1, 1, 2], [1e30, -0.0]))
put("safetensors_roundtrip", "none", bytes([0]))
put("safetensors_roundtrip", "duplicate_names", bytes([2]) + tensor("x", [1], [1]) + tensor("x", [1], [2]))
put("safetensors_roundtrip", "metadata_name", bytes([1]) + tensor("__metadata__", [1], [1]))
put("safetensors_roundtrip", "count_mismatch", bytes([1]) + tensor("m", [2], [1, 2, 3], how=3 << 3))
put("safetensors_roundtrip", "latin1_name", bytes([1]) + tensor(b"caf\xe9", [1], [1]))
