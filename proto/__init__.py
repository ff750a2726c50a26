"""Protocol definitions (proto/*.proto) and the Python modules generated from them.

The generated modules (``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``) are checked in next to the
.proto files; import them as ``from proto import generate_pb2, generate_pb2_grpc``. After editing a
.proto, regenerate with ``python scripts/gen_proto.py`` (grpcio-tools pinned in pyproject's ``test``
extra); tests/unit/test_proto.py fails if the checked-in code is stale.
"""
