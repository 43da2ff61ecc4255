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

# ---- ckpt_manifest: manifest.json text as to_json_text writes it (runtime/ckpt/src/manifest.cc)
def manifest(world, stage, dtype, mixed, units, elements=1024):
    """Each rank r holds flat elements [r*n, (r+1)*n) of every unit (n = elements / world), or all
    of them at stage 0, of params (in `dtype`), master (if `mixed`), adam_m and adam_v, one file
    per kind and rank with the unit's segments one after another."""
    unit_entries, ranks = [], []
    for name, params in units:
        numel = sum(p[2] for p in params)
        offset, entries = 0, []
        for pname, shape, n in params:
            entries.append({"name": pname, "shape": shape, "offset": offset, "numel": n})
            offset += n
        unit_entries.append({"name": name, "numel": numel, "numel_padded": elements,
                             "shard_numel": elements // world, "params": entries})
    kinds = [("params", dtype)] + ([("master", "fp32")] if mixed else []) + \
        [("adam_m", "fp32"), ("adam_v", "fp32")]
    for r in range(world):
        begin, end = (0, elements) if stage == 0 else (r * elements // world, (r + 1) * elements // world)
        files, segments = [], []
        for kind, dt in kinds:
            file, at = f"rank-{r:05d}.{kind}.bin", 0
            for u in range(len(units)):
                segments.append({"unit": u, "kind": kind, "flat_begin": begin, "flat_end": end,
                                 "dtype": dt, "file": file, "offset": at})
                at += (end - begin) * (2 if dt == "bf16" else 4)
            files.append({"name": file, "bytes": at, "xxh3": f"{(0x9e3779b97f4a7c15 * (r + 1) + at) % 2**64:016x}"})
        ranks.append({"rank": r, "files": files, "segments": segments})
    return {"format": "zinf-checkpoint", "format_version": 1, "step": 40, "world_size": world,
            "stage": stage, "dtype": dtype, "mixed": mixed,
            "param_home": "nvme" if stage == 3 else "none", "optimizer_home": "cpu",
            "units": unit_entries,
            "engine": {"optimizer_steps": 40, "step_calls": 40, "skipped_steps": 0,
                       "nonfinite_in_a_row": 0, "loss_scale": 65536.0 if dtype == "bf16" else 1.0,
                       "loss_scale_good_steps": 40, "loss_scale_hysteresis_left": 2},
            "user": {"trainer_step": 40, "seed": 1234, "data": {"epoch": 0, "offset": 81920}},
            "ranks": ranks}
def put_manifest(name, m):
    put("ckpt_manifest", name, json.dumps(m, indent=1, sort_keys=True) + "\n")
mlp = [("layer0", [("w", [16, 8], 128), ("b", [16], 16)]),
       ("layer1", [("w", [4, 16], 64), ("b", [4], 4)])]
put_manifest("one_rank_fp32", manifest(1, 0, "fp32", False, mlp))
put_manifest("one_rank_bf16_mixed", manifest(1, 1, "bf16", True, mlp, elements=2048))
put_manifest("two_ranks_fp32_stage3", manifest(2, 3, "fp32", False, mlp, elements=2048))
put_manifest("two_ranks_bf16_mixed_stage2", manifest(2, 2, "bf16", True, mlp, elements=4096))
put_manifest("two_ranks_fp32_stage0", manifest(2, 0, "fp32", False, mlp))
# Malformed: each refused (tests/ckpt/manifest_test.cc has the cases the reader once accepted).
def broken(name, edit, base=None):
    m = json.loads(json.dumps(base or manifest(2, 3, "fp32", False, mlp, elements=2048)))
    edit(m)
    put_manifest(name, m)
put("ckpt_manifest", "not_json", '{"format": "zinf-checkpoint", "ranks": [')
put("ckpt_manifest", "empty_object", "{}")
broken("other_format", lambda m: m.update(format="safetensors"))
broken("format_version_2", lambda m: m.update(format_version=2))
broken("world_size_3", lambda m: m.update(world_size=3))
broken("world_size_wraps", lambda m: m.update(world_size=2**32 + 2))
broken("unit_wraps", lambda m: m["ranks"][0]["segments"][0].update(unit=2**32))
broken("numel_fraction", lambda m: m["units"][0].update(numel=144.5))
broken("bytes_negative", lambda m: m["ranks"][1]["files"][0].update(bytes=-1))
broken("xxh3_0x", lambda m: m["ranks"][0]["files"][0].update(xxh3="0x1234"))
broken("segment_past_file", lambda m: m["ranks"][1]["segments"][1].update(offset=4100))
broken("segment_offset_wraps", lambda m: m["ranks"][0]["segments"][0].update(offset=2**64 - 8))
broken("segment_reversed", lambda m: m["ranks"][0]["segments"][0].update(flat_begin=9, flat_end=3))
broken("file_listed_twice", lambda m: m["ranks"][0]["files"].append(dict(m["ranks"][0]["files"][0], bytes=2**40)))
def file_in_two_ranks(m):
    m["ranks"][1]["files"][0]["name"] = m["ranks"][0]["files"][0]["name"]
    for s in m["ranks"][1]["segments"]:
        if s["file"] == "rank-00001.params.bin":
            s["file"] = m["ranks"][0]["files"][0]["name"]
broken("file_in_two_ranks", file_in_two_ranks)
broken("file_name_nul", lambda m: m["ranks"][0]["files"][2].update(name="rank-00000.adam_m.bin\0.x"))
broken("file_outside", lambda m: m["ranks"][0]["files"][2].update(name="../rank-00000.adam_m.bin"))
broken("ranks_swapped", lambda m: m["ranks"].reverse())
broken("param_past_unit", lambda m: m["units"][1]["params"][1].update(offset=66))
broken("shape_mismatch", lambda m: m["units"][0]["params"][0].update(shape=[8, 8]))
broken("param_named_twice", lambda m: m["units"][0]["params"][1].update(name="w"))
broken("user_64_levels", lambda m: m.update(user=json.loads("[" * 64 + "]" * 64)))  # the most
broken("engine_65_levels", lambda m: m.update(engine={"deep": json.loads("[" * 64 + "]" * 64)}))
