"""The exact parameter count MaxText wrote to its TensorBoard text summary (its log prints
only billions to 3 decimals). Run with the peer venv's python: tensorboardX's protobufs.
    usage: python maxtext_params.py OUT_DIR   -> prints "maxtext num_model_parameters: N"
"""
import glob
import struct
import sys

from tensorboardX.proto import event_pb2


def records(path):
    """TFRecord framing: uint64 length, uint32 crc, data, uint32 crc."""
    with open(path, "rb") as f:
        while head := f.read(12):
            (n,) = struct.unpack("<Q", head[:8])
            yield f.read(n)
            f.read(4)


for path in sorted(glob.glob(f"{sys.argv[1]}/**/events.out.tfevents*", recursive=True)):
    for rec in records(path):
        for v in event_pb2.Event.FromString(rec).summary.value:
            if v.tag.startswith("num_model_parameters"):
                print(f"maxtext num_model_parameters: {v.tensor.string_val[0].decode()}")
                sys.exit(0)
sys.exit("maxtext_params.py: no num_model_parameters summary under " + sys.argv[1])
