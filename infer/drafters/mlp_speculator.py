"""IBM MLP speculator in the format vLLM loads (docs/reference.md §5).

Architecture: ``n_predict`` stages; stage ``i`` (0-based) maps the state ``s_i`` and the token
``token_i`` to the next state and the logits of the token after ``token_i``::

    s_{i+1}   = GELU(LN_i(W_i s_i + (emb_w / state_w) * E_i(token_i)))      # [.., inner_dim]
    logits_i  = H_i s_{i+1}                                                 # [.., vocab]
    state_w   = 0.5 ** (0.5 / n_predict);  emb_w = sqrt((1 - state_w**2) * inner_dim / 2)

``s_0`` is the target's last hidden state after its final norm (``ModelOutput.hidden``) at the
position that predicted ``token_0``; with ``scale_input`` it is first normalized without affine
and divided by sqrt(2). ``W_0`` maps ``emb_dim -> inner_dim``, ``W_1..`` ``inner -> inner``.

``LN`` is the norm of IBM fms-extras / vLLM / TGI (``MLPSpeculatorLayerNorm``): an L2 (RMS)
normalization, *no mean subtraction*, eps 1e-6, then ``weight * x + bias``. Checkpoints trained
with fms-extras expect exactly that, so it is reproduced here rather than ``nn.LayerNorm``.

Checkpoint: ``config.json`` (:class:`MLPSpeculatorConfig`, vLLM's keys) and
``model.safetensors`` with ``emb.{i}.weight [vocab, inner]``, ``proj.{i}.weight``
(``[inner, emb_dim]`` for i = 0, ``[inner, inner]`` after), ``head.{i}.weight [vocab, inner]``,
``ln.{i}.weight`` / ``ln.{i}.bias [inner]``, i = 0 .. n_predict - 1.

``tie_weights``: vLLM builds ``ModuleList([m] * n)`` of one shared module and loads by
``dict(model.named_parameters())``, which lists a shared parameter once, under its first name;
any other name is silently skipped. So a tied checkpoint holds exactly ``emb.0.weight``,
``proj.0.weight``, ``proj.1.weight``, ``head.0.weight``, ``ln.0.weight``, ``ln.0.bias``, which is
what :meth:`MLPSpeculator.save_pretrained` writes (safetensors cannot hold aliased tensors
anyway). On load, extra per-stage copies of tied tensors (``emb.2.weight``, ``proj.3.weight``,
...) are accepted and ignored like vLLM does; a ``speculator.`` prefix is stripped (vLLM too).
vLLM asserts ``n_predict > 1`` with tied weights; so does this module.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from infer.drafters.common import read_checkpoint, write_checkpoint
from infer.foundation.files import check_tensors
from infer.models.loader import resolve_dtype
from infer.foundation.validation import check_int, config_error

MODEL_TYPE = "mlp_speculator"
ARCHITECTURE = "MLPSpeculatorPreTrainedModel"
_WHERE = "mlp_speculator config.json"
_VLLM_DEFAULT_TOP_K = [5, 4, 3]  # vLLM's default, valid only with its default n_predict = 3
SQRT2 = math.sqrt(2.0)


@dataclass
class MLPSpeculatorConfig:
    """vLLM's ``MLPSpeculatorConfig`` (``config.json``), read and written losslessly."""

    emb_dim: int  # the target's hidden size
    vocab_size: int
    inner_dim: int = 0  # 0: emb_dim (vLLM's rule)
    n_predict: int = 3
    n_candidates: int = 5
    top_k_tokens_per_head: list[int] | None = None  # None: vLLM's [5, 4, 3]; len == n_predict
    tie_weights: bool = False
    scale_input: bool = False
    extra: dict = field(default_factory=dict)  # other top-level keys, written back unchanged

    def __post_init__(self) -> None:
        check_int("emb_dim", self.emb_dim, _WHERE, minimum=1)
        check_int("vocab_size", self.vocab_size, _WHERE, minimum=1)
        check_int("inner_dim", self.inner_dim, _WHERE, minimum=0)
        check_int("n_predict", self.n_predict, _WHERE, minimum=1)
        check_int("n_candidates", self.n_candidates, _WHERE, minimum=1)
        for key in ("tie_weights", "scale_input"):
            if not isinstance(getattr(self, key), bool):
                raise config_error(key, getattr(self, key), "true or false", _WHERE)
        if self.top_k_tokens_per_head is None:
            self.top_k_tokens_per_head = list(_VLLM_DEFAULT_TOP_K)
        top_k = self.top_k_tokens_per_head
        if (not isinstance(top_k, list) or len(top_k) != self.n_predict
                or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in top_k)):
            raise config_error("top_k_tokens_per_head", top_k,
                               f"a list of n_predict ({self.n_predict}) integers >= 1", _WHERE)
        if self.tie_weights and self.n_predict < 2:
            raise config_error("tie_weights", True, "false when n_predict is 1 (there are no "
                               "stages to tie; vLLM refuses it too)", _WHERE)

    @property
    def hidden_dim(self) -> int:
        """The stages' width (``inner_dim``, or ``emb_dim`` when it is 0)."""
        return self.inner_dim or self.emb_dim

    @property
    def state_weight(self) -> float:
        return 0.5 ** (0.5 / self.n_predict)

    @property
    def emb_weight(self) -> float:
        return math.sqrt((1 - self.state_weight ** 2) * self.hidden_dim / 2)

    def to_dict(self) -> dict:
        return {
            **self.extra,
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "emb_dim": self.emb_dim,
            "inner_dim": self.inner_dim,
            "n_predict": self.n_predict,
            "n_candidates": self.n_candidates,
            "top_k_tokens_per_head": list(self.top_k_tokens_per_head),
            "vocab_size": self.vocab_size,
            "tie_weights": self.tie_weights,
            "scale_input": self.scale_input,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "MLPSpeculatorConfig":
        """Parse vLLM's config.json; missing optional keys get vLLM's defaults."""
        if d.get("model_type") != MODEL_TYPE:
            raise config_error("model_type", d.get("model_type"), f"{MODEL_TYPE!r}", _WHERE)
        for key in ("emb_dim", "vocab_size"):
            if key not in d:
                raise config_error(key, None, "an integer >= 1 (required)", _WHERE)
        known = {"architectures", "model_type", "emb_dim", "inner_dim", "n_predict",
                 "n_candidates", "top_k_tokens_per_head", "vocab_size", "tie_weights",
                 "scale_input", "torch_dtype"}  # torch_dtype: written from the weights on save
        return cls(emb_dim=d["emb_dim"], vocab_size=d["vocab_size"],
                   inner_dim=d.get("inner_dim", 0), n_predict=d.get("n_predict", 3),
                   n_candidates=d.get("n_candidates", 5),
                   top_k_tokens_per_head=d.get("top_k_tokens_per_head"),
                   tie_weights=d.get("tie_weights", False),
                   scale_input=d.get("scale_input", False),
                   extra={k: v for k, v in d.items() if k not in known})

    @classmethod
    def for_target(cls, target, *, n_predict: int = 3, inner_dim: int = 0,
                   **kwargs) -> "MLPSpeculatorConfig":
        """A speculator for ``target`` (a :class:`~infer.models.llama.ModelConfig`);
        ``top_k_tokens_per_head`` defaults to ``max(5 - i, 1)`` per head."""
        kwargs.setdefault("top_k_tokens_per_head", [max(5 - i, 1) for i in range(n_predict)])
        return cls(emb_dim=target.hidden_size, vocab_size=target.vocab_size,
                   inner_dim=inner_dim, n_predict=n_predict, **kwargs)


class MLPSpeculatorLayerNorm(nn.Module):
    """fms-extras / vLLM norm: ``x * rsqrt(mean(x^2) + eps)`` then optional ``weight * x + bias``
    (no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-6, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        if self.weight is not None:
            y = self.weight * y + self.bias
        return y


class MLPSpeculator(nn.Module):
    """See the module doc. ``forward_train`` for teacher-forced training, ``draft`` / ``step``
    for inference."""

    def __init__(self, config: MLPSpeculatorConfig):
        super().__init__()
        self.config = config
        n, d, v, e = config.n_predict, config.hidden_dim, config.vocab_size, config.emb_dim
        if config.tie_weights:  # one module repeated: named_parameters lists it once, at index 0
            emb, head, ln = nn.Embedding(v, d), nn.Linear(d, v, bias=False), \
                MLPSpeculatorLayerNorm(d)
            proj_tied = nn.Linear(d, d, bias=False)
            self.emb = nn.ModuleList([emb] * n)
            self.proj = nn.ModuleList([nn.Linear(e, d, bias=False)] + [proj_tied] * (n - 1))
            self.head = nn.ModuleList([head] * n)
            self.ln = nn.ModuleList([ln] * n)
        else:
            self.emb = nn.ModuleList(nn.Embedding(v, d) for _ in range(n))
            self.proj = nn.ModuleList(nn.Linear(e if i == 0 else d, d, bias=False)
                                      for i in range(n))
            self.head = nn.ModuleList(nn.Linear(d, v, bias=False) for _ in range(n))
            self.ln = nn.ModuleList(MLPSpeculatorLayerNorm(d) for _ in range(n))
        self.ln0 = MLPSpeculatorLayerNorm(e, affine=False) if config.scale_input else None
        self.activation = nn.GELU()
        self.state_weight = config.state_weight
        self.emb_weight = config.emb_weight

    @property
    def n_predict(self) -> int:
        return self.config.n_predict

    # ---- forwards ----------------------------------------------------------------------------

    def prepare(self, hidden: Tensor) -> Tensor:
        """Target hidden ``[.., emb_dim]`` -> ``s_0`` (scaled when ``scale_input``)."""
        return self.ln0(hidden) / SQRT2 if self.ln0 is not None else hidden

    def step(self, i: int, state: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Stage ``i``: ``state [.., D_i]``, ``tokens [..]`` -> ``(logits [.., V], next state)``."""
        z = self.emb[i](tokens).to(state.dtype)
        s = self.proj[i](state) + (self.emb_weight / self.state_weight) * z
        s = self.activation(self.ln[i](s))
        return self.head[i](s), s

    def forward_train(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Teacher-forced logits ``[n_predict, B, T, V]``.

        ``hidden [B, T, emb_dim]``: the target's final hidden state at each position t (the one
        that predicts token t+1); ``tokens [B, T, n]`` (n <= n_predict): ``tokens[b, t, i]`` is
        the ground-truth token ``t + 1 + i``. Stage i's logits at t predict token ``t + 2 + i``.
        Typical: ``tokens[..., i] = ids[:, 1 + i : 1 + i + T]`` for a sequence ``ids``.
        """
        n = tokens.shape[-1]
        if n > self.n_predict or tokens.shape[:2] != hidden.shape[:2]:
            raise ValueError(f"forward_train: tokens {tuple(tokens.shape)} must be [B, T, <= "
                             f"{self.n_predict}] with B, T of hidden {tuple(hidden.shape)}")
        state, out = self.prepare(hidden), []
        for i in range(n):
            logits, state = self.step(i, state, tokens[..., i])
            out.append(logits)
        return torch.stack(out)

    def forward(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        return self.forward_train(hidden, tokens)

    @torch.no_grad()
    def draft(self, hidden: Tensor, last_token: Tensor, k: int | None = None
              ) -> tuple[Tensor, Tensor]:
        """Greedy chain: ``hidden [B, emb_dim]`` (target state that predicted ``last_token``),
        ``last_token [B]`` -> ``(tokens [B, k], logits [B, k, V])``; ``k`` defaults to
        ``n_predict`` and may not exceed it."""
        k = self.n_predict if k is None else k
        self.check_k(k)
        state, tok, toks, logits = self.prepare(hidden), last_token, [], []
        for i in range(k):
            lg, state = self.step(i, state, tok)
            tok = lg.argmax(dim=-1)
            toks.append(tok)
            logits.append(lg)
        return torch.stack(toks, dim=1), torch.stack(logits, dim=1)

    def check_k(self, k: int) -> None:
        if not 1 <= k <= self.n_predict:
            raise ValueError(f"mlp_speculator: num_speculative_tokens={k} but the speculator has "
                             f"n_predict={self.n_predict} heads (it can draft 1 .. "
                             f"{self.n_predict} tokens)")

    # ---- checkpoint --------------------------------------------------------------------------

    def vllm_state_dict(self) -> dict[str, Tensor]:
        """Tensors under vLLM's names; a tied parameter once, under its first name."""
        return {name: p for name, p in self.named_parameters()}

    def save_pretrained(self, path: str | Path) -> Path:
        return write_checkpoint(path, self.config.to_dict(), self.vllm_state_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str | torch.dtype = "auto",
                        device: str | torch.device = "cpu") -> "MLPSpeculator":
        """Load a vLLM / fms-extras MLP speculator checkpoint, frozen, eval mode."""
        raw, state, model_dir = read_checkpoint(path, "mlp_speculator")
        config = MLPSpeculatorConfig.from_dict(raw)
        state = {k.removeprefix("speculator."): v for k, v in state.items()}
        with torch.device("meta"):
            model = cls(config)
        expected = model.vllm_state_dict()
        if config.tie_weights:  # per-stage copies of tied tensors: ignored, as vLLM does
            tied = re.compile(r"^(emb|head|ln)\.\d+\.(weight|bias)$|^proj\.\d+\.weight$")
            state = {k: v for k, v in state.items() if k in expected or not tied.match(k)}
        check_tensors(model_dir, expected, state)
        torch_dtype = resolve_dtype(dtype, raw)
        for name, value in state.items():
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            setattr(module, attr, nn.Parameter(value.to(device=device, dtype=torch_dtype),
                                               requires_grad=False))
        return model.requires_grad_(False).eval()
