"""The stand-in for a captured CUDA graph in the CPU tests of the graph paths
(test_mla_graph_path.py, test_eagle3_graph_path.py): an object whose replay() re-runs the
forward on the bucket's static buffers, as the graph would."""

from __future__ import annotations


class Replay:
    def __init__(self, fn):
        self.replay = fn
