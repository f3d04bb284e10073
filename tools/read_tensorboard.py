#!/usr/bin/env python3
"""Reads a Loom run's TensorBoard event files with TensorBoard's own reader and prints each
scalar tag with its number of points and its last value: a check that TensorBoard accepts what
Loom writes (monitor/tensorboard.h). Needs the `tensorboard` Python package (pip install
tensorboard; not needed to build or test Loom).

    python3 tools/read_tensorboard.py RUN_DIR
"""
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

run_dir = sys.argv[1] if len(sys.argv) > 1 else "."
acc = EventAccumulator(run_dir.rstrip("/") + "/tensorboard")
acc.Reload()
tags = sorted(acc.Tags()["scalars"])
if not tags:
    sys.exit(f"no scalars under {run_dir}/tensorboard")
for tag in tags:
    points = acc.Scalars(tag)
    print(f"{tag:28s} {len(points):6d} points, last step {points[-1].step}: {points[-1].value:.6g}")
