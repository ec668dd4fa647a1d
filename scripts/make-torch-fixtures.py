#!/usr/bin/env python3
"""Write small real torch.save fixtures for tests/model/test_ckpt_torch.c.

Needs torch 2.x and transformers (4.x or 5.x); no network. Run from anywhere:

    python3 scripts/make-torch-fixtures.py [OUTDIR]   # default tests/model/data/torch

It writes, under OUTDIR, one directory per fixture, each with an expected.json
listing every tensor of every .bin file in it (file, name, dtype, shape, the
float64 sum of all elements, the first 4 elements in C order, whether torch
sees it as contiguous, and alias_of when torch hands back the same data
pointer as an earlier tensor). The expected values are computed by torch
itself, from `torch.load(..., weights_only=True)` of the written file, so they
describe exactly what is on disk.

  opt-micro-causallm/  OPTForCausalLM.save_pretrained(safe_serialization=False): keys model.decoder.*
  opt-micro-decoder/   OPTModel in float16 (keys decoder.*, like facebook/opt-125m's file)
  opt-micro-sharded/   OPTForCausalLM saved in 2+ shards with pytorch_model.bin.index.json
  torch-views/         torch.save of views: a transpose, shared storages, offsets, dtypes

transformers 5.x ignores safe_serialization=False and writes safetensors only;
save_bin() then removes those and writes the same state dict (and the index,
for the sharded case) with torch.save, which is what 4.x's save_pretrained
does itself. First run: torch 2.11.0, transformers 5.17.0 (fallback taken).
"""
import glob
import json
import os
import shutil
import sys

import torch
import transformers
from transformers import OPTConfig, OPTForCausalLM, OPTModel

DTYPE_NAMES = {
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def micro_config():
    return OPTConfig(
        vocab_size=128,
        hidden_size=16,
        num_hidden_layers=2,
        ffn_dim=32,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=16,
    )


def fresh_dir(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(path)


def save_bin(model, outdir, max_shard_size=None):
    """save_pretrained to pytorch_model*.bin. Falls back to torch.save when this
    transformers version will not write .bin files (it must not leave safetensors)."""
    kwargs = {"safe_serialization": False}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    try:
        model.save_pretrained(outdir, **kwargs)
    except TypeError as e:  # a transformers without safe_serialization
        print(f"  save_pretrained({kwargs}) failed ({e}); writing with torch.save", file=sys.stderr)
    for f in glob.glob(os.path.join(outdir, "*.safetensors")) + glob.glob(
            os.path.join(outdir, "*.safetensors.index.json")):
        os.remove(f)
    bins = sorted(glob.glob(os.path.join(outdir, "pytorch_model*.bin")))
    wanted_shards = max_shard_size is not None
    if bins and (not wanted_shards or len(bins) >= 2):
        return
    print(f"  save_pretrained wrote {len(bins)} .bin file(s); writing them with torch.save", file=sys.stderr)
    for f in bins:
        os.remove(f)
    model.config.save_pretrained(outdir)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if not wanted_shards:
        torch.save(sd, os.path.join(outdir, "pytorch_model.bin"))
        return
    names = list(sd)
    half = len(names) // 2
    parts = [names[:half], names[half:]]
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        fname = f"pytorch_model-{i + 1:05d}-of-{len(parts):05d}.bin"
        torch.save({k: sd[k] for k in part}, os.path.join(outdir, fname))
        for k in part:
            weight_map[k] = fname
            total += sd[k].numel() * sd[k].element_size()
    with open(os.path.join(outdir, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def describe(outdir):
    """expected.json entries for every .bin in outdir, computed by torch from the files."""
    entries = []
    for path in sorted(glob.glob(os.path.join(outdir, "*.bin"))):
        sd = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(sd, dict):
            raise SystemExit(f"{path}: top-level object is {type(sd)}, not a dict")
        seen_ptr = {}
        for name, t in sd.items():
            if not isinstance(t, torch.Tensor):
                raise SystemExit(f"{path}: {name} is {type(t)}, not a tensor")
            if t.dtype not in DTYPE_NAMES:
                raise SystemExit(f"{path}: {name} has dtype {t.dtype}, not covered by the C reader")
            e = {
                "file": os.path.basename(path),
                "name": name,
                "dtype": DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
                "sum": float(t.double().sum().item()),
                "first": [float(x) for x in t.flatten()[:4].double().tolist()],
                "contiguous": bool(t.is_contiguous()),
            }
            if t.numel() > 0 and t.is_contiguous():
                key = (t.data_ptr(), t.dtype)
                if key in seen_ptr:
                    e["alias_of"] = seen_ptr[key]
                else:
                    seen_ptr[key] = name
            entries.append(e)
    if not entries:
        raise SystemExit(f"{outdir}: no tensors found")
    return entries


def write_expected(outdir):
    doc = {
        "generator": "scripts/make-torch-fixtures.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tensors": describe(outdir),
    }
    with open(os.path.join(outdir, "expected.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    files = sorted({e["file"] for e in doc["tensors"]})
    print(f"  {outdir}: {len(doc['tensors'])} tensors in {', '.join(files)}")


def make_views(outdir):
    torch.manual_seed(0)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) - 11.5
    tied = torch.randn(3, 4)
    d = {
        "t": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous (stride 1, 4)
        "base": base,
        "row_view": base[2],  # contiguous, storage_offset 12 of base's storage
        "col_view": base[:, 1],  # strided view of the same storage
        "tied_a": tied,  # the same tensor twice: one storage, one pickle object
        "tied_b": tied,
        "half": torch.randn(5).half(),
        "bf16": torch.randn(3, 2).bfloat16(),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "i64": torch.arange(-3, 3),
        "i32": torch.tensor([[1, -2], [3, -4]], dtype=torch.int32),
        "u8": torch.tensor([0, 7, 255], dtype=torch.uint8),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    torch.save(d, os.path.join(outdir, "views.bin"))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "tests", "model", "data", "torch")
    out = os.path.abspath(out)
    print(f"torch {torch.__version__}, transformers {transformers.__version__} -> {out}")

    d = os.path.join(out, "opt-micro-causallm")
    fresh_dir(d)
    torch.manual_seed(0)
    save_bin(OPTForCausalLM(micro_config()).eval(), d)
    write_expected(d)

    d = os.path.join(out, "opt-micro-decoder")
    fresh_dir(d)
    torch.manual_seed(0)
    save_bin(OPTModel(micro_config()).half().eval(), d)
    write_expected(d)

    d = os.path.join(out, "opt-micro-sharded")
    fresh_dir(d)
    torch.manual_seed(0)
    save_bin(OPTForCausalLM(micro_config()).eval(), d, max_shard_size="20KB")
    write_expected(d)
    if not glob.glob(os.path.join(d, "pytorch_model.bin.index.json")):
        raise SystemExit(f"{d}: no pytorch_model.bin.index.json was written")

    d = os.path.join(out, "torch-views")
    fresh_dir(d)
    make_views(d)
    write_expected(d)

    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(out) for f in fs)
    print(f"total size under {out}: {total} bytes")
    if total > 1 << 20:
        print("warning: fixtures exceed 1 MB", file=sys.stderr)


if __name__ == "__main__":
    main()
