#!/usr/bin/env python3
"""Write torch.save-compatible files without torch, for the C reader's tests.

torch.save (torch >= 1.6) writes a zip of STORED entries: <prefix>/data.pkl is
a pickle of the state dict in which every tensor is pickled as
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
hooks)` and every storage as a persistent id ('storage', torch.<T>Storage,
key, 'cpu', numel) whose bytes are the entry <prefix>/data/<key>.

This script reproduces that with the standard library only: stand-in modules
named `torch` and `torch._utils` are registered in sys.modules so that the
normal pickler writes the same GLOBAL opcodes torch's does, `persistent_id`
emits the storage tuples, and `__reduce_ex__` on stand-in tensors emits the
REDUCE calls. The expected values are computed here from the numbers the
script itself chose (not by reading the files back), in logical C order.

Outputs (default directory tests/model/data/torch):
  synthetic.bin         protocol 2 (what torch.save uses), written by zipfile
  synthetic-p4.bin      protocol 4 (FRAME, MEMOIZE, STACK_GLOBAL, SHORT_BINUNICODE)
  synthetic-zip64.bin   protocol 2 in a hand-built ZIP64 archive: saturated
                        32-bit fields, zip64 extra fields, EOCD64 + locator,
                        64-byte aligned data with local extras that differ from
                        the central ones, and an archive comment; the script
                        checks that Python's zipfile reads it back identically
  synthetic.expected.json
"""
import collections
import io
import json
import math
import os
import pickle
import random
import struct
import sys
import types
import zipfile
import zlib

if "torch" in sys.modules:
    sys.exit("refusing to run with the real torch imported")

# ---- stand-ins for the torch names the pickle refers to ----
torch_mod = types.ModuleType("torch")
utils_mod = types.ModuleType("torch._utils")
torch_mod._utils = utils_mod
sys.modules["torch"] = torch_mod
sys.modules["torch._utils"] = utils_mod


def _stub(module, name):
    def fn(*args):
        raise RuntimeError("stand-in, never called")

    fn.__module__ = module.__name__
    fn.__name__ = fn.__qualname__ = name
    setattr(module, name, fn)
    return fn


rebuild_tensor_v2 = _stub(utils_mod, "_rebuild_tensor_v2")
rebuild_parameter = _stub(utils_mod, "_rebuild_parameter")

# dtype -> (storage class, struct code or None for bf16, element size)
DTYPES = {
    "F16": ("HalfStorage", "e", 2),
    "F32": ("FloatStorage", "f", 4),
    "BF16": ("BFloat16Storage", None, 2),
    "F64": ("DoubleStorage", "d", 8),
    "I64": ("LongStorage", "q", 8),
    "I32": ("IntStorage", "i", 4),
    "I16": ("ShortStorage", "h", 2),
    "I8": ("CharStorage", "b", 1),
    "U8": ("ByteStorage", "B", 1),
    "BOOL": ("BoolStorage", "?", 1),
}
STORAGE_CLASS = {}
for _dt, (_cls, _, _) in DTYPES.items():
    c = type(_cls, (), {})
    c.__module__ = "torch"
    c.__qualname__ = _cls
    setattr(torch_mod, _cls, c)
    STORAGE_CLASS[_dt] = c


def encode(dtype, v):
    code = DTYPES[dtype][1]
    if dtype == "BF16":
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        if bits & 0xFFFF:
            raise ValueError(f"{v} is not exactly representable in bfloat16")
        return struct.pack("<H", bits >> 16)
    return struct.pack("<" + code, v)


def quantize(dtype, v):
    """The value the file really holds (so expected sums are exact)."""
    if dtype in ("F16", "F32"):
        code = DTYPES[dtype][1]
        return struct.unpack("<" + code, struct.pack("<" + code, v))[0]
    return v


class Storage:
    def __init__(self, dtype, key, numel):
        self.dtype, self.key, self.numel = dtype, key, numel
        # Filler that differs from every real value, so a wrong offset shows.
        if dtype == "BOOL":
            self.values = [False] * numel
        elif dtype in ("I8", "U8", "I16", "I32", "I64"):
            self.values = [100 + i % 20 for i in range(numel)]
        else:
            self.values = [-(100 + i % 100) for i in range(numel)]

    def data(self):
        return b"".join(encode(self.dtype, v) for v in self.values)


class Tensor:
    """A view: logical element idx lives at offset + sum(idx[d]*stride[d])."""

    def __init__(self, storage, offset, size, stride, values, metadata=None):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        self.metadata = metadata
        self.values = [quantize(storage.dtype, v) for v in values]
        assert len(self.values) == math.prod(size)
        written = {}
        for flat, v in enumerate(self.values):
            at, rem = offset, flat
            for d in reversed(range(len(size))):
                at += (rem % size[d]) * stride[d]
                rem //= size[d]
            # Elements that alias one slot (stride 0) must agree.
            assert written.setdefault(at, v) == v, (at, v)
            storage.values[at] = v

    def contiguous(self):
        if not self.values:
            return True
        expect = 1
        for sz, st in zip(reversed(self.size), reversed(self.stride)):
            if sz != 1:
                if st != expect:
                    return False
                expect *= sz
        return True

    def __reduce_ex__(self, proto):
        args = (self.storage, self.offset, tuple(self.size), tuple(self.stride), False,
                collections.OrderedDict())
        if self.metadata is not None:
            args += (self.metadata,)
        return (rebuild_tensor_v2, args)


class Parameter:
    def __init__(self, tensor):
        self.tensor = tensor

    def __reduce_ex__(self, proto):
        return (rebuild_parameter, (self.tensor, True, collections.OrderedDict()))


class TorchLikePickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return ("storage", STORAGE_CLASS[obj.dtype], obj.key, "cpu", obj.numel)
        return None


def build_state_dict():
    rng = random.Random(20240601)
    storages = []

    def storage(dtype, numel):
        s = Storage(dtype, str(len(storages)), numel)
        storages.append(s)
        return s

    def rand(n, lo=-2.0, hi=2.0):
        return [rng.uniform(lo, hi) for _ in range(n)]

    sd = collections.OrderedDict()
    emb = Tensor(storage("F16", 24), 0, [6, 4], [4, 1], rand(24))
    sd["decoder.embed_tokens.weight"] = emb
    sd["decoder.layers.0.fc1.weight"] = Parameter(Tensor(storage("F32", 15), 0, [3, 5], [5, 1], rand(15)))
    sd["decoder.layers.0.fc1.bias"] = Tensor(storage("BF16", 5), 0, [5], [1],
                                             [rng.randint(-64, 64) / 16 for _ in range(5)])
    shared = storage("F32", 10)  # two views at different offsets of one storage
    sd["decoder.layers.0.self_attn.k_proj.weight"] = Tensor(shared, 4, [2, 3], [3, 1], rand(6))
    sd["decoder.layers.0.self_attn.v_proj.weight"] = Tensor(shared, 0, [4], [1], rand(4))
    sd["noncontig.transposed"] = Tensor(storage("F64", 12), 0, [4, 3], [1, 4], rand(12, -50, 50))
    sd["noncontig.rows"] = Tensor(storage("F32", 7), 1, [2, 2], [3, 1], rand(4))
    row = [rng.randint(-1000, 1000) for _ in range(2)]
    sd["expanded"] = Tensor(storage("I32", 2), 0, [3, 2], [0, 1], row * 3)
    sd["scalar"] = Tensor(storage("I64", 1), 0, [], [], [-5 * 10**12])
    sd["empty"] = Tensor(storage("F32", 0), 0, [0, 3], [3, 1], [])
    sd["ints.i16"] = Tensor(storage("I16", 3), 0, [3], [1], [-32768, 12345, 32767])
    sd["ints.i8"] = Tensor(storage("I8", 4), 0, [4], [1], [-128, -1, 0, 127])
    u8 = storage("U8", 300)
    sd["ints.u8"] = Tensor(u8, 0, [290], [1], [rng.randint(0, 255) for _ in range(290)])
    sd["ints.u8_tail"] = Tensor(u8, 290, [10], [1], [rng.randint(0, 255) for _ in range(10)])
    sd["flags"] = Tensor(storage("BOOL", 5), 0, [5], [1], [True, False, True, True, False])
    sd["with_metadata"] = Tensor(storage("F16", 2), 0, [1, 2], [2, 1], rand(2), metadata={"note": 1})
    sd["lm_head.weight"] = emb  # the same object: pickled once, then fetched from the memo
    # torch's state dicts carry a _metadata attribute, pickled as a trailing BUILD.
    sd._metadata = collections.OrderedDict([("", {"version": 1}), ("decoder", {"version": 1})])
    return sd, storages


def expected_entries(sd):
    out, first_name = [], {}
    for name, obj in sd.items():
        t = obj.tensor if isinstance(obj, Parameter) else obj
        e = {
            "name": name,
            "dtype": t.storage.dtype,
            "shape": list(t.size),
            "sum": math.fsum(float(v) for v in t.values),
            "first": [float(v) for v in t.values[:4]],
            "contiguous": t.contiguous(),
        }
        if id(t) in first_name:
            e["alias_of"] = first_name[id(t)]
        else:
            first_name[id(t)] = name
        out.append(e)
    return out


def pickled(sd, protocol):
    buf = io.BytesIO()
    TorchLikePickler(buf, protocol=protocol).dump(sd)
    return buf.getvalue()


def records(prefix, pkl, storages):
    recs = [(prefix + "data.pkl", pkl), (prefix + "byteorder", b"little")]
    recs += [(prefix + "data/" + s.key, s.data()) for s in storages]
    recs += [(prefix + "version", b"3\n"), (prefix + ".data/serialization_id", b"0123456789")]
    return recs


def write_zipfile(path, recs):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in recs:
            z.writestr(zipfile.ZipInfo(name, date_time=(2022, 5, 1, 0, 0, 0)), data)


def write_zip64(path, recs, comment=b"pdserve"):
    """Every size and offset goes through the ZIP64 records."""
    out, central = bytearray(), bytearray()
    sat32, dostime, dosdate = 0xFFFFFFFF, 0, (42 << 9) | (5 << 5) | 1
    for name, data in recs:
        nb, crc, off = name.encode(), zlib.crc32(data), len(out)
        local_z64 = struct.pack("<HHQQ", 1, 16, len(data), len(data))
        # Pad the local extra field ('FB' id, as torch's writer does) so data is 64-byte aligned.
        pad = (-(off + 30 + len(nb) + len(local_z64) + 4)) % 64
        local_extra = local_z64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, dostime, dosdate, crc, sat32, sat32,
                           len(nb), len(local_extra))
        out += nb + local_extra
        assert len(out) % 64 == 0
        out += data
        central_extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), off)
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, dostime, dosdate, crc,
                               sat32, sat32, len(nb), len(central_extra), 0, 0, 0, 0, sat32)
        central += nb + central_extra
    cd_off = len(out)
    out += central
    eocd64_off = len(out)
    out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, len(recs), len(recs), len(central),
                       cd_off)
    out += struct.pack("<IIQI", 0x07064B50, 0, eocd64_off, 1)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, sat32, sat32, len(comment)) + comment
    with open(path, "wb") as f:
        f.write(out)
    with zipfile.ZipFile(path) as z:  # an independent reader must agree
        names = [i.filename for i in z.infolist()]
        assert names == [n for n, _ in recs], names
        for name, data in recs:
            assert z.read(name) == data, name
        assert z.comment == comment


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "model", "data", "torch")
    os.makedirs(outdir, exist_ok=True)
    sd, storages = build_state_dict()
    files = {
        "synthetic.bin": records("synthetic/", pickled(sd, 2), storages),
        "synthetic-p4.bin": records("archive/", pickled(sd, 4), storages),
        "synthetic-zip64.bin": records("archive/", pickled(sd, 2), storages),
    }
    for fname, recs in files.items():
        path = os.path.join(outdir, fname)
        if "zip64" in fname:
            write_zip64(path, recs)
        else:
            write_zipfile(path, recs)
    expected = {
        "generator": "scripts/make-torch-like-fixture.py",
        "files": list(files),
        "tensors": expected_entries(sd),
    }
    with open(os.path.join(outdir, "synthetic.expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(f"wrote {len(files)} files and synthetic.expected.json to {outdir}")


if __name__ == "__main__":
    main()
