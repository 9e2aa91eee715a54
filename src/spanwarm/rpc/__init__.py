"""Generated gRPC code, one package per API version (see scripts/gen_protos.py)."""
