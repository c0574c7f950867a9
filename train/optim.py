"""The optimizer of a training run (``trainer.optimizer``): AdamW, or Muon on the matrices with
AdamW on the rest (vllm-project/speculators' default; Jordan et al. 2024), as one optimizer
object, since accelerate prepares one and the schedule scales every group's lr alike.

Muon orthogonalises each 2-D weight's momentum update (Newton-Schulz, 5 steps), which suits
hidden matrices but not embeddings or LM heads (rows indexed by token, not a linear map of the
hidden state), nor norms and biases: those stay on AdamW. Its lr is 10x AdamW's with the update
RMS matched to AdamW's (torch's ``adjust_lr_fn="match_rms_adamw"``), weight decay 0.1, momentum
0.95 (nesterov), as speculators sets them.
"""

from __future__ import annotations

import re
from typing import Any

import torch

MUON_LR_FACTOR = 10.0
MUON_WEIGHT_DECAY = 0.1
#: a parameter whose dotted name has one of these parts is a token table: AdamW
_TOKEN_TABLES = re.compile(r"(^|\.)(lm_head|head|emb|embed|embed_tokens|embedding)(\.|$)")


def make_optimizer(objective: torch.nn.Module, tcfg) -> torch.optim.Optimizer:
    """``trainer.optimizer`` over the trainable parameters; norms and biases (1-D) get no
    weight decay."""
    named = [(n, p) for n, p in objective.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{type(objective).__name__} has no trainable parameters "
                         "(its drafter must hold parameters with requires_grad=True)")
    muon = str(tcfg.optimizer) == "muon"  # StrChoice or str
    matrices = [p for n, p in named if muon and p.ndim == 2 and not _TOKEN_TABLES.search(n)]
    taken = {id(p) for p in matrices}
    rest = [(n, p) for n, p in named if id(p) not in taken]
    groups = [{"params": [p for _, p in rest if p.ndim >= 2], "weight_decay": tcfg.weight_decay,
               "decay": True},  # the flag survives DeepSpeed's flattening of "params"
              {"params": [p for _, p in rest if p.ndim < 2], "weight_decay": 0.0,
               "decay": False}]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=tcfg.lr,
                              betas=tuple(tcfg.betas))
    if not matrices:
        return adamw
    return MuonAdamW(torch.optim.Muon(matrices, lr=MUON_LR_FACTOR * tcfg.lr,
                                      weight_decay=MUON_WEIGHT_DECAY, momentum=0.95,
                                      nesterov=True, ns_steps=5,
                                      adjust_lr_fn="match_rms_adamw"), adamw)


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped together behind one ``torch.optim.Optimizer``: ``param_groups``
    is Muon's then AdamW's (the same dicts, so a scheduler's lr reaches both); the state dict
    keeps the two apart."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw
        params = [p for g in muon.param_groups + adamw.param_groups for p in g["params"]]
        super().__init__(params, {"lr": adamw.defaults["lr"]})
        self.param_groups = muon.param_groups + adamw.param_groups  # the same group dicts

    @property
    def state(self) -> dict:  # read by accelerate and schedulers; one merged view
        return {**self.muon.state, **self.adamw.state}

    @state.setter
    def state(self, value: Any) -> None:  # Optimizer.__init__ assigns an empty one
        pass

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
