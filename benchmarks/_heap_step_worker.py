"""Runs a lit-model training script (argv[2:]) and measures one of its training steps (the argv[1]-th call of
``TrainStep``, the rehearsal's step being the first): the bytes of tensors the step allocates and has alive at
once at most (torch.profiler's memory events), how far glibc's main heap ([heap] in /proc/self/maps) grew during
it, and the resident set before and after. Writes one JSON line to $HEAP_STEP_OUT. Used by heap_reuse.py."""

import json
import os
import runpy
import sys

from torch.profiler import ProfilerActivity, profile

import lit_model.train.step as step_module


def heap_end() -> int:
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("[heap]"):
                return int(line.split()[0].split("-")[1], 16)
    return 0


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) * 1024


def peak_live_bytes(trace: dict) -> int:
    """The most bytes the profiled stretch's own allocations had alive at once (frees of older tensors count too)."""
    events = sorted((e for e in trace["traceEvents"] if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    live = peak = 0
    for event in events:
        live += event["args"]["Bytes"]
        peak = max(peak, live)
    return peak


def main() -> None:
    target, out = int(sys.argv[1]), os.environ["HEAP_STEP_OUT"]
    original, calls = step_module.TrainStep.__call__, [0]

    def measured(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] != target:
            return original(self, *args, **kwargs)
        heap_before, rss_before = heap_end(), rss_bytes()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = original(self, *args, **kwargs)
        heap_after, rss_after = heap_end(), rss_bytes()
        trace_path = out + ".trace.json"
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as handle:
            peak = peak_live_bytes(json.load(handle))
        os.remove(trace_path)
        with open(out, "w") as handle:
            json.dump({"step": target, "tensor_peak_bytes": peak, "heap_growth_bytes": heap_after - heap_before,
                       "rss_before_bytes": rss_before, "rss_after_bytes": rss_after}, handle)
        return result

    step_module.TrainStep.__call__ = measured
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
