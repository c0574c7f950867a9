"""One timed run of the harness: pieces of a run merged back into one (the interleaved batch-1
cells of infer/eval/harness.py; their order and results are tested in test_harness.py)."""

import pytest

from infer.eval.machine import CpuWindow
from infer.eval.runs import Run, merge_runs
from infer.metrics import SpecMetrics
from infer.timing import EngineTimers


def test_merge_runs_pools_pieces_into_one_run():
    """Pieces of one engine's run: outputs in order, counters, tokens, seconds and step timings
    summed, other processes' cores averaged over wall time."""
    def piece(outputs, accepted, seconds, other, step_s):
        m = SpecMetrics()
        m.record(2, accepted)
        t = EngineTimers.on("cpu")
        t.step.durations, t.step.seconds, t.step.calls = [step_s], step_s, 1
        return Run(outputs, m, sum(map(len, outputs)), seconds, 0, t, "cpu",
                   CpuWindow(seconds, seconds, other), at=seconds)

    run = merge_runs([piece([[1, 2]], 1, 1.0, 0.0, 0.01), piece([[3], [4, 5, 6]], 2, 3.0, 0.4,
                                                                  0.03)])
    assert run.outputs == [[1, 2], [3], [4, 5, 6]] and run.tokens == 6 and run.seconds == 4.0
    assert (run.metrics.num_drafts, run.metrics.num_accepted_tokens) == (2, 3)
    assert run.metrics.num_accepted_tokens_per_pos == [2, 1]
    assert run.timers.step.calls == 2 and run.timers.step.durations == [0.01, 0.03]
    assert run.cpu.wall_s == 4.0 and run.cpu.other_cores == pytest.approx(0.3)
    assert run.tok_s == 1.5 and run.at == 2.0
