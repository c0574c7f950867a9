"""Run by test_trainer.py under ``accelerate launch`` (conf/accelerate/cpu_2proc.yaml).

Each rank trains ``TinyLM`` three times: uninterrupted (exported to ``full/t/final``), crashed
after step 3, and resumed from the step-2 checkpoint (mid-epoch). It writes its parameters and
logged losses to ``OUT/rank<r>_*.safetensors`` / ``OUT/rank<r>.json`` for the test to compare.
"""

import importlib.util
import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from safetensors.torch import save_file

_spec = importlib.util.spec_from_file_location("trainer_tests",
                                               Path(__file__).with_name("test_trainer.py"))
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    state = PartialState(cpu=True)  # as train.trainer.use_cpu decides for trainer.device=cpu
    rank = state.process_index
    rows = tt.synthetic_rows(24)  # 12 batches -> 6 per rank -> 3 steps per epoch
    kw = dict(max_steps=6, grad_accum=2, save_every=2, lr=0.1)
    logger = tt.RecordingLogger()
    full, result = tt.run(tt.make_cfg(out / "full", **kw), rows, logger=logger, final=True)
    cfg = tt.make_cfg(out / "crash", **kw)
    try:
        tt.run(cfg, rows, _on_step=tt.crash_at(3))
    except tt.Crash:
        pass
    resumed, _ = tt.run(cfg, rows)
    for name, module in (("full", full), ("resumed", resumed)):
        save_file({k: v.contiguous() for k, v in module.state_dict().items()},
                  out / f"rank{rank}_{name}.safetensors")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "world": state.num_processes, "final_loss": result.metrics["loss"],
        "losses": [row["train/loss"] for row, _ in logger.rows]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
