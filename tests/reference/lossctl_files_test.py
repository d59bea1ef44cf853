"""lossctl with files, against a fresh lossd: safetensors written by an independent writer (json +
numpy, as the format describes it) go up, gradients come back into safetensors and .npy files that
an independent reader (json + numpy) checks against torch, and dtype conversion on the way is the
same rounding torch does, bit for bit.

Each transfer runs four ways: over data connections in many small pieces (--stripe_min_bytes and
--piece_bytes lowered, so that the pieces of 4 connections arrive concurrently and out of order),
written with pwrite (--write_mode=pwrite) and through a mapping (the default), over gRPC (--data_connection=false),
and with the defaults. Seed random per run, printed, fixed with
LOSSD_FILES_SEED=<seed>."""

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

import lossd_testing as lt

SEED_ENV = "LOSSD_FILES_SEED"
ROWS, VOCAB = 512, 3001  # vocab odd: pieces end inside rows
TRANSPORTS = {
    "pieces": ["--stripe_min_bytes=1", "--piece_bytes=65536", "--write_mode=pwrite"],
    "mapped": ["--stripe_min_bytes=1", "--piece_bytes=65536", "--write_mode=mmap"],
    "grpc": ["--data_connection=false"],
    "default": [],
}
ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I32": np.int32,
             "I64": np.int64, "F64": np.float64}


def write_safetensors(path, tensors, metadata=None):
    """The format by hand: 8-byte little-endian header length, JSON header, raw bytes."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, array) in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path):
    """{name: (dtype string, numpy array)} and the metadata, checking the layout."""
    with open(path, "rb") as f:
        raw = f.read()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    metadata = header.pop("__metadata__", {})
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        array = np.frombuffer(data[begin:end], dtype=ST_DTYPES[entry["dtype"]])
        out[name] = (entry["dtype"], array.reshape(entry["shape"]))
    return out, metadata, (8 + length) % 8


def bf16_bits(array):
    """Round-to-nearest-even bf16 bit patterns of a float32 array, as torch rounds."""
    t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def bits_to_float(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Lossctl:
    def __init__(self, binary, address):
        self.binary, self.address = binary, address

    def run(self, *args, expect=0):
        command = [self.binary, "--server=" + self.address] + list(args)
        result = subprocess.run(command, capture_output=True, text=True, timeout=240)
        if result.returncode != expect:
            raise AssertionError("%s exited %d (expected %d)\nstdout:\n%s\nstderr:\n%s" %
                                 (" ".join(command), result.returncode, expect, result.stdout,
                                  result.stderr))
        return result.stdout, result.stderr


def number(output, name):
    match = re.search(r"\b%s ([-+0-9.eE]+|nan|inf)" % name, output)
    if not match:
        raise AssertionError("no %r in lossctl output:\n%s" % (name, output))
    return float(match.group(1))


def torch_gradient(logits, targets, scale):
    """Mean cross entropy's gradient in float32 on the given float32 logits, times scale."""
    x = torch.from_numpy(logits.copy()).requires_grad_(True)
    loss = F.cross_entropy(x, torch.from_numpy(targets))
    (loss * scale).backward()
    return float(loss), x.grad.numpy()


def check_full_file_system(ctl, path, check):
    """A download into a full file system fails with RESOURCE_EXHAUSTED and leaves no file, in
    every transport and write mode (a store into a mapping of a full tmpfs would raise SIGBUS).
    The file system is a 1 MiB tmpfs in a user and mount namespace of lossctl's own (unshare -rm);
    skipped, and said so, where the machine allows no such namespace."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        print("lossctl files: full file system SKIPPED (unshare -rm: %s)" % probe.stderr.strip())
        return
    mount_point = path("full")
    os.mkdir(mount_point)
    # 64 MiB: more than the connections' socket buffers hold, so that the server is still
    # sending when the client gives up (its report of the closed connections must not win).
    np.save(path("big.npy"), np.ones((4096, 4096), dtype=np.float32))
    out, _ = ctl.run("upload", path("big.npy"))
    handle = out.strip()
    os.unlink(path("big.npy"))
    script = 'mount -t tmpfs -o size=1m none "$0" && "$@"; code=$?; ls -A "$0"; exit $code'
    for transport, flags in TRANSPORTS.items():
        for name in ("full.npy", "full.safetensors"):
            command = ["unshare", "-rm", "sh", "-c", script, mount_point, ctl.binary,
                       "--server=" + ctl.address, "download", handle,
                       os.path.join(mount_point, name)] + flags
            result = subprocess.run(command, capture_output=True, text=True, timeout=240)
            what = "download into a full file system, %s [%s]" % (name, transport)
            check(result.returncode == 1 and "RESOURCE_EXHAUSTED" in result.stderr,
                  "%s: exit %d, stderr %s" % (what, result.returncode, result.stderr.strip()))
            check(result.stdout.strip() == "", "%s left files: %s" % (what, result.stdout.split()))
    ctl.run("rm", handle)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lossd", required=True)
    parser.add_argument("--lossctl", required=True)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int(
        os.environ.get(SEED_ENV) or int.from_bytes(os.urandom(4), "little"))
    print("lossctl files: seed %d (repeat with %s=%d)" % (seed, SEED_ENV, seed))
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((ROWS, VOCAB), dtype=np.float32) * 3.0
    targets = rng.integers(0, VOCAB, size=ROWS, dtype=np.int64)
    logits_bf16 = bf16_bits(logits)
    failures = []

    def check(condition, message):
        if not condition:
            failures.append(message)
            print("FAIL " + message)

    with tempfile.TemporaryDirectory(prefix="lossctl-files-") as tmp, \
            lt.LossdServer(args.lossd, "cpu") as server:
        path = lambda name: os.path.join(tmp, name)  # noqa: E731
        model = path("model.safetensors")
        write_safetensors(model, {
            "logits": ("F32", logits),
            "logits_bf16": ("BF16", logits_bf16),
            "targets": ("I64", targets),
            "targets32": ("I32", targets.astype(np.int32)),
            "extra": ("F64", np.arange(3, dtype=np.float64)),
        }, metadata={"format": "pt"})
        np.save(path("logits.npy"), logits)
        np.save(path("targets.npy"), targets)
        ctl = Lossctl(args.lossctl, server.address)
        # The gradient of mean cross entropy on the bf16-rounded logits, as torch computes it.
        ref_loss, ref_grad = torch_gradient(bits_to_float(logits_bf16), targets, 0.5)

        for transport, flags in TRANSPORTS.items():
            what = lambda text: "%s [%s]" % (text, transport)  # noqa: E731
            # fp32 safetensors -> bf16 on the way; the stored bits are torch's rounding.
            out, _ = ctl.run("upload", model + ":logits", "--dtype=bf16", *flags)
            handle = out.strip()
            up = path("up-%s.safetensors" % transport)
            ctl.run("download", handle, up, *flags)
            tensors, _, _ = read_safetensors(up)
            check(list(tensors) == ["tensor"], what("download name %s" % list(tensors)))
            dtype, back = tensors[list(tensors)[0]]
            check(dtype == "BF16" and back.shape == (ROWS, VOCAB),
                  what("uploaded logits came back as %s %s" % (dtype, back.shape)))
            check(np.array_equal(back, logits_bf16),
                  what("fp32 -> bf16 upload differs from torch's rounding in %d elements" %
                       int(np.sum(back != logits_bf16))))
            # The same bits as .npy: float32, exact.
            ctl.run("download", handle, path("up.npy"), *flags)
            as_npy = np.load(path("up.npy"))
            check(as_npy.dtype == np.float32 and np.array_equal(as_npy, bits_to_float(logits_bf16)),
                  what("bf16 download into .npy is not the exact float32 values"))

            # Forward with targets from the same safetensors file; backward; gradient back.
            out, _ = ctl.run("forward", handle, model + ":targets")
            loss = number(out, "loss")
            check(abs(loss - ref_loss) <= 1e-5 * abs(ref_loss),
                  what("loss %.8f, torch %.8f" % (loss, ref_loss)))
            ctl.run("backward", handle, "--grad_output=0.5")
            grad_path = path("grad-%s.safetensors" % transport)
            ctl.run("download", handle, grad_path, "--dtype=bf16", *flags)
            tensors, _, pad = read_safetensors(grad_path)
            check(pad == 0, what("the data of %s does not start 8-byte aligned" % grad_path))
            check(list(tensors) == ["gradient"], what("gradient tensor names %s" % list(tensors)))
            dtype, grad_bits = tensors["gradient"]
            check(dtype == "BF16", what("gradient dtype %s, expected BF16" % dtype))
            grad = bits_to_float(grad_bits)
            # Within one bf16 rounding of torch's float32 gradient.
            tolerance = np.abs(ref_grad) * 2.0 ** -7 + 1e-9
            bad = int(np.sum(np.abs(grad - ref_grad) > tolerance))
            check(bad == 0, what("%d gradient elements beyond a bf16 ulp of torch" % bad))
            # A name given with :NAME; the gradient as stored (bf16: the logits were bf16, and
            # the in-place gradient took their place) into .npy as the exact float32 values.
            ctl.run("download", handle, path("named.safetensors:dlogits"), *flags)
            tensors, _, _ = read_safetensors(path("named.safetensors"))
            check(list(tensors) == ["dlogits"] and tensors["dlogits"][0] == "BF16" and
                  np.array_equal(tensors["dlogits"][1], grad_bits),
                  what("named download: %s" % {k: v[0] for k, v in tensors.items()}))
            ctl.run("download", handle, path("grad.npy"), *flags)
            grad32 = np.load(path("grad.npy"))
            check(grad32.dtype == np.float32 and np.array_equal(grad32, grad),
                  what("the gradient in .npy is not the bf16 gradient's exact values"))
            ctl.run("rm", handle)

            # Native BF16 from safetensors goes up unconverted, and comes back bit for bit.
            out, _ = ctl.run("upload", model + ":logits_bf16", "--label=native", *flags)
            handle = out.strip()
            ctl.run("download", handle, path("native.safetensors"), *flags)
            tensors, _, _ = read_safetensors(path("native.safetensors"))
            check(list(tensors) == ["native"] and np.array_equal(tensors["native"][1], logits_bf16),
                  what("BF16 round trip through safetensors is not exact"))
            ctl.run("rm", handle)

            # .npy fp32 -> fp16 on the way, back into .npy: numpy's own float16 rounding.
            out, _ = ctl.run("upload", path("logits.npy"), "--dtype=float16", *flags)
            handle = out.strip()
            ctl.run("download", handle, path("half.npy"), *flags)
            half = np.load(path("half.npy"))
            check(half.dtype == np.float16 and np.array_equal(half.view(np.uint16),
                                                              logits.astype(np.float16).view(
                                                                  np.uint16)),
                  what("fp32 -> fp16 upload differs from numpy's rounding"))
            ctl.run("rm", handle)

            # eval from safetensors equals eval from .npy, with int64 and int32 targets.
            out_npy, _ = ctl.run("eval", path("logits.npy"), path("targets.npy"), *flags)
            out_st, _ = ctl.run("eval", model + ":logits", model + ":targets32", *flags)
            check(number(out_npy, "loss") == number(out_st, "loss"),
                  what("eval: safetensors loss %s, .npy loss %s" %
                       (number(out_st, "loss"), number(out_npy, "loss"))))
            out_bf16, _ = ctl.run("eval", model + ":logits_bf16", model + ":targets", *flags)
            check(abs(number(out_bf16, "loss") - ref_loss) <= 1e-5 * abs(ref_loss),
                  what("eval of BF16 logits: %s, torch %.8f" % (number(out_bf16, "loss"),
                                                                ref_loss)))

        # Bad files: clear errors naming the file and what is wrong, nothing uploaded.
        write_safetensors(path("short.safetensors"), {"logits": ("F32", logits[:4])})
        with open(path("short.safetensors"), "r+b") as f:
            f.truncate(os.path.getsize(path("short.safetensors")) - 4)
        for arg, expected in [
                (path("short.safetensors"), "truncated safetensors file: tensor 'logits'"),
                (model, "name a tensor as"),
                (model + ":nope", "no tensor 'nope'; it holds 5: 'extra', 'logits'"),
                (model + ":extra", ":extra: dtype F64 is not supported"),
                (path("absent.safetensors"), "NOT_FOUND"),
        ]:
            _, err = ctl.run("upload", arg, expect=1)
            check(expected in err, "upload %s: stderr lacks %r:\n%s" % (arg, expected, err))
        with open(path("garbage.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", 7) + b'{"a": 1')
        _, err = ctl.run("eval", path("garbage.safetensors:a"), path("targets.npy"), expect=1)
        check("garbage.safetensors: malformed safetensors header: not valid JSON" in err,
              "garbage header: " + err)
        _, err = ctl.run("upload", path("targets.npy"), "--dtype=bf16", expect=2)
        check("targets.npy holds int64, which does not convert to it" in err,
              "int64 file as bf16: " + err)
        _, err = ctl.run("download", "0-x", path("x.npy"), "--write_mode=bogus", expect=2)
        check("--write_mode=bogus: expected pwrite or mmap" in err, "bad --write_mode: " + err)
        check_full_file_system(ctl, path, check)
        out, _ = ctl.run("ls")
        check(out.count("\n") == 1, "tensors left after refused uploads:\n" + out)
        # A failed download leaves no file behind.
        _, err = ctl.run("download", "0-nosuchhandle", path("never.npy"), expect=1)
        check(not os.path.exists(path("never.npy")) and
              not [n for n in os.listdir(tmp) if ".part" in n],
              "a failed download left files: %s" % os.listdir(tmp))

    print("lossctl files: %d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
