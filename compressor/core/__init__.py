"""The bottom layer: what every stage shares and nothing of the package is imported by.

errors (exit codes and error classes), version, archs (where FFN blocks live,
per architecture: data, not code paths), stats (mergeable least-squares
statistics), params, finite (NaN/Inf checks), progress, distributed
(torch.distributed helpers), onload (layers' weights off the compute device),
modeling (the replacement modules, copied into every checkpoint).
"""
