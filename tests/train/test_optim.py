"""``trainer.optimizer`` (train/optim.py): AdamW, or Muon on the hidden matrices with AdamW on
token tables, norms and biases, stepped and saved as one optimizer."""

from types import SimpleNamespace

import torch
from torch import nn

from train.optim import MUON_LR_FACTOR, MuonAdamW, make_optimizer


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 8)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 11, bias=False)

    def forward(self, ids):
        return self.lm_head(self.norm(torch.relu(self.fc(self.embed_tokens(ids)))))


def _cfg(optimizer):
    return SimpleNamespace(optimizer=optimizer, lr=1e-2, weight_decay=0.01, betas=[0.9, 0.95])


def _train(model, opt, steps, g=None):
    g = g or torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 11, (4, 6), generator=g)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ((ids + 3) % 11).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = Head()
    opt = make_optimizer(model, _cfg("muon"))
    assert isinstance(opt, MuonAdamW)
    assert [p for g in opt.muon.param_groups for p in g["params"]] == [model.fc.weight]
    on_adamw = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    others = [model.embed_tokens.weight, model.lm_head.weight, model.fc.bias, model.norm.weight]
    assert all(id(p) in on_adamw for p in others)
    assert opt.muon.param_groups[0]["lr"] == MUON_LR_FACTOR * opt.adamw.param_groups[0]["lr"]
    assert isinstance(make_optimizer(Head(), _cfg("adamw")), torch.optim.AdamW)


def test_it_trains_and_a_schedule_reaches_both():
    torch.manual_seed(0)
    model = Head()
    opt = make_optimizer(model, _cfg("muon"))
    losses = _train(model, opt, 30)
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    _train(model, opt, 1)
    sched.step()
    assert [g["lr"] for g in opt.muon.param_groups] == [0.5 * MUON_LR_FACTOR * 1e-2]
    assert all(g["lr"] == 0.5 * 1e-2 for g in opt.adamw.param_groups)


def test_state_dict_resumes_exactly():
    torch.manual_seed(1)
    straight = Head()
    resumed = Head()
    resumed.load_state_dict(straight.state_dict())
    opt = make_optimizer(straight, _cfg("muon"))
    _train(straight, opt, 4)
    first = make_optimizer(resumed, _cfg("muon"))
    _train(resumed, first, 2)
    saved = first.state_dict()
    again = make_optimizer(resumed, _cfg("muon"))
    again.load_state_dict(saved)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # the 2 batches the straight run saw last
        torch.randint(0, 11, (4, 6), generator=g)
    _train(resumed, again, 2, g)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name

