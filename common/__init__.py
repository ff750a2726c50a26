"""The bottom floor: what every process of the cluster shares and nothing else provides.

`common.logs` (structured logs with the request id), `common.heap` (keep a long-lived process's
startup heap out of the garbage collector's scans), `common.net` (ports for servers). It imports
no other package of the project, and nothing heavy (no torch, no grpc).
"""
